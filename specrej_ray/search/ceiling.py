"""Whether a response is at its reward's ceiling (pure): the highest score the reward gives.

A reward's ceiling is declared, not estimated (reward.ceiling; instructions: 1.0), and a
score reaches it by comparison as computed (`>=`), with no tolerance: an instructions share
is a ratio of small integers, exactly 1.0 when every instruction is followed and never within
rounding of it otherwise (2/3 is not 1.0). An ensemble is at its ceiling when every component
is at its own; a component without a ceiling never is.
"""

from __future__ import annotations

from collections.abc import Sequence


def at_ceiling(scores: Sequence[float], ceilings: Sequence[float | None]) -> bool:
    if len(scores) != len(ceilings):
        raise ValueError(f"{len(scores)} scores for {len(ceilings)} rewards")
    return all(c is not None and s >= c for s, c in zip(scores, ceilings, strict=True))
