"""Speedup at matched reward (the paper's Figure 4 metric), pure.

The smallest Best-of-N whose mean best reward reaches SBoN's, and T_BoN(that N) / T_SBoN:
how many Best-of-N machines it takes to do what one SBoN machine does in the same time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specrej_ray.search.metrics import speedup


@dataclass(frozen=True)
class BonPoint:
    n: int
    mean_reward: float
    seconds: float


@dataclass(frozen=True)
class Matched:
    sbon_reward: float
    sbon_seconds: float
    n: int | None  # the smallest matching Best-of-N; None when none matched
    bon_seconds: float | None
    speedup: float | None
    # With no match: T_BoN(largest N) / T_SBoN, a lower bound on the speedup at matched
    # reward when Best-of-N's time grows with N.
    lower_bound: float | None
    note: str


def matched_speedup(bon: Sequence[BonPoint], sbon_reward: float, sbon_seconds: float) -> Matched:
    points = sorted((p for p in bon if not math.isnan(p.mean_reward)), key=lambda p: p.n)
    if math.isnan(sbon_reward) or not points:
        why = "SBoN finished no candidate" if math.isnan(sbon_reward) else "no Best-of-N reward"
        return Matched(sbon_reward, sbon_seconds, None, None, None, None, f"{why}: no match")
    match = next((p for p in points if p.mean_reward >= sbon_reward), None)
    if match is None:
        top = points[-1]
        bound = speedup(top.seconds, sbon_seconds)
        note = (f"Best-of-N up to {top.n} did not reach SBoN's reward ({sbon_reward:.4g} > "
                f"{top.mean_reward:.4g}); T_BoN({top.n}) / T_SBoN = {bound:.2f} is a lower bound")
        return Matched(sbon_reward, sbon_seconds, None, None, None, bound, note)
    value = speedup(match.seconds, sbon_seconds)
    note = (f"Best-of-{match.n} is the smallest Best-of-N reaching SBoN's reward "
            f"({match.mean_reward:.4g} >= {sbon_reward:.4g}): T_BoN({match.n}) / T_SBoN = "
            f"{match.seconds:.2f} s / {sbon_seconds:.2f} s = {value:.2f}")
    return Matched(sbon_reward, sbon_seconds, match.n, match.seconds, value, None, note)
