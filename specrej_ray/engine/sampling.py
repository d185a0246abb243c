"""Sampling with candidate identity.

Candidate k of a prompt draws its step-t token from one uniform number that is a pure function
of (seed, prompt, k, t): a counter-based hash, not a stateful generator. So a candidate samples
the same text whatever shares its batch, SBoN's survivors are BoN's candidates cut short, and a
resumed run regenerates the same responses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2**27, so x * _MULT fits in int64 for any 32-bit x


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # rows run to max_new_tokens (EOS and stop strings off)


def prompt_key(prompt_id: str) -> int:
    """A stable 32-bit key for a prompt id (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=4).digest(), "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MULT) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MULT) & _MASK32
    return x ^ (x >> 16)


def candidate_uniforms(
    seed: int, pkey: int | torch.Tensor, candidates: torch.Tensor, step: int | torch.Tensor
) -> torch.Tensor:
    """One uniform in (0, 1) per candidate index, float64, on the candidates' device.

    `pkey` and `step` are one value for every row, or one per row (a batch that mixes
    prompts and generated lengths); each row's number depends on its own values only.
    """
    h = torch.full_like(candidates, seed & _MASK32, dtype=torch.int64)
    for word in ((seed >> 32) & _MASK32, pkey, candidates, step):
        if isinstance(word, torch.Tensor):
            word = word.to(device=h.device, dtype=torch.int64) & _MASK32
        h = _mix32(h ^ word)
    return (h.to(torch.float64) + 0.5) / 2.0**32


# Nucleus sampling looks at this many most likely tokens first: on a large vocabulary, a
# full-vocabulary sort per step costs more than the rest of sampling.
NUCLEUS_HEAD = 512


def sample_next(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """Next token per row by inverse-CDF sampling with one uniform per row.

    Each row's token depends only on its own logits and its own uniform.
    """
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / params.temperature
    u = u.to(scaled.device)
    if params.top_k > 0:
        values, order = scaled.topk(min(params.top_k, scaled.shape[-1]), dim=-1)
        return _inverse_cdf(_nucleus(torch.softmax(values, dim=-1).double(), params.top_p),
                            order, u)
    if params.top_p < 1.0:
        return _top_p(scaled, params.top_p, u)
    return _inverse_cdf(torch.softmax(scaled, dim=-1).double(), None, u)


def _top_p(scaled: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Nucleus sampling over the stably sorted vocabulary (ties: lower token id first).

    A row whose nucleus ends strictly inside its NUCLEUS_HEAD most likely tokens, on a value
    above the head's last, is sampled from the head alone: its nucleus and order are then
    those of the full sort. Other rows (flat distributions) take the full sort. The choice
    depends on the row's own logits only.
    """
    head = min(NUCLEUS_HEAD, scaled.shape[-1])
    values, order = _stable_topk(scaled, head)
    probs = (values - scaled.logsumexp(dim=-1, keepdim=True)).double().exp()
    kept = _nucleus(probs, top_p)
    size = (kept > 0).sum(dim=-1)
    last_in = values.gather(-1, (size - 1).unsqueeze(-1)).squeeze(-1)
    fast = (size < head) & (last_in > values[:, -1])
    tokens = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)
    if fast.any():
        tokens[fast] = _inverse_cdf(kept[fast], order[fast], u[fast])
    slow = ~fast
    if slow.any():
        values, order = scaled[slow].sort(dim=-1, descending=True, stable=True)
        probs = _nucleus(torch.softmax(values, dim=-1).double(), top_p)
        tokens[slow] = _inverse_cdf(probs, order, u[slow])
    return tokens


def _stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk, ordered by value descending then index ascending (topk's tie order is free)."""
    values, order = x.topk(k, dim=-1)
    order, by_index = order.sort(dim=-1)
    values = values.gather(-1, by_index)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    return values, order.gather(-1, by_value)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest prefix (by probability) whose mass reaches top_p."""
    if top_p >= 1.0:
        return probs
    before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill(before >= top_p, 0.0)


def _inverse_cdf(probs: torch.Tensor, order: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    pos = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[-1] - 1)
    return pos.squeeze(-1) if order is None else order.gather(-1, pos).squeeze(-1)
