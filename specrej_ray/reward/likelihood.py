"""LM likelihood reward: mean log-probability of the response under a scorer LM (the paper's
"probability maximization" reward).

An empty response scores the log-probability of the scorer's EOS right after the context:
the likelihood of ending here.
"""

from __future__ import annotations

import inspect
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


class LMLikelihoodReward:
    kind = "likelihood"  # how reward.incremental scores it

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        batch_size: int = 16,
        use_chat_template: bool = True,
        max_length: int | None = None,
    ) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            eos = getattr(model.generation_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None:
            raise RewardError(
                f"reward {name}: the scorer tokenizer has no eos token; use a model with one"
            )
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.batch_size, self.max_length = batch_size, max_length
        self.use_chat_template = use_chat_template
        self.eos, self.pad = int(eos), pad_id(tokenizer)
        self.keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters

    def encode_pair(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        """(context ids, target ids). Encoded separately so a BPE merge across the boundary
        cannot move response bytes into the context."""
        ctx, tgt = self._pieces(prompt, response)
        if self.max_length and len(ctx) + len(tgt) - 1 > self.max_length:
            # Drop context from the left; a response longer than the window is scored on its end.
            tgt = tgt[-self.max_length :]
            ctx = ctx[-max(1, self.max_length + 1 - len(tgt)) :]
        return ctx, tgt

    def _pieces(self, prompt: str, response: str,
                ids: list[int] | None = None) -> tuple[list[int], list[int]]:
        context, _ = format_for_scoring(self.tokenizer, prompt, response, self.use_chat_template)
        ctx = encode(self.tokenizer, context, uses_template(self.tokenizer, self.use_chat_template))
        if ids is not None:  # the generator's own tokens (same tokenizer): no re-encoding
            tgt = list(ids) or [self.eos]
        else:
            tgt = encode(self.tokenizer, response, True) if response else [self.eos]
        if not ctx:  # something must predict the first target
            bos = self.tokenizer.bos_token_id
            ctx = [self.eos if bos is None else int(bos)]
        return ctx, tgt

    def stream(self, prompt: str, response: str, ids: list[int] | None = None) -> Stream | None:
        """What scoring this pair feeds, for incremental scoring (reward.incremental): the
        context and all targets but the last, whose log-probabilities are averaged. None when
        max_length would crop it (it is scored in full then)."""
        ctx, tgt = self._pieces(prompt, response, ids)
        if self.max_length and len(ctx) + len(tgt) - 1 > self.max_length:
            return None
        return Stream((ctx + tgt)[:-1], len(ctx) - 1, targets=tgt)

    def score_streams(self, streams: list[Stream]) -> list[float]:
        """A full pass (no cache) over streams, as score() over text."""
        rows = [(s.held[: len(s.held) + 1 - len(s.targets)], s.targets) for s in streams]
        return self._score_rows(rows)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        check_pairs(self.name, prompts, responses)
        return self._score_rows([self.encode_pair(p, r)
                                 for p, r in zip(prompts, responses, strict=True)])

    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[float]:
        scores = [0.0] * len(rows)
        lengths = [len(c) + len(t) for c, t in rows]
        for batch in batches_by_length(lengths, self.batch_size):
            for i, s in zip(batch, self._forward([rows[i] for i in batch]), strict=True):
                scores[i] = s
        return scores

    @torch.inference_mode()
    def _forward(self, rows: list[tuple[list[int], list[int]]]) -> list[float]:
        # Left padding puts every row's targets at the end, so only the last `keep` positions
        # need logits (vocab-sized logits for whole prompts would dominate memory).
        seqs = [(c + t)[:-1] for c, t in rows]
        width, keep = max(len(s) for s in seqs), max(len(t) for _, t in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.full((len(rows), keep), self.pad, dtype=torch.long)
        tmask = torch.zeros((len(rows), keep), dtype=torch.bool)
        for j, (seq, (_, tgt)) in enumerate(zip(seqs, rows, strict=True)):
            ids[j, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[j, width - len(seq) :] = 1
            targets[j, keep - len(tgt) :] = torch.tensor(tgt, dtype=torch.long)
            tmask[j, keep - len(tgt) :] = True
        # Positions count real tokens only, so a padded row sees the positions it would alone.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        device = self.model.device
        kwargs = {"logits_to_keep": keep} if self.keep_arg else {}
        logits = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            **kwargs,
        ).logits[:, -keep:, :]
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets, tmask = targets.to(device), tmask.to(device)
        token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * tmask
        return (token_logp.sum(-1) / tmask.sum(-1)).cpu().tolist()
