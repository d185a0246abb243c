"""When a prompt's candidates decide, how much memory a prompt may take, and what it reserves.

Three schedules share one interface, so the engine holds no `if alpha == 0` branches:

- `BestOfN`: never decides; every candidate runs to its end on its own.
- `TokensSchedule`: decides at fixed generated lengths t1 < t2 < ... (workshop Algorithm 1).
- `MemorySchedule`: decides at `min_decision_tokens`, then whenever the live candidates would
  outgrow the prompt's KV share (the NeurIPS version: reject when memory is about to run out).

At a decision length all of a prompt's live candidates meet, so one cut-off ranks every
candidate in play, however many waves memory split them into (Algorithm 1). Lengths count
generated tokens; memory counts KV token slots through a `Layout` (see search.reservation).
With overlapped scoring, live candidates may decode `cap` tokens past an open decision, so
reservations and the memory trigger include those tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specrej_ray.search.rejection import keep_count
from specrej_ray.search.reservation import Term, chunk_up, growth_terms


@dataclass(frozen=True)
class Layout:
    """How a prompt's KV cache is laid out: its prefix once, rows rounded up to `chunk`."""

    prompt_tokens: int
    chunk: int

    def rows(self, rows: int, fed: int) -> int:
        """Slots `rows` rows hold with `fed` generated tokens each (prefix not included)."""
        return rows * chunk_up(fed, self.chunk)

    def prompt(self, rows: int, fed: int) -> int:
        return self.prompt_tokens + self.rows(rows, fed)

    def fit(self, budget: int, fed: int) -> int:
        """How many rows of `fed` generated tokens a budget holds beside the prefix."""
        per_row = chunk_up(fed, self.chunk)
        room = budget - self.prompt_tokens
        if room < 0:
            return 0
        return room // per_row if per_row else 1 << 30


@dataclass(frozen=True)
class Cohort:
    """A prompt's live candidates, all at one generated length, with nothing pending."""

    live: int
    in_play: int  # live + finished candidates still ranked at decisions
    length: int
    max_new: int
    alpha: float
    cap: int  # tokens live rows may decode past an open decision
    kv_share: int  # the prompt's KV budget (MemorySchedule decides by it)
    decided_at: int = 0  # length of the prompt's last decision (0: none yet)


class Schedule:
    """The interface; see the module docstring."""

    decides = True

    def meeting(self, length: int, max_new: int) -> int:
        """The next generated length > `length` at which all live candidates must meet for a
        decision (max_new when none is due)."""
        raise NotImplementedError

    def decide_now(self, c: Cohort, layout: Layout) -> bool:
        """Whether the cohort, all standing at `c.length`, decides before decoding on."""
        raise NotImplementedError

    def kv_share(self, device: int, n: int, layout: Layout, cap: int, max_new: int) -> int:
        """The prompt's KV budget: the device's, unless the schedule keeps it smaller."""
        return device

    def lockstep(self, decided_at: int) -> bool:
        """Whether live candidates must move one token at a time together (a decision may
        fall at any length): else they only meet at the decision lengths."""
        return False

    def max_live(self, c: Cohort, layout: Layout) -> int | None:
        """The most live candidates a decision at `c.length` may keep (None: any)."""
        return None

    def first_horizon(self, max_new: int) -> int:
        """Where all N candidates first meet: what n0 is sized to reach."""
        return self.meeting(0, max_new)

    def auto_n(self, device: int, layout: Layout, cap: int, max_new: int) -> int:
        """`search.n: auto`: as many candidates as the device budget holds to the first
        meeting, with the overlap allowance (at least 1)."""
        horizon = min(self.first_horizon(max_new) + (cap if self.decides else 0), max_new)
        return max(1, layout.fit(device, horizon - 1))

    def phases(self, c: Cohort) -> list[tuple[int, int]]:
        """(end length, live rows) for the cohort's remaining phases: an upper bound on its
        rows until each decision cuts them (cap tokens after it opens) and to the end."""
        phases, live, in_play = [], c.live, c.in_play
        at = max(c.length, c.decided_at)  # a decision already taken is not taken again
        while True:
            meet = self.meeting(at, c.max_new)
            if meet >= c.max_new:
                return phases + [(c.max_new, live)]
            phases.append((min(meet + c.cap, self.meeting(meet, c.max_new), c.max_new), live))
            in_play = keep_count(in_play, c.alpha)
            live, at = min(live, in_play), meet

    def reserve(self, c: Cohort, layout: Layout, start: int = 1) -> list[Term]:
        """Generated-token slots the cohort may hold from step `start` on (prefix apart)."""
        return growth_terms(self.phases(c), c.length, start)


class BestOfN(Schedule):
    """Alpha 0: nothing is ranked before the end; candidates run on their own."""

    decides = False

    def meeting(self, length: int, max_new: int) -> int:
        return max_new

    def decide_now(self, c: Cohort, layout: Layout) -> bool:
        return False

    def __repr__(self) -> str:
        return "BestOfN()"


class TokensSchedule(Schedule):
    """Workshop Algorithm 1: decide at fixed generated lengths t1 < t2 < ..."""

    def __init__(self, decision_tokens: Sequence[int]) -> None:
        tokens = tuple(decision_tokens)
        if not tokens:
            raise ValueError("a tokens schedule needs at least one decision length")
        if tokens[0] < 1 or any(b <= a for a, b in zip(tokens, tokens[1:], strict=False)):
            raise ValueError(f"decision lengths must be positive and increasing, got {tokens}")
        self.decision_tokens = tokens

    def meeting(self, length: int, max_new: int) -> int:
        return next((t for t in self.decision_tokens if length < t < max_new), max_new)

    def decide_now(self, c: Cohort, layout: Layout) -> bool:
        return c.length in self.decision_tokens and c.length > c.decided_at

    def __repr__(self) -> str:
        return f"TokensSchedule({list(self.decision_tokens)})"


class MemorySchedule(Schedule):
    """NeurIPS version: the first decision at `min_decision_tokens`, then one whenever the
    live rows would outgrow the prompt's share before the next chance to decide."""

    def __init__(self, min_decision_tokens: int) -> None:
        if min_decision_tokens < 1:
            raise ValueError(f"min_decision_tokens must be >= 1, got {min_decision_tokens}")
        self.min_decision_tokens = min_decision_tokens

    def meeting(self, length: int, max_new: int) -> int:
        return self.min_decision_tokens if length < self.min_decision_tokens < max_new \
            else max_new

    def decide_now(self, c: Cohort, layout: Layout) -> bool:
        if c.decided_at < self.min_decision_tokens:
            return c.length == self.min_decision_tokens
        # Deciding one step later would let the rows reach `length + cap` slots before the cut.
        return c.live > 1 and layout.prompt(c.live, c.length + c.cap) > c.kv_share

    def lockstep(self, decided_at: int) -> bool:
        return decided_at >= self.min_decision_tokens

    def max_live(self, c: Cohort, layout: Layout) -> int | None:
        """Memory is the hard limit: if alpha's cut (finished candidates take places in it)
        leaves more live rows than the share holds, the lowest ranked go too."""
        return max(1, layout.fit(c.kv_share, c.length + c.cap))

    def kv_share(self, device: int, n: int, layout: Layout, cap: int, max_new: int) -> int:
        """Fixed N: what N rows hold at the first decision, so later decisions fall where
        the survivors have grown back into it (a large device holds several prompts); at
        least what one candidate needs to reach its end, at most the device budget."""
        need = layout.prompt(n, self.min_decision_tokens - 1 + cap)
        return min(device, max(need, layout.prompt(1, max_new - 1)))

    def reserve(self, c: Cohort, layout: Layout, start: int = 1) -> list[Term]:
        """Up to the first decision as the other schedules; after it the rows stay within
        the share (or what they need to finish, if less) until the longest can end."""
        terms, live, length = [], c.live, c.length
        if length < self.min_decision_tokens:
            end = min(self.min_decision_tokens + c.cap, c.max_new)
            terms = growth_terms([(end, live)], length, start)
            start += end - length
            live, length = min(live, keep_count(c.in_play, c.alpha)), end
        if length < c.max_new and live:
            terms.append(Term(start, start + c.max_new - length - 1, rows=live, fed=length,
                              ceiling=max(0, c.kv_share - layout.prompt_tokens)))
        return terms

    def __repr__(self) -> str:
        return f"MemorySchedule(min_decision_tokens={self.min_decision_tokens})"


def make_schedule(alpha: float, decision_tokens: Sequence[int] | None,
                  min_decision_tokens: int) -> Schedule:
    """Best-of-N when alpha is 0; else a tokens schedule if lengths are given, else memory."""
    if alpha == 0:
        return BestOfN()
    if decision_tokens is not None:
        return TokensSchedule(decision_tokens)
    return MemorySchedule(min_decision_tokens)


__all__ = ["BestOfN", "Cohort", "Layout", "MemorySchedule", "Schedule",
           "TokensSchedule", "make_schedule"]
