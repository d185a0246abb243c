"""Calibration (search.calibration): the cheapest setting whose bootstrapped lower bound meets
a target, on synthetic candidate scores; and a refusal when none does."""

from __future__ import annotations

import math
import random

import pytest

from specrej_ray.quality.calibration import (
    Assessed,
    Setting,
    assess,
    assess_all,
    choose,
    default_settings,
    draws,
    recommend,
    subsample,
)
from specrej_ray.search.counterfactual import PromptCandidates, evaluate


def prompt(rng: random.Random, n: int, noise: float) -> PromptCandidates:
    """n candidates of 40-120 tokens; partial scores at 8/16/32 are the final one plus noise
    (0: partial rewards rank exactly as final ones do)."""
    finals = [rng.gauss(0, 1) for _ in range(n)]
    partial = {t: [f + rng.gauss(0, noise) for f in finals] for t in (8, 16, 32)}
    return PromptCandidates(tuple(rng.randint(40, 120) for _ in range(n)), tuple(finals),
                            partial)


def prompts(noise: float, count: int = 6, n: int = 32, seed: int = 0):
    rng = random.Random(seed)
    return [prompt(rng, n, noise) for _ in range(count)]


SETTINGS = [Setting(a, s) for a in (0.5, 0.9) for s in ((8,), (32,), (8, 16))]


def test_a_perfect_reward_picks_the_cheapest_setting():
    choice = choose(prompts(noise=0.0), SETTINGS, target=99, resamples=50)
    assert choice.chosen is not None
    # Exact partial rewards never lose the best: every setting scores 100, the earliest,
    # harshest one spends least (two rounds from 8 tokens: 32 -> 3 -> 1 candidates).
    assert all(a.low == 100 for a in choice.assessed)
    assert choice.chosen.setting == Setting(0.9, (8, 16))
    assert choice.chosen.token_rate == min(a.token_rate for a in choice.assessed)
    assert "token rate" in choice.reason


def test_a_noisy_reward_is_refused_with_the_best_bound_found():
    choice = choose(prompts(noise=5.0), SETTINGS, target=99, resamples=50)
    assert choice.chosen is None
    assert "no setting" in choice.reason and "lower bound" in choice.reason
    best_low = max(a.low for a in choice.assessed)
    assert f"{best_low:.1f}" in choice.reason


def test_a_lower_target_admits_more_and_the_choice_is_the_cheapest_admitted():
    ps = prompts(noise=0.7)
    strict = choose(ps, SETTINGS, target=95, resamples=100)
    lenient = choose(ps, SETTINGS, target=50, resamples=100)
    assert lenient.chosen is not None
    admitted = [a for a in lenient.assessed if a.low >= 50]
    assert lenient.chosen.token_rate == min(a.token_rate for a in admitted)
    if strict.chosen is not None:
        assert strict.chosen.token_rate >= lenient.chosen.token_rate


def test_the_interval_brackets_the_mean_and_is_reproducible():
    ps = prompts(noise=1.0)
    samples = draws(ps, 80, seed=3)
    a = assess(ps, Setting(0.7, (16,)), samples)
    assert a.low <= a.mean_score <= a.high
    assert assess(ps, Setting(0.7, (16,)), draws(ps, 80, seed=3)) == a


def test_subsample_keeps_each_candidates_scores_together():
    p = PromptCandidates((5, 6, 7), (0.1, 0.2, 0.3), {4: [1.0, 2.0, 3.0]})
    q = subsample(p, [2, 2, 0])
    assert q.lengths == (7, 7, 5) and q.final == (0.3, 0.3, 0.1)
    assert q.partial[4] == [3.0, 3.0, 1.0]


def test_default_settings_include_doubling_ladders():
    got = default_settings([16, 32, 64, 128, 20], [0.5])
    schedules = {s.schedule for s in got}
    assert (16,) in schedules and (16, 128) in schedules
    assert (16, 32, 64, 128) in schedules and (32, 64, 128) in schedules
    assert all(s.alpha == 0.5 for s in got)


def test_choose_needs_prompts_and_settings():
    with pytest.raises(ValueError):
        choose([], SETTINGS, 99)
    with pytest.raises(ValueError):
        choose(prompts(0.0), [], 99)


def lucky() -> PromptCandidates:
    """Ten 100-token candidates; only candidate 0 scores 1 in the end, and its score at 8
    tokens ranks third: a cut that keeps three keeps it on these candidates, by a margin of
    none, and loses it whenever a fresh draw holds three that look better at 8 tokens."""
    partial = [0.5, 0.9, 0.8, 0.4, 0.3, 0.2, 0.1, 0.0, -0.1, -0.2]
    return PromptCandidates((100,) * 10, (1.0,) + (0.0,) * 9, {8: partial})


def test_a_setting_that_kept_the_best_by_luck_is_not_recommended():
    ps = [lucky()] * 4
    harsh, mild = Setting(0.7, (8,)), Setting(0.5, (8,))
    assessed = assess_all(ps, [harsh, mild], resamples=200)
    # On the candidates as they are both keep the best; the harsh cut spends less.
    assert [a.mean_score for a in assessed] == [100.0, 100.0]
    assert assessed[0].token_rate < assessed[1].token_rate
    # Resampled, the harsh cut often loses it and the mild one seldom does.
    assert assessed[0].resampled < 90 < assessed[1].resampled
    chosen = recommend(assessed, 90)
    assert chosen is not None and chosen.setting == mild
    assert recommend(assessed, 100.5) is None


def test_resampled_is_the_mean_over_the_draws_and_exact_when_nothing_can_be_lost():
    ps = prompts(noise=1.0)
    samples = draws(ps, 30, seed=1)
    a = assess(ps, Setting(0.7, (16,)), samples)
    means = [evaluate(d, 0.7, (16,)).mean_score for d in samples]
    assert a.resampled == pytest.approx(sum(means) / len(means))
    assert min(means) <= a.resampled <= max(means) and a.low <= a.high
    exact = assess(prompts(noise=0.0), Setting(0.9, (8, 16)), draws(prompts(noise=0.0), 30))
    assert exact.resampled == exact.mean_score == 100.0


def scored(rate: float, resampled: float, alpha: float = 0.5) -> Assessed:
    return Assessed(Setting(alpha, (4,)), rate, 100.0, resampled - 1, resampled + 1, resampled)


def test_recommend_picks_the_lowest_rate_whose_resampled_score_reaches_the_target():
    assessed = [scored(0.3, 98.0), scored(0.5, 99.5), scored(0.4, 99.0), scored(0.9, 100.0)]
    assert recommend(assessed, 99.0) is assessed[2]
    assert recommend(assessed, 99.9) is assessed[3]
    assert recommend(assessed, 100.5) is None
    assert recommend([], 99.0) is None


def test_recommend_ties_prefer_the_higher_resampled_score_then_the_first():
    assessed = [scored(0.4, 99.0), scored(0.4, 99.5), scored(0.4, 99.5, alpha=0.7)]
    assert recommend(assessed, 99.0) is assessed[1]
    assert recommend([scored(0.4, math.nan)], 0.0) is None
