"""The model runner: prefill, decode and sampling over the engine's KV cache.

`prefill` runs a prompt once and keeps its K/V as the prefix every candidate of the prompt
shares; `decode` feeds one token to every row of the given groups; `sample` draws each row's
next token from its own counter-based uniform (candidate identity). A self-check at start-up
compares the engine's logits with the model's own, so an architecture the cache does not
implement fails before any work, not with wrong text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from specrej_ray.engine.hf import cpu_linear, self_check
from specrej_ray.engine.hf.attention import install
from specrej_ray.engine.hf.kv_cache import DecodePlan, KVCache, PrefillPlan
from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, sample_next


class Rows(Protocol):
    """A group of rows as the runner sees it (engine.hf.prompt_state.Group)."""

    gid: int  # its id in the cache (KVCache.add_group)
    pkey: int  # the prompt's stream key

    def __len__(self) -> int: ...
    def feed(self) -> Sequence[int]: ...  # the token each row feeds this step
    # Candidate index per row, and the step they all draw (one length a group).
    def streams(self) -> tuple[Sequence[int], int]: ...


class ModelRunner:
    def __init__(self, model) -> None:
        install(model)
        self.model = model
        self.packed = cpu_linear.available(model) and bool(cpu_linear.pack_linears(model))
        cfg = model.config.get_text_config()
        self.vocab = cfg.vocab_size
        self.kv = KVCache(cfg.num_hidden_layers)
        self.bytes_per_token, self.check_error = self._check()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def prefill(self, prefix, input_ids: Sequence[int]) -> torch.Tensor:
        """Write the prompt's K/V into the slots of `prefix` (KVCache.add_prefix took them);
        return its next-token logits [vocab]."""
        ids = torch.tensor([list(input_ids)], device=self.device)
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        with self._layers():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             logits_to_keep=1, specrej_kv=self.kv,
                             specrej_plan=PrefillPlan(prefix))
        return out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, groups: Sequence[Rows]) -> torch.Tensor:
        """Feed every row of the groups its token; next-token logits [rows, vocab]."""
        gids = [g.gid for g in groups]
        sizes = [len(g) for g in groups]
        tokens = np.concatenate([np.asarray(g.feed(), np.int64) for g in groups])
        positions = np.repeat(np.array([self.kv.context(i) for i in gids], np.int64), sizes)
        ids = torch.from_numpy(tokens).to(self.device)[:, None]
        pos = torch.from_numpy(positions).to(self.device)[:, None]
        self.kv.begin_step(gids, self.device)
        with self._layers():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             specrej_kv=self.kv, specrej_plan=DecodePlan(tuple(gids)))
        self.kv.end_step(gids)
        return out.logits[:, -1]

    def _layers(self):
        """The engine's forwards use the packed linear layers (see engine.hf.cpu_linear)."""
        return cpu_linear.packed() if self.packed else contextlib.nullcontext()

    def sample(self, logits: torch.Tensor, groups: Sequence[Rows], params: SamplingParams,
               seed: int) -> np.ndarray:
        """One token per row of the groups, from `logits` (rows in group order), drawn from
        each row's own stream (one copy to the host for the whole batch)."""
        streams = [g.streams() for g in groups]
        sizes = [len(k) for k, _ in streams]
        index = np.concatenate([np.asarray(k, np.int64) for k, _ in streams])
        # One step and one prompt key a group: O(groups) scalars, spread over rows at once.
        step = np.repeat(np.array([s for _, s in streams], np.int64), sizes)
        pkeys = np.repeat(np.array([g.pkey for g in groups], np.int64), sizes)
        device = logits.device

        def put(a):
            return torch.from_numpy(a).to(device)

        u = candidate_uniforms(seed, put(pkeys), put(index), put(step))
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
        probe = _Probe(feed)
        try:
            self.kv.add_prefix(probe.prefix, len(ids))
            got = [self.prefill(probe.prefix, ids)]
            per_token = self.kv.bytes_held() // len(ids)
            probe.gid = self.kv.add_group(probe.prefix, 1)
            for _ in feed:
                got.append(self.decode([probe])[0])
                probe.fed += 1
        finally:
            self.kv.clear()
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


class _Probe:
    """One row feeding fixed tokens: the self-check's group."""

    prefix = ("specrej-check",)
    pkey = 0

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.fed, self.gid = tokens, 0, -1

    def __len__(self) -> int:
        return 1

    def feed(self) -> list[int]:
        return [self.tokens[self.fed]]

    def streams(self) -> tuple[list[int], int]:
        return [0], self.fed
