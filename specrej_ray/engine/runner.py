"""The model runner: prefill and decode as small plain functions over a DynamicCache."""

from __future__ import annotations

import torch
from transformers import DynamicCache


@torch.inference_mode()
def prefill(model, input_ids: list[int], rows: int) -> tuple[torch.Tensor, DynamicCache]:
    """Run the prompt once and fork its cache into `rows` identical rows.

    Returns the next-token logits [rows, vocab] and the cache.
    """
    ids = torch.tensor([input_ids], device=model.device)
    out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(rows)
    return out.logits[:, -1, :].expand(rows, -1), cache


@torch.inference_mode()
def decode(
    model, tokens: torch.Tensor, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Feed one token per row; the cache grows by one column. Returns logits [rows, vocab].

    Rows may hold different lengths: `mask` [rows, columns + 1] marks each row's real
    cache columns (left padding is 0) and the new token; `positions` [rows] is each new
    token's position in its own sequence.
    """
    out = model(
        input_ids=tokens.view(-1, 1),
        attention_mask=mask,
        position_ids=positions.view(-1, 1),
        past_key_values=cache,
        use_cache=True,
    )
    return out.logits[:, -1, :]
