"""Choosing a setting from calibration prompts: the cheapest alpha x schedule whose normalized
score, bootstrapped over candidate subsets and prompts, stays at or above a target (pure).

The paper's counterfactual analysis (section 6.2) draws N-candidate subsets from a larger pool
of each prompt's completions and replays SBoN on each draw. Here the pool is the N candidates a
calibration prompt ran with Best-of-N: each bootstrap draw resamples the prompts and, within
each, its candidates (with replacement), and replays every setting on the same draws (paired).
For `schedule: auto`, which decides unattended, a setting qualifies when the lower end of its
interval (the 2.5th percentile of the mean score over draws) reaches the target (`choose`);
`tune`, which advises, recommends by the mean over the draws (`recommend`). Either way the
lowest token rate among those that qualify wins. Multi-round schedules (16/32/64/128) compete
with single decisions.

Why draws and not the score on the prompts as they are: each setting is replayed on the very
candidates it is judged by, so among many settings the cheapest that keeps every prompt's best
is often one that kept it by luck, a single top candidate surviving a cut it would usually
lose. Resampling the candidates shows how often it would (BENCHMARKS.md: the row of `tune`'s
recommendation by the resampled score, where the earlier choice lost score once resampled).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations

from specrej_ray.quality.stats import CONFIDENCE, interval
from specrej_ray.search.counterfactual import PromptCandidates, evaluate
from specrej_ray.search.metrics import mean_or_nan

ALPHAS = (0.5, 0.7, 0.8, 0.9)
RESAMPLES = 200  # bootstrap draws of prompts and candidates, seeded
# Decision lengths scored; those at or beyond max_new_tokens are dropped (nothing is live).
GRID = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Setting:
    alpha: float
    schedule: tuple[int, ...]


@dataclass(frozen=True)
class Assessed:
    setting: Setting
    token_rate: float  # on the calibration prompts as they are
    mean_score: float  # eq. 6, mean over prompts, on the prompts as they are
    low: float  # bootstrap interval of the mean score
    high: float
    resampled: float  # the mean score's mean over the draws: expected on fresh candidates


@dataclass(frozen=True)
class Choice:
    chosen: Assessed | None  # None: no setting reaches the target
    assessed: list[Assessed]  # every setting, in the order given
    target: float
    reason: str


def default_settings(grid: Sequence[int], alphas: Sequence[float]) -> list[Setting]:
    """Every alpha with every single decision, every pair and every doubling ladder
    (t, 2t, 4t, ...) of three or more lengths the grid holds."""
    grid = sorted(set(grid))
    schedules = [(t,) for t in grid] + list(combinations(grid, 2))
    for t in grid:
        ladder = [t]
        while ladder[-1] * 2 in grid:
            ladder.append(ladder[-1] * 2)
        if len(ladder) >= 3:
            schedules.append(tuple(ladder))
    return [Setting(a, s) for a in alphas for s in dict.fromkeys(schedules)]


def subsample(p: PromptCandidates, picks: Sequence[int]) -> PromptCandidates:
    """The prompt's candidates at these indices (repeats allowed), renumbered."""
    return PromptCandidates(tuple(p.lengths[k] for k in picks), tuple(p.final[k] for k in picks),
                            {t: [s[k] for k in picks] for t, s in p.partial.items()})


def draws(prompts: Sequence[PromptCandidates], count: int,
          seed: int = 0) -> list[list[PromptCandidates]]:
    """`count` bootstrap draws: prompts resampled, each prompt's candidates resampled."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        picked = [prompts[rng.randrange(len(prompts))] for _ in prompts]
        out.append([subsample(p, [rng.randrange(len(p.lengths)) for _ in p.lengths])
                    for p in picked])
    return out


def assess(prompts: Sequence[PromptCandidates], setting: Setting,
           samples: Sequence[Sequence[PromptCandidates]]) -> Assessed:
    base = evaluate(prompts, setting.alpha, setting.schedule)
    means = [evaluate(d, setting.alpha, setting.schedule).mean_score for d in samples]
    ci = interval(base.mean_score, means)
    return Assessed(setting, base.token_rate, base.mean_score, ci.low, ci.high,
                    mean_or_nan(means))


def assess_all(prompts: Sequence[PromptCandidates], settings: Sequence[Setting],
               resamples: int = RESAMPLES, seed: int = 0) -> list[Assessed]:
    """Every setting replayed on the same draws (paired)."""
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if not settings:
        raise ValueError("calibration needs at least one setting")
    samples = draws(prompts, resamples, seed)
    return [assess(prompts, s, samples) for s in settings]


def cheapest(assessed: Sequence[Assessed], figure: Callable[[Assessed], float],
             target: float) -> Assessed | None:
    """The lowest token rate whose `figure` reaches `target` (the higher figure, then the
    first, on ties); None when none does (a NaN figure never does)."""
    return min((a for a in assessed if figure(a) >= target),
               key=lambda a: (a.token_rate, -figure(a)), default=None)


def recommend(assessed: Sequence[Assessed], target: float) -> Assessed | None:
    """`tune`'s recommendation: the cheapest setting whose resampled score reaches `target`."""
    return cheapest(assessed, lambda a: a.resampled, target)


def choose(prompts: Sequence[PromptCandidates], settings: Sequence[Setting], target: float,
           resamples: int = RESAMPLES, seed: int = 0) -> Choice:
    """`schedule: auto`'s choice (decide on assess_all's settings)."""
    return decide(assess_all(prompts, settings, resamples, seed), target)


def decide(assessed: list[Assessed], target: float) -> Choice:
    """The lowest token rate whose interval's lower end reaches `target` (a higher lower end
    first on ties); None, with the best lower end found, when none does."""
    best = cheapest(assessed, lambda a: a.low, target)
    if best is not None:
        return Choice(best, assessed, target,
                      f"alpha {best.setting.alpha:g} at {list(best.setting.schedule)}: token "
                      f"rate {best.token_rate:.3f}, normalized score {best.mean_score:.1f} "
                      f"({CONFIDENCE:.0%} CI {best.low:.1f}-{best.high:.1f}) >= {target:g}")
    top = max(assessed, key=lambda a: (a.low, -a.token_rate))
    return Choice(None, assessed, target,
                  f"no setting's {CONFIDENCE:.0%} lower bound reaches {target:g}; the highest "
                  f"is {top.low:.1f} (alpha {top.setting.alpha:g} at "
                  f"{list(top.setting.schedule)}, token rate {top.token_rate:.3f})")
