"""Per-prompt budgets (search.draws): a prompt draws its candidates in waves until what it has
finished is what the job's outputs keep, up to a cap.

A draw is `wave` candidates (the first is the prompt's N), run as speculative rejection of their
own: the rule's decisions rank the draw's candidates. The candidates' streams are keyed by their
index as always, so draw k's candidates are the same whatever shares the batch.

Where a prompt stops must not depend on the batch either (what shares it, memory waves, how late
the scores come). So it is defined on lengths: the prompt stops at L*, the shortest generated
length at which the candidates finished by then (earlier draws' included) meet the need (`met`,
monotone: more finished candidates never unmeet it). The engine finds it thus: once the scored
finished candidates meet the need, `stop_at` is the longest of them; every live candidate of the
draw decodes to `stop_at` (later memory waves catch up) and waits; then L* is found among the
finish lengths, and everything the draw did past L* is undone: candidates longer than L*, and
those a decision at L* or later rejected, are cut back to L* and marked stopped; a decision at
or past L* no longer counts. Tokens cut are counted as discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specrej_ray.engine.sequence import Candidate
from specrej_ray.engine.task import Answer, DrawPlan

# Why a prompt stopped drawing (PromptResult.stop_reason, with search.draws on).
KEPT = "kept"  # its finished candidates are what the job's outputs keep
CAP = "cap"  # it drew search.draws.max_n candidates without that
RULE = "rule"  # the stopping rule said another draw is not worth it (no ceiling)


@dataclass
class DrawState:
    """One prompt's draws: where the current one starts, the decisions it took, its stop."""

    plan: DrawPlan
    start: int = 0  # index of the current draw's first candidate
    count: int = 1  # draws so far
    decisions: list[int] = field(default_factory=list)  # lengths of the current draw's decisions
    stop_at: int | None = None  # decode no further: the need is met by then
    reason: str | None = None  # why it stopped (KEPT, CAP), once it has
    scoring: tuple[list[Candidate], Answer] | None = None  # finished candidates' scores, out


def shortest_stop(earlier: Sequence[Candidate], draw: Sequence[Candidate], upto: int,
                  met: Callable[[Sequence[Candidate]], bool]) -> int:
    """L*: the shortest finish length (at most `upto`) at which the earlier draws' finished
    candidates and this draw's finished by then meet the need; `upto` if none does sooner."""
    done = sorted({len(c.tokens) for c in draw if c.finished and len(c.tokens) <= upto})
    for length in done:
        if met([*earlier, *(c for c in draw if c.finished and len(c.tokens) <= length)]):
            return length
    return upto


def undo_past(draw: Sequence[Candidate], length: int, text_of) -> int:
    """Cut the draw back to what it was at `length` generated tokens: candidates longer than
    it, live ones, and those rejected at `length` or later stop there (scores taken past it
    dropped). Returns the tokens cut."""
    cut = 0
    for c in draw:
        rejected_late = c.rejected and len(c.tokens) >= length
        if not (c.live or rejected_late or len(c.tokens) > length):
            continue
        cut += max(0, len(c.tokens) - length)
        c.stop(length, text_of)
    return cut
