"""The running batch: rows of candidates from one or several prompts in one KV cache.

Rows have different lengths (different prompts, admitted at different steps), so the
cache is left-padded: every row's real columns end at the right edge, `mask` marks them,
and `positions` counts each row's own tokens for the rotary embedding. New rows are
merged in by padding whichever side is shorter; columns that only padding uses are
trimmed away after rows leave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specrej_ray.engine.runner import decode


@dataclass
class Row:
    owner: object  # the prompt's state (engine.prompt_state.PromptState)
    candidate: object  # engine.sequence.Candidate


class Batch:
    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.empty(0, 0, dtype=torch.long)
        self.positions = torch.empty(0, dtype=torch.long)
        self.logits: torch.Tensor | None = None  # next-token logits, one row per row

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def columns(self) -> int:
        return self.mask.shape[1]

    def kv_tokens(self) -> int:
        """Real (unpadded) cache positions over all rows."""
        return int(self.mask.sum())

    def add(self, rows: list[Row], cache: DynamicCache, logits: torch.Tensor, length: int) -> None:
        """Merge rows whose cache holds `length` columns, all real (a fresh prefill)."""
        mask = torch.ones(len(rows), length, dtype=torch.long, device=logits.device)
        positions = torch.full((len(rows),), length, dtype=torch.long, device=logits.device)
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions = rows, cache, mask, positions
            self.logits = logits
            return
        width = max(self.columns, length)
        _pad_cache(self.cache, width - self.columns)
        _pad_cache(cache, width - length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([_pad_mask(self.mask, width), _pad_mask(mask, width)])
        self.positions = torch.cat([self.positions, positions])
        self.logits = torch.cat([self.logits, logits])
        self.rows = self.rows + rows

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at these positions (in order); drop columns nobody uses."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.logits = None, None
            self.mask = self.mask[:0, :0]
            self.positions = self.positions[:0]
            return
        index = torch.tensor(keep, device=self.mask.device)
        used = self.mask[index].any(dim=0)
        first = int(used.nonzero()[0])  # columns before this one are padding in every row
        self.mask = self.mask[index, first:]
        self.positions = self.positions[index]
        self.logits = self.logits[index]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]

    def decode(self, model, tokens: list[int]) -> None:
        """Feed each row its sampled token; the logits become the next step's."""
        ones = torch.ones(len(self.rows), 1, dtype=torch.long, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        ids = torch.tensor(tokens, device=self.mask.device)
        self.logits = decode(model, ids, self.cache, self.mask, self.positions)
        self.positions = self.positions + 1

    def clear(self) -> None:
        self.keep([])


def _pad_cache(cache: DynamicCache, left: int) -> None:
    if left <= 0:
        return
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            pad = t.new_zeros(t.shape[0], t.shape[1], left, t.shape[3])
            setattr(layer, name, torch.cat([pad, t], dim=2))


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    left = width - mask.shape[1]
    if left == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], left), mask], dim=1)
