"""What a running batch may still come to hold: KV reservations as profiles over future steps.

A reservation is a list of terms; each term is the KV token slots some rows hold during a run
of future steps (step 1 is the next step), growing by one generated token a step or holding.
A prompt's reservation is the peak it can still reach over all its remaining phases, placed in
time: rows that will have finished or been rejected stop counting when they do. The batch may
admit more rows only if the sum of every reservation stays within the budget at every future
step, and because each term is nondecreasing over its steps, it is enough to look at the
steps where terms end.

Memory is counted the way the engine's cache allocates it: a prompt's prefix once, and each
row's generated tokens rounded up to the cache's chunk (`chunk_up`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FOREVER = math.inf


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up (b > 0): the whole units of b that hold a."""
    return -(-a // b)


def chunk_up(tokens: int, chunk: int) -> int:
    """Slots that `tokens` generated tokens occupy in a cache that grows `chunk` at a time."""
    if tokens <= 0:
        return 0
    return ceil_div(tokens, chunk) * chunk


@dataclass(frozen=True)
class Term:
    """`rows` rows over steps first..last (inclusive): at step s they hold
    chunk_up(fed + s - first) generated tokens each (or `fed` throughout if not `grows`), at
    most `ceiling` in all, plus `const` slots (a prompt prefix)."""

    first: int
    last: float  # FOREVER: held until further notice
    rows: int = 0
    fed: int = 0
    grows: bool = True
    const: int = 0
    ceiling: float = FOREVER

    def __post_init__(self) -> None:
        if self.first < 1 or self.last < self.first - 1:
            raise ValueError(f"bad step range {self.first}..{self.last}")
        if self.grows and self.rows and self.last == FOREVER:
            raise ValueError("a growing term must end")

    def at(self, step: float, chunk: int) -> float:
        if not self.first <= step <= self.last:
            return 0
        fed = self.fed + (step - self.first if self.grows else 0)
        return min(self.ceiling, self.rows * chunk_up(int(fed), chunk)) + self.const


def peak(terms: Iterable[Term], chunk: int) -> float:
    """The most the terms hold together at any future step."""
    terms = [t for t in terms if t.last >= t.first]
    if not terms:
        return 0
    # Every term is largest at its last step; one held forever is constant from its first.
    steps = {t.first if t.last == FOREVER else t.last for t in terms}
    return max(sum(t.at(s, chunk) for t in terms) for s in steps)


def growth_terms(phases: Sequence[tuple[int, int]], length: int, start: int = 1) -> list[Term]:
    """Terms for rows at `length` generated tokens that run through `phases`, each (end, rows):
    `rows` live rows until the step that samples token `end`, starting at step `start`.

    The step that samples token g feeds token g - 1 into the cache, so during it a row holds
    g - 1 generated tokens (a row that has sampled nothing holds none).
    """
    terms, at, step = [], length, start
    for end, rows in phases:
        if end <= at:
            continue
        last = step + (end - at) - 1
        # During `step` the row samples token at + 1 and holds `at` tokens.
        terms.append(Term(step, last, rows=rows, fed=at))
        at, step = end, last + 1
    return terms
