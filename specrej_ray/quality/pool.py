"""What Best-of-k would give, for every k, from one pool of m candidates of a prompt (pure).

The pool's candidates are i.i.d. draws of the prompt's generator, so any statistic of k draws
has an unbiased estimate: its average over every k-subset of the pool (a U-statistic). For
the best reward, the average over subsets of their maximum is an order statistic: with the
pool sorted ascending, r_(i) is the maximum of C(i-1, k-1) of the C(m, k) subsets. The same
reasoning gives the chance that some of k candidates reaches the ceiling, and the expected
tokens of sampling until one does (drawing the pool without replacement, one at a time).
Weights are taken in log space, so pools of thousands stay exact to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def best_of_k(rewards: Sequence[float]) -> list[float]:
    """E[best of k] for k = 1..m, estimated without bias from the pool."""
    r, m = sorted(rewards), len(rewards)
    out = []
    for k in range(1, m + 1):
        total = _log_comb(m, k)
        out.append(math.fsum(r[i - 1] * math.exp(_log_comb(i - 1, k - 1) - total)
                             for i in range(k, m + 1)))
    return out


def yield_of_k(at_ceiling: Sequence[bool]) -> list[float]:
    """P(at least one of k candidates is at the ceiling) for k = 1..m: 1 - C(m-c, k)/C(m, k)."""
    m, c = len(at_ceiling), sum(bool(x) for x in at_ceiling)
    return [1.0 if k > m - c else 1.0 - math.exp(_log_comb(m - c, k) - _log_comb(m, k))
            for k in range(1, m + 1)]


def tokens_of_k(tokens: Sequence[int]) -> list[float]:
    """Expected decoded tokens of Best-of-k, k = 1..m: k times the mean."""
    mean = math.fsum(tokens) / len(tokens)
    return [k * mean for k in range(1, len(tokens) + 1)]


def tokens_until_ceiling(tokens: Sequence[int], at_ceiling: Sequence[bool], cap: int) -> float:
    """Expected tokens of drawing candidates one at a time until one reaches the ceiling, at
    most `cap` of them (open-instruct's rejection sampling): the draw j happens when the j-1
    before it all missed, and is then any of the m - j + 1 the pool has left."""
    m = len(tokens)
    if not 1 <= cap <= m:
        raise ValueError(f"cap {cap} must be between 1 and the pool's {m} candidates")
    misses = [t for t, hit in zip(tokens, at_ceiling, strict=True) if not hit]
    total, miss_mean = math.fsum(tokens), (math.fsum(misses) / len(misses) if misses else 0.0)
    expected = 0.0
    for j in range(1, cap + 1):
        if j - 1 > len(misses):
            break
        p_all_missed = math.exp(_log_comb(len(misses), j - 1) - _log_comb(m, j - 1))
        expected += p_all_missed * (total - (j - 1) * miss_mean) / (m - j + 1)
    return expected


def matched_k(curve: Sequence[float], target: float) -> float | None:
    """The k (real-valued) at which a nondecreasing curve over k = 1..len reaches `target`,
    interpolated linearly in log k; None beyond its end, 1.0 at or below its start."""
    if target <= curve[0]:
        return 1.0
    for k in range(1, len(curve)):
        lo, hi = curve[k - 1], curve[k]
        if lo < target <= hi:
            frac = (target - lo) / (hi - lo)
            return math.exp(math.log(k) + frac * (math.log(k + 1) - math.log(k)))
    return None
