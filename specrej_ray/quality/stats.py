"""Pure statistics on lists of floats: correlations, a least-squares line, bootstrap intervals.

Written out by hand (no scipy): the inputs are small (one prompt's candidates) and the
definitions, tie handling included, are then visible and tested.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BOOTSTRAP = 2000  # resamples
CONFIDENCE = 0.95


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r; None when it is undefined (fewer than 2 points or a constant input)."""
    _check_pairs(xs, ys)
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def kendall_tau_b(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Kendall's tau-b: (concordant - discordant) / sqrt((n0 - ties_x) * (n0 - ties_y)).

    n0 is the number of pairs; ties_x counts pairs tied in x (whether or not also tied in y),
    likewise ties_y. O(n^2), fine for one prompt's candidates. None when undefined.
    """
    _check_pairs(xs, ys)
    n = len(xs)
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            ties_x += dx == 0
            ties_y += dy == 0
            if dx * dy > 0:
                concordant += 1
            elif dx * dy < 0:
                discordant += 1
    pairs = n * (n - 1) // 2
    denominator = math.sqrt((pairs - ties_x) * (pairs - ties_y))
    return (concordant - discordant) / denominator if denominator else None


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """(slope, intercept) of the ordinary least-squares line y = slope * x + intercept."""
    _check_pairs(xs, ys)
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _check_pairs(xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"paired inputs differ in length: {len(xs)} vs {len(ys)}")


@dataclass(frozen=True)
class Interval:
    value: float
    low: float  # percentile interval over resamples (of prompts, usually)
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


def bootstrap(values: Sequence[float],
              statistic: Callable[[list[float]], float] | None = None,
              seed: int = 0) -> Interval:
    """The statistic (default: the mean) of the values and its percentile interval over
    resampled values."""
    vals = list(values)
    stat = statistic or (lambda xs: sum(xs) / len(xs))
    if not vals:
        return Interval(math.nan, math.nan, math.nan)
    draws = [stat([vals[i] for i in picks]) for picks in resamples(len(vals), seed)]
    return interval(stat(vals), draws)


def resamples(n: int, seed: int = 0, count: int = BOOTSTRAP) -> list[list[int]]:
    """`count` bootstrap draws of n indices out of range(n), with replacement. Several
    statistics computed on the same draws are paired: each draw resamples the items (e.g.
    prompts) once for all of them."""
    rng = random.Random(seed)
    return [[rng.randrange(n) for _ in range(n)] for _ in range(count)]


def interval(value: float, draws: Sequence[float]) -> Interval:
    """`value` with the central CONFIDENCE percentile interval of its bootstrap `draws`."""
    if not draws:
        return Interval(value, math.nan, math.nan)
    s = sorted(draws)
    tail = (1 - CONFIDENCE) / 2
    return Interval(value, s[int(tail * (len(s) - 1))], s[int((1 - tail) * (len(s) - 1))])
