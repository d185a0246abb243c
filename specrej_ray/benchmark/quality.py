"""What the arms' answers are worth and what they cost, per prompt (pure, no torch).

- `normalized_scores`: the paper's eq. 6 per prompt, an arm's best against the reference
  Best-of-N's range *on the same candidates* (candidate identity makes every arm's candidate
  k the same sample, so eq. 5's independent draws are not needed).
- `identity` (quality/identity.py): SBoN's finished candidates are Best-of-N's, its rejected
  ones their prefixes.
- `speedups`: the ratio of totals, and the paper's per-prompt mean, each with a bootstrap CI.
- `matched`: the Best-of-N that would reach SBoN's mean reward, interpolated in log N between
  the bracketing grid points, and the speedup at that reward, with a bootstrap CI over prompts.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from specrej_ray.engine.sequence import PromptResult
from specrej_ray.quality.stats import BOOTSTRAP, CONFIDENCE, Interval, bootstrap, interval
from specrej_ray.search.metrics import mean_or_nan, normalized_score


def best_reward(result: PromptResult, reward: str) -> float | None:
    """The chosen candidate's raw score under `reward`; None when no candidate finished."""
    if result.best is None:
        return None
    return result.candidates[result.best].components[reward]


def finished_rewards(result: PromptResult, reward: str) -> list[float]:
    return [c.components[reward] for c in result.candidates if c.finished]


def normalized_scores(arm: Sequence[PromptResult], ref: Sequence[PromptResult],
                      reward: str) -> dict[str, float]:
    """Eq. 6 per prompt: the arm's best against the range of the reference's finished
    candidates on the same prompt. A prompt where either finished nothing has no score."""
    ref_by_id = {r.prompt_id: r for r in ref}
    scores: dict[str, float] = {}
    for r in arm:
        b = ref_by_id.get(r.prompt_id)
        best = best_reward(r, reward)
        span = finished_rewards(b, reward) if b is not None else []
        if best is not None and span:
            scores[r.prompt_id] = normalized_score(span, best)
    return scores


def summary(values: Sequence[float]) -> dict:
    """Mean (with its bootstrap interval), median and min of a column of per-prompt values."""
    vals = list(values)
    if not vals:
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "median": math.nan,
                "min": math.nan}
    ci = bootstrap(vals)
    return {"mean": ci.value, "low": ci.low, "high": ci.high,
            "median": statistics.median(vals), "min": min(vals)}


def cost(result: PromptResult) -> float:
    """A prompt's seconds: its share of the batch's steps (by rows), its prefill, its
    rewards. Prompts overlap in a refilled batch, so wall-clock per prompt would double
    count; these add up to (about) the arm's wall-clock."""
    return result.engine_seconds + result.score_seconds


@dataclass(frozen=True)
class Speedups:
    totals: Interval  # sum of reference costs / sum of the arm's (CI: resampled prompts)
    per_prompt: Interval  # mean over prompts of reference cost / the arm's (the paper's)


def speedups(arm: Sequence[PromptResult], ref: Sequence[PromptResult]) -> Speedups:
    ref_by_id = {r.prompt_id: cost(r) for r in ref}
    pairs = [(ref_by_id[r.prompt_id], cost(r)) for r in arm
             if r.prompt_id in ref_by_id and cost(r) > 0]
    if not pairs:
        nan = Interval(math.nan, math.nan, math.nan)
        return Speedups(nan, nan)
    return Speedups(_ratio_of_sums(pairs), bootstrap([b / s for b, s in pairs]))


def token_rates(arm: Sequence[PromptResult], ref: Sequence[PromptResult]) -> Interval:
    """Tokens the arm decoded over the reference's (a ratio of totals), with a bootstrap CI
    over prompts."""
    ref_by_id = {r.prompt_id: r.tokens_decoded for r in ref}
    pairs = [(r.tokens_decoded, ref_by_id[r.prompt_id]) for r in arm if r.prompt_id in ref_by_id]
    return _ratio_of_sums(pairs)


def _ratio_of_sums(pairs: list[tuple[float, float]]) -> Interval:
    """sum(a) / sum(b) over (a, b) pairs, with a bootstrap CI over resampled pairs."""
    if not pairs or not sum(b for _, b in pairs):
        return Interval(math.nan, math.nan, math.nan)
    rng = random.Random(0)
    draws = []
    for _ in range(BOOTSTRAP):
        pick = [rng.choice(pairs) for _ in pairs]
        draws.append(sum(a for a, _ in pick) / max(sum(b for _, b in pick), 1e-12))
    return interval(sum(a for a, _ in pairs) / sum(b for _, b in pairs), sorted(draws))


# -- speedup at matched reward -------------------------------------------------------------


@dataclass(frozen=True)
class Matched:
    sbon_reward: float
    n: float | None  # the Best-of-N reaching SBoN's reward, interpolated in log N
    bracket: tuple[int, int] | None  # the grid points around it
    speedup: Interval | None  # T_BoN(n) / T_SBoN
    bound: str | None  # when SBoN's reward is outside Best-of-N's: what can be said
    note: str


def matched(bon: dict[int, Sequence[PromptResult]], sbon: Sequence[PromptResult],
            reward: str, label: str = "SBoN") -> Matched:
    """Best-of-N arms by N, and SBoN (or the arm `label` names): the N and the speedup at
    its mean reward."""
    ids = [r.prompt_id for r in sbon]
    table = _per_prompt_table(bon, sbon, reward, ids)
    if not table:
        return Matched(math.nan, None, None, None, None, "no prompt with rewards in every arm")
    point = _matched_point(table, sorted(bon), label)
    r_sbon = mean_or_nan(row["sbon"][0] for row in table)
    if point[0] is None:
        top = max(bon)
        why = point[2]
        if "above" in why:
            why += f" = {_means(table, top)[1] / _means(table, 'sbon')[1]:.2f}"
        return Matched(r_sbon, None, None, None, why, why)
    n, bracket, _ = point
    rng = random.Random(0)
    draws = []
    for _ in range(BOOTSTRAP):
        sample = [rng.choice(table) for _ in table]
        got = _matched_point(sample, sorted(bon), label)
        if got[0] is not None:
            draws.append(_speedup_at(sample, got[0], sorted(bon)))
    value = _speedup_at(table, n, sorted(bon))
    missed = BOOTSTRAP - len(draws)
    ci = interval(value, sorted(draws)) if draws else Interval(value, math.nan, math.nan)
    note = (f"{label}'s mean reward {r_sbon:.4g} lies between Best-of-{bracket[0]} and "
            f"Best-of-{bracket[1]}; interpolated in log N it matches Best-of-{n:.1f}, whose "
            f"time (interpolated the same way) over {label}'s is {value:.2f}x "
            f"({CONFIDENCE:.0%} CI {ci.low:.2f}-{ci.high:.2f} over prompts"
            + (f"; {missed} of {BOOTSTRAP} resamples fell outside the grid" if missed else "")
            + ")")
    return Matched(r_sbon, n, bracket, ci, None, note)


def _per_prompt_table(bon, sbon, reward, ids) -> list[dict[object, tuple[float, float]]]:
    """Per prompt: arm -> (best reward, cost); prompts missing a reward anywhere are left
    out (every arm is then averaged over the same prompts)."""
    arms = {"sbon": {r.prompt_id: r for r in sbon}}
    arms.update({n: {r.prompt_id: r for r in results} for n, results in bon.items()})
    table = []
    for pid in ids:
        row = {}
        for key, by_id in arms.items():
            r = by_id.get(pid)
            value = best_reward(r, reward) if r is not None else None
            if value is None:
                break
            row[key] = (value, cost(r))
        else:
            table.append(row)
    return table


def _means(table, key) -> tuple[float, float]:
    return (mean_or_nan(row[key][0] for row in table), sum(row[key][1] for row in table))


def _matched_point(table, ns: list[int], label: str
                   ) -> tuple[float | None, tuple[int, int] | None, str]:
    """(N interpolated in log N, its bracket, or None and why)."""
    target = _means(table, "sbon")[0]
    curve = [(n, _means(table, n)[0]) for n in ns]
    if target <= curve[0][1]:
        return None, None, (f"{label}'s mean reward {target:.4g} is at or below Best-of-"
                            f"{curve[0][0]}'s ({curve[0][1]:.4g}): no smaller N was run")
    for (n0, r0), (n1, r1) in zip(curve, curve[1:], strict=False):
        if r0 < target <= r1:
            frac = (target - r0) / (r1 - r0)
            return math.exp(math.log(n0) + frac * (math.log(n1) - math.log(n0))), (n0, n1), ""
    top = curve[-1]
    above = max(r for _, r in curve)
    return None, None, (f"{label}'s mean reward {target:.4g} is above every Best-of-N up to "
                        f"{top[0]} (best {above:.4g}): the speedup at matched reward is at "
                        f"least Best-of-{top[0]}'s time over {label}'s")


def _speedup_at(table, n: float, ns: list[int]) -> float:
    """Best-of-N's time at a fractional N, interpolated in log N and log time."""
    times = {k: _means(table, k)[1] for k in ns}
    low = max(k for k in ns if k <= n)
    high = min((k for k in ns if k >= n), default=low)
    if high == low:
        t = times[low]
    else:
        frac = (math.log(n) - math.log(low)) / (math.log(high) - math.log(low))
        t = math.exp(math.log(times[low]) + frac * (math.log(times[high]) - math.log(times[low])))
    return t / _means(table, "sbon")[1]
