"""When to hold a decision point, and how many candidates to start together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Schedule(Protocol):
    def should_decide(
        self, generated: int, live_rows: int, tokens_per_row: int, budget_tokens: int
    ) -> bool: ...


class TokensSchedule:
    """Workshop Algorithm 1: decide at fixed generated lengths t1 < t2 < ..."""

    def __init__(self, decision_tokens: Sequence[int]) -> None:
        tokens = tuple(decision_tokens)
        if not tokens:
            raise ValueError("a tokens schedule needs at least one decision length")
        if tokens[0] < 1 or any(b <= a for a, b in zip(tokens, tokens[1:], strict=False)):
            raise ValueError(f"decision lengths must be positive and increasing, got {tokens}")
        self.decision_tokens = tokens
        self._lookup = frozenset(tokens)

    def should_decide(
        self, generated: int, live_rows: int, tokens_per_row: int, budget_tokens: int
    ) -> bool:
        return generated in self._lookup

    def __repr__(self) -> str:
        return f"TokensSchedule({list(self.decision_tokens)})"


class MemorySchedule:
    """NeurIPS version: decide when one more decode step would overflow the KV budget.

    tokens_per_row is each live row's KV length (prompt + generated tokens), so the next
    step needs live_rows * (tokens_per_row + 1) token slots.
    """

    def __init__(self, min_decision_tokens: int) -> None:
        if min_decision_tokens < 1:
            raise ValueError(f"min_decision_tokens must be >= 1, got {min_decision_tokens}")
        self.min_decision_tokens = min_decision_tokens

    def should_decide(
        self, generated: int, live_rows: int, tokens_per_row: int, budget_tokens: int
    ) -> bool:
        if generated < self.min_decision_tokens:
            return False
        return live_rows * (tokens_per_row + 1) > budget_tokens

    def __repr__(self) -> str:
        return f"MemorySchedule(min_decision_tokens={self.min_decision_tokens})"


def make_schedule(
    decision_tokens: Sequence[int] | None, min_decision_tokens: int
) -> TokensSchedule | MemorySchedule:
    """A tokens schedule when decision lengths are given, else the memory schedule."""
    if decision_tokens is not None:
        return TokensSchedule(decision_tokens)
    return MemorySchedule(min_decision_tokens)


def wave_size(remaining: int, budget_tokens: int, prompt_tokens: int, horizon: int) -> int:
    """Candidates to start together so each can reach `horizon` generated tokens in budget.

    Never 0 while candidates remain: a single row that does not fit must still be tried
    (an out-of-memory error is handled by the caller, a zero-size wave would loop forever).
    """
    if remaining < 0 or budget_tokens < 0 or prompt_tokens < 0 or horizon < 0:
        raise ValueError("wave_size arguments must be >= 0")
    if remaining == 0:
        return 0
    per_row = prompt_tokens + horizon
    if per_row == 0:
        return remaining
    return max(1, min(remaining, budget_tokens // per_row))


def first_horizon(
    decision_tokens: Sequence[int] | None,
    min_decision_tokens: int,
    max_new_tokens: int,
    alpha: float,
) -> int:
    """Generated length a wave must fit up to before its first chance to shed rows.

    This is how n0 is memory-sized: as many rows as the KV budget holds until then.
    """
    if alpha == 0:
        # Nothing is ever rejected, so every row must fit to the end.
        return max_new_tokens
    if decision_tokens:
        return min(decision_tokens[0], max_new_tokens)
    return min(min_decision_tokens, max_new_tokens)
