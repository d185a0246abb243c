"""The model runner: prefill, decode and sampling over the engine's KV pool.

`prefill` runs a prompt once and keeps its K/V as the prefix every candidate of the prompt
shares; `decode` feeds one token to every row of a step; `sample` draws each row's next token
from its own counter-based uniform (candidate identity). It owns the device pool
(engine.hf.kv_pool) and reads the slot tables the scheduler decided (engine.hf.block_manager):
it never chooses a slot. A self-check at start-up
compares the engine's logits with the model's own, so an architecture the cache does not
implement fails before any work, not with wrong text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from specrej_ray.engine.hf import cpu_linear, self_check
from specrej_ray.engine.hf.attention import install
from specrej_ray.engine.hf.batch import Streams
from specrej_ray.engine.hf.block_manager import StepSlots, single_row
from specrej_ray.engine.hf.kv_pool import DecodePlan, KVPool, PrefillPlan
from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, sample_next


class ModelRunner:
    def __init__(self, model) -> None:
        install(model)
        self.model = model
        self.packed = cpu_linear.available(model) and bool(cpu_linear.pack_linears(model))
        cfg = model.config.get_text_config()
        self.vocab = cfg.vocab_size
        self.pool = KVPool(cfg.num_hidden_layers)
        self.bytes_per_token, self.check_error = self._check()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def prefill(self, slots: np.ndarray, pool_slots: int, input_ids: Sequence[int]
                ) -> torch.Tensor:
        """Write the prompt's K/V into its prefix's `slots` (the pool grown to `pool_slots`
        first); return its next-token logits [vocab]."""
        self.pool.fit(pool_slots)
        ids = torch.tensor([list(input_ids)], device=self.device)
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        plan = PrefillPlan(torch.from_numpy(slots).to(self.device))
        with self._layers():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             logits_to_keep=1, specrej_kv=self.pool, specrej_plan=plan)
        return out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, slots: StepSlots, tokens: np.ndarray, pool_slots: int) -> torch.Tensor:
        """Feed every row its token (rows as `slots` lays them out, the pool grown to
        `pool_slots` first); next-token logits [rows, vocab]."""
        self.pool.fit(pool_slots)
        ids = torch.from_numpy(tokens).to(self.device)[:, None]
        pos = torch.from_numpy(slots.positions).to(self.device)[:, None]
        self.pool.begin(slots, self.device)
        with self._layers():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             specrej_kv=self.pool,
                             specrej_plan=DecodePlan(int(slots.positions.max()) + 1))
        self.pool.end()
        return out.logits[:, -1]

    def _layers(self):
        """The engine's forwards use the packed linear layers (see engine.hf.cpu_linear)."""
        return cpu_linear.packed() if self.packed else contextlib.nullcontext()

    def sample(self, logits: torch.Tensor, streams: Streams, params: SamplingParams,
               seed: int) -> np.ndarray:
        """One token per row of `logits`, drawn from each row's own stream (one copy to the
        host for the whole batch)."""
        device = logits.device

        def put(a):
            return torch.from_numpy(a).to(device)

        u = candidate_uniforms(seed, put(streams.pkeys), put(streams.index), put(streams.step))
        return sample_next(logits, params, u).cpu().numpy()

    @staticmethod
    def logprobs(logits: torch.Tensor, drawn: np.ndarray) -> np.ndarray:
        """The untempered log-probability of each drawn token (rows as `sample` gives them):
        what a likelihood reward on this model scores, here for free."""
        flat = torch.from_numpy(drawn).to(logits.device)
        x = logits.float()
        return (x.gather(-1, flat[:, None])[:, 0] - x.logsumexp(-1)).cpu().numpy()

    @torch.inference_mode()
    def _check(self, steps: int = self_check.STEPS) -> tuple[int, float]:
        """(bytes of K/V per token, measured; relative logit error against the model's own
        forward, see engine.hf.self_check), raising UnsupportedModel if the error is above
        what rounding alone explains. The result is kept as `self.check_result`."""
        ids, feed = self_check.probe(self.vocab, steps)
        prefix, pool_slots, tables = single_row(len(ids), len(feed))
        try:
            self.pool.expect([pool_slots])
            got = [self.prefill(prefix, pool_slots, ids)]
            per_token = self.pool.slot_bytes()
            for token, slots in zip(feed, tables, strict=True):
                got.append(self.decode(slots, np.array([token], np.int64), pool_slots)[0])
        finally:
            self.pool.clear()
        self.check_result = self_check.judge(self.model, ids, feed, got, self.packed)
        if not self.check_result.passes:
            raise self_check.refusal(self.check_result)
        return per_token, self.check_result.error


def measure_self_check(model) -> dict:
    """The self-check of the engine on `model` as a record (error, spread, bound, dtype,
    passes), never raising: for benches. It builds the runner on the model, which installs
    the engine's attention (and on CPU packs its linear layers)."""
    try:
        return ModelRunner(model).check_result.as_dict()
    except Exception as e:  # a refusal carries its result; any other failure is recorded
        found = getattr(e, "self_check", None)
        return {**(found.as_dict() if found else {"passes": False}),
                "message": f"{type(e).__name__}: {e}"}
