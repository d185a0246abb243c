"""The speculative-rejection decision: which in-play candidates survive a decision point."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")


def keep_count(in_play: int, alpha: float) -> int:
    """How many of `in_play` candidates survive: round-half-up of (1 - alpha) * in_play, >= 1.

    The official code keeps the top round((1 - alpha) * count). We round half up rather than
    Python's half-to-even so 5 candidates at alpha 0.5 keep 3 like 3 at alpha 0.5 keep 2.
    """
    _check_alpha(alpha)
    if in_play < 0:
        raise ValueError(f"in_play must be >= 0, got {in_play}")
    if in_play == 0:
        return 0
    # alpha as the user wrote it (0.9 is 9/10, not 0.9000000000000000222): binary float
    # error would otherwise turn exact halves like (1 - 0.9) * 15 = 1.5 into 1.4999...
    exact = (1 - Fraction(str(alpha))) * in_play
    return max(1, math.floor(exact + Fraction(1, 2)))


@dataclass(frozen=True)
class Decision:
    """Outcome of one decision point; indices refer to the lists given to `decide`."""

    kept: tuple[int, ...]
    rejected: tuple[int, ...]
    cutoff: float


def _rank_key(scores: Sequence[float], i: int) -> tuple[bool, float, int]:
    # Score descending, lower index first on ties; a NaN score ranks below every number
    # (a broken reward must not win, and sorting must stay deterministic).
    s = scores[i]
    nan = math.isnan(s)
    return (nan, 0.0 if nan else -s, i)


def decide(scores: Sequence[float], finished: Sequence[bool], alpha: float) -> Decision:
    """Rank all in-play candidates together and reject the live ones outside the top.

    Finished candidates are never rejected: their score is already final, so stopping them
    saves nothing and they stay eligible for the final argmax.
    """
    _check_alpha(alpha)
    if len(scores) != len(finished):
        raise ValueError(f"{len(scores)} scores but {len(finished)} finished flags")
    if not scores:
        raise ValueError("decide needs at least one candidate in play")
    ranked = sorted(range(len(scores)), key=lambda i: _rank_key(scores, i))
    top = ranked[: keep_count(len(scores), alpha)]
    rejected = tuple(sorted(i for i in ranked[len(top) :] if not finished[i]))
    rejected_set = set(rejected)
    kept = tuple(i for i in range(len(scores)) if i not in rejected_set)
    return Decision(kept=kept, rejected=rejected, cutoff=float(scores[top[-1]]))


def best_index(scores: Sequence[float], eligible: Sequence[bool]) -> int | None:
    """Index of the highest eligible score (lower index on ties); None if none is eligible."""
    if len(scores) != len(eligible):
        raise ValueError(f"{len(scores)} scores but {len(eligible)} eligibility flags")
    candidates = [i for i, ok in enumerate(eligible) if ok]
    if not candidates:
        return None
    return min(candidates, key=lambda i: _rank_key(scores, i))
