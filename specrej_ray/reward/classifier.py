"""Sequence-classification reward model: one logit of the closed conversation."""

from __future__ import annotations

from typing import Any

import torch

from specrej_ray.reward.base import (
    RewardError,
    batches_by_length,
    check_pairs,
    encode,
    format_for_scoring,
    pad_id,
    uses_template,
)
from specrej_ray.reward.streams import Stream


class ClassifierReward:
    kind = "classifier"  # how reward.incremental scores it

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        batch_size: int = 16,
        label_index: int = 0,
        use_chat_template: bool = True,
        max_length: int | None = None,
    ) -> None:
        num_labels = getattr(model.config, "num_labels", None)
        if num_labels is not None and not 0 <= label_index < num_labels:
            raise RewardError(
                f"reward.label_index {label_index} is out of range: {name} has {num_labels} "
                f"output(s); use 0..{num_labels - 1}"
            )
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.batch_size, self.label_index, self.max_length = batch_size, label_index, max_length
        self.use_chat_template = use_chat_template
        self.pad = pad_id(tokenizer)
        # The model finds each row's last real token by pad_token_id; without one it refuses
        # batches larger than one.
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = self.pad

    def encode_pair(self, prompt: str, response: str) -> list[int]:
        _, full = format_for_scoring(self.tokenizer, prompt, response, self.use_chat_template)
        ids = encode(self.tokenizer, full, uses_template(self.tokenizer, self.use_chat_template))
        # Keep the end: a partial response is judged by its latest text.
        return ids[-self.max_length :] if self.max_length else ids

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        check_pairs(self.name, prompts, responses)
        return self._score_rows([self.encode_pair(p, r)
                                 for p, r in zip(prompts, responses, strict=True)])

    def stream(self, prompt: str, response: str, ids: list[int] | None = None) -> Stream | None:
        """What scoring this pair feeds, for incremental scoring (reward.incremental): the
        context and the response, kept; the template's closing tokens, fed and dropped. None
        when the closed conversation is not context + response + closing text, when its
        tokens as a whole differ from the pieces' (a merge across a boundary), or when
        max_length would crop it: it is scored in full then."""
        templated = uses_template(self.tokenizer, self.use_chat_template)
        context, full = format_for_scoring(self.tokenizer, prompt, response,
                                           self.use_chat_template)
        _, empty = format_for_scoring(self.tokenizer, prompt, "", self.use_chat_template)
        closing = empty[len(context) :]
        if not empty.startswith(context) or full != context + response + closing:
            return None
        ctx = encode(self.tokenizer, context, templated)
        resp = list(ids) if ids is not None else encode(self.tokenizer, response, True)
        suffix = encode(self.tokenizer, closing, True)
        if ids is None and encode(self.tokenizer, full, templated) != ctx + resp + suffix:
            return None
        if self.max_length and len(ctx) + len(resp) + len(suffix) > self.max_length:
            return None
        return Stream(ctx + resp, len(ctx), suffix=suffix)

    def score_streams(self, streams: list[Stream]) -> list[float]:
        """A full pass (no cache) over streams, as score() over text."""
        return self._score_rows([s.held + s.suffix for s in streams])

    def _score_rows(self, rows: list[list[int]]) -> list[float]:
        scores = [0.0] * len(rows)
        for batch in batches_by_length([len(r) for r in rows], self.batch_size):
            for i, s in zip(batch, self._forward([rows[i] for i in batch]), strict=True):
                scores[i] = s
        return scores

    @torch.inference_mode()
    def _forward(self, rows: list[list[int]]) -> list[float]:
        # Right padding: positions stay 0..n-1 and the model pools the last non-pad token.
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[j, : len(r)] = 1
        device = self.model.device
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        return logits[:, self.label_index].float().cpu().tolist()
