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

import torch

from specrej_ray.engine.hf import cpu_linear, self_check
from specrej_ray.engine.hf.attention import install
from specrej_ray.engine.hf.kv_cache import DecodePlan, KVCache, PrefillPlan
from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, sample_next


class Rows(Protocol):
    """A group of rows as the runner sees it (engine.prompt_state.Group)."""

    prefix: object  # the prompt's prefix key
    pkey: int  # the prompt's stream key

    def __len__(self) -> int: ...
    def feed(self) -> list[int]: ...  # the token each row feeds this step
    def streams(self) -> tuple[list[int], list[int]]: ...  # candidate index, step per row


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
        """Store the prompt's K/V as `prefix`; return its next-token logits [vocab]."""
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
        tokens, positions = [], []
        for g in groups:
            feed = g.feed()
            tokens += feed
            positions += [self.kv.context(g)] * len(feed)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        pos = torch.tensor(positions, device=self.device)[:, None]
        self.kv.begin_step(groups)
        with self._layers():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             specrej_kv=self.kv, specrej_plan=DecodePlan(tuple(groups)))
        self.kv.end_step(groups)
        return out.logits[:, -1]

    def _layers(self):
        """The engine's forwards use the packed linear layers (see engine.cpu_linear)."""
        return cpu_linear.packed() if self.packed else contextlib.nullcontext()

    def sample(self, logits: torch.Tensor, groups: Sequence[Rows], params: SamplingParams,
               seed: int) -> list[list[int]]:
        """One token per row of each group, from its rows of `logits` (in group order)."""
        pkeys, index, step = [], [], []
        for g in groups:
            k, s = g.streams()
            pkeys += [g.pkey] * len(k)
            index += k
            step += s
        device = logits.device
        u = candidate_uniforms(seed, torch.tensor(pkeys, device=device),
                               torch.tensor(index, device=device),
                               torch.tensor(step, device=device))
        flat = sample_next(logits, params, u).tolist()
        out, at = [], 0
        for g in groups:
            out.append(flat[at : at + len(g)])
            at += len(g)
        return out

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[list[int]]) -> list[list[float]]:
        """The untempered log-probability of each drawn token, per group (as `sample` gives
        them): what a likelihood reward on this model scores, here for free."""
        flat = torch.tensor([t for group in tokens for t in group], device=logits.device)
        x = logits.float()
        values = (x.gather(-1, flat[:, None])[:, 0] - x.logsumexp(-1)).tolist()
        out, at = [], 0
        for group in tokens:
            out.append(values[at : at + len(group)])
            at += len(group)
        return out

    @torch.inference_mode()
    def _check(self, steps: int = self_check.STEPS) -> tuple[int, float]:
        """(bytes of K/V per token, measured; relative logit error against the model's own
        forward, see engine.hf.self_check), raising UnsupportedModel if the error is above
        what rounding alone explains. The result is kept as `self.check_result`."""
        ids, feed = self_check.probe(self.vocab, steps)
        probe = _Probe(feed)
        try:
            got = [self.prefill(probe.prefix, ids)]
            per_token = self.kv.bytes_held() // len(ids)
            self.kv.add_group(probe, probe.prefix, 1)
            for _ in feed:
                got.append(self.decode([probe])[0])
                probe.fed += 1
        finally:
            self.kv.clear()
        self.check_result = self_check.judge(self.model, ids, feed, got, self.packed)
        if not self.check_result.passes:
            raise self_check.refusal(self.check_result)
        return per_token, self.check_result.error


class _Probe:
    """One row feeding fixed tokens: the self-check's group."""

    prefix = ("specrej-check",)
    pkey = 0

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.fed = tokens, 0

    def __len__(self) -> int:
        return 1

    def feed(self) -> list[int]:
        return [self.tokens[self.fed]]

    def streams(self) -> tuple[list[int], list[int]]:
        return [0], [self.fed]
