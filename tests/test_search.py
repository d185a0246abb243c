"""The pure algorithm: keep counts, decisions, schedules, wave sizing, metrics."""

from __future__ import annotations

import math
import random

import pytest

from specrej_ray.search.metrics import (
    counterfactual_token_rate,
    mean_or_nan,
    normalized_score,
    speedup,
    token_rate,
)
from specrej_ray.search.rejection import Decision, best_index, decide, keep_count
from specrej_ray.search.schedule import (
    MemorySchedule,
    TokensSchedule,
    first_horizon,
    make_schedule,
    wave_size,
)

# ---------------------------------------------------------------- keep_count


@pytest.mark.parametrize(
    ("in_play", "alpha", "expected"),
    [
        (0, 0.5, 0),
        (1, 0.0, 1),
        (1, 0.5, 1),  # 0.5 rounds up to 1
        (1, 0.9, 1),  # 0.1 -> 0, floored at 1
        (2, 0.5, 1),
        (3, 0.5, 2),  # 1.5 -> 2 (half-up; Python's round would also give 2)
        (5, 0.5, 3),  # 2.5 -> 3 (half-up; Python's round gives 2)
        (4, 0.5, 2),
        (10, 0.0, 10),
        (10, 0.25, 8),  # 7.5 -> 8
        (10, 0.7, 3),
        (10, 0.75, 3),  # 2.5 -> 3
        (15, 0.9, 2),  # exactly 1.5 -> 2, despite 1 - 0.9 != 0.1 in binary
        (100, 0.8, 20),
        (100, 0.99, 1),
        (7, 0.999, 1),  # 0.007 -> 0, floored at 1
        (16, 0.5, 8),
    ],
)
def test_keep_count_table(in_play: int, alpha: float, expected: int) -> None:
    assert keep_count(in_play, alpha) == expected


@pytest.mark.parametrize("alpha", [1.0, -0.1, 1.5, math.nan])
def test_keep_count_rejects_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        keep_count(4, alpha)


def test_keep_count_rejects_negative_count() -> None:
    with pytest.raises(ValueError):
        keep_count(-1, 0.5)


def test_keep_count_alpha_zero_keeps_all() -> None:
    for n in range(1, 50):
        assert keep_count(n, 0.0) == n


# ---------------------------------------------------------------- decide


def test_decide_basic_mixture() -> None:
    # Ranking: 1 (0.9), 3 (0.7), 0 (0.5), 2 (0.1); keep 2 -> live 0 and 2 rejected.
    d = decide([0.5, 0.9, 0.1, 0.7], [False] * 4, 0.5)
    assert d == Decision(kept=(1, 3), rejected=(0, 2), cutoff=0.7)


def test_decide_tie_at_boundary_lower_index_wins() -> None:
    # Four live with equal scores, keep 2: indices 0 and 1 win the tie.
    d = decide([1.0, 1.0, 1.0, 1.0], [False] * 4, 0.5)
    assert d.kept == (0, 1)
    assert d.rejected == (2, 3)
    assert d.cutoff == 1.0


def test_decide_tie_straddling_boundary() -> None:
    # Ranking 0 (3), then ties at 2 among 1, 2, 4, then 3 (1); keep 3 of 5 (2.5 -> 3):
    # indices 0, 1, 2 kept; 4 loses the tie to lower indices; 3 is below.
    d = decide([3.0, 2.0, 2.0, 1.0, 2.0], [False] * 5, 0.5)
    assert d.kept == (0, 1, 2)
    assert d.rejected == (3, 4)
    assert d.cutoff == 2.0


def test_decide_all_finished_rejects_nothing() -> None:
    d = decide([0.1, 0.2, 0.3, 0.4], [True] * 4, 0.75)
    assert d.kept == (0, 1, 2, 3)
    assert d.rejected == ()
    # keep_count(4, 0.75) == 1: the top is index 3 with 0.4.
    assert d.cutoff == 0.4


def test_decide_alpha_zero_is_best_of_n() -> None:
    scores = [0.3, -2.0, 5.0, 0.0, 1.0]
    d = decide(scores, [False, True, False, False, False], 0.0)
    assert d.kept == (0, 1, 2, 3, 4)
    assert d.rejected == ()
    assert d.cutoff == -2.0  # lowest of all, as every candidate is in the top


def test_decide_single_candidate() -> None:
    d = decide([-7.5], [False], 0.9)
    assert d == Decision(kept=(0,), rejected=(), cutoff=-7.5)


def test_decide_finished_below_cutoff_stays() -> None:
    # Ranking 0 (5), 2 (4), 1 (1, finished), 3 (0); keep 2 of 4.
    d = decide([5.0, 1.0, 4.0, 0.0], [False, True, False, False], 0.5)
    assert d.kept == (0, 1, 2)
    assert d.rejected == (3,)
    assert d.cutoff == 4.0


def test_decide_finished_in_top_takes_a_slot() -> None:
    # Finished candidates are ranked with the live ones, so a finished top scorer uses one
    # of the keep slots: keep 2 of 4 -> 1 (finished, 9) and 0 (5); live 2 and 3 rejected.
    d = decide([5.0, 9.0, 4.0, 3.0], [False, True, False, False], 0.5)
    assert d.kept == (0, 1)
    assert d.rejected == (2, 3)
    assert d.cutoff == 5.0


def test_decide_cutoff_is_lowest_of_top() -> None:
    # 10 candidates, alpha 0.7 -> keep 3; scores 0..9 shuffled by index.
    scores = [4.0, 9.0, 1.0, 7.0, 0.0, 8.0, 3.0, 6.0, 2.0, 5.0]
    d = decide(scores, [False] * 10, 0.7)
    assert d.kept == (1, 3, 5)  # scores 9, 7, 8
    assert d.cutoff == 7.0
    assert set(d.rejected) == set(range(10)) - {1, 3, 5}


def test_decide_negative_scores() -> None:
    d = decide([-1.0, -3.0, -2.0], [False] * 3, 0.5)  # keep round(1.5) = 2
    assert d.kept == (0, 2)
    assert d.rejected == (1,)
    assert d.cutoff == -2.0


def test_decide_nan_ranks_last() -> None:
    d = decide([math.nan, 1.0, 0.5], [False] * 3, 0.5)  # keep 2
    assert d.kept == (1, 2)
    assert d.rejected == (0,)
    assert d.cutoff == 0.5


def test_decide_validates_inputs() -> None:
    with pytest.raises(ValueError):
        decide([1.0, 2.0], [False], 0.5)
    with pytest.raises(ValueError):
        decide([], [], 0.5)
    with pytest.raises(ValueError, match="alpha"):
        decide([1.0], [False], 1.0)


@pytest.mark.parametrize("seed", range(5))
def test_decide_properties_random(seed: int) -> None:
    rng = random.Random(1000 + seed)
    for _ in range(400):
        n = rng.randint(1, 40)
        alpha = rng.choice([0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9, rng.random() * 0.99])
        # Small integer scores make ties common.
        scores = [float(rng.randint(-5, 5)) for _ in range(n)]
        finished = [rng.random() < 0.3 for _ in range(n)]
        d = decide(scores, finished, alpha)
        k = keep_count(n, alpha)

        kept, rejected = set(d.kept), set(d.rejected)
        assert kept | rejected == set(range(n))
        assert not kept & rejected
        assert list(d.kept) == sorted(d.kept)
        assert list(d.rejected) == sorted(d.rejected)
        # k survive, more only because finished candidates below the top are never rejected.
        finished_outside_top = [i for i in d.kept if finished[i] and i not in _top(scores, k)]
        assert len(d.kept) == k + len(finished_outside_top)
        assert all(not finished[i] for i in d.rejected)
        assert all(scores[i] <= d.cutoff for i in d.rejected)
        for i in d.kept:
            if not finished[i]:
                assert scores[i] >= d.cutoff
                for j in d.rejected:
                    assert scores[i] >= scores[j]
                    if scores[i] == scores[j]:
                        assert i < j  # ties go to the lower index
        assert d.cutoff in scores
        assert sum(1 for s in scores if s > d.cutoff) < k
        if alpha == 0:
            assert d.rejected == ()


def _top(scores: list[float], k: int) -> set[int]:
    # Independent reference: a stable sort on -score keeps lower indices first on ties.
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return set(order[:k])


@pytest.mark.parametrize("seed", range(3))
def test_decide_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 30)
        alpha = rng.random() * 0.99
        scores = [round(rng.gauss(0, 1), 1) for _ in range(n)]
        finished = [rng.random() < 0.25 for _ in range(n)]
        top = _top(scores, keep_count(n, alpha))
        d = decide(scores, finished, alpha)
        assert set(d.kept) == top | {i for i in range(n) if finished[i]}
        assert d.cutoff == min(scores[i] for i in top)


# ---------------------------------------------------------------- best_index


def test_best_index_picks_max_eligible() -> None:
    assert best_index([1.0, 5.0, 3.0], [True, False, True]) == 2
    assert best_index([1.0, 5.0, 3.0], [True, True, True]) == 1


def test_best_index_ties_lower_index() -> None:
    assert best_index([2.0, 7.0, 7.0, 7.0], [True, False, True, True]) == 2


def test_best_index_none_eligible() -> None:
    assert best_index([1.0, 2.0], [False, False]) is None
    assert best_index([], []) is None


def test_best_index_nan_never_wins() -> None:
    assert best_index([math.nan, -100.0], [True, True]) == 1
    assert best_index([math.nan, math.nan], [False, True]) == 1


def test_best_index_length_mismatch() -> None:
    with pytest.raises(ValueError):
        best_index([1.0], [True, False])


# ---------------------------------------------------------------- schedules


def test_tokens_schedule_exact_lengths() -> None:
    s = TokensSchedule([32, 64, 128])
    hits = [g for g in range(0, 300) if s.should_decide(g, 10, 999, 1)]
    assert hits == [32, 64, 128]


def test_tokens_schedule_ignores_memory() -> None:
    s = TokensSchedule([8])
    assert not s.should_decide(7, 1000, 10**6, 1)
    assert s.should_decide(8, 1, 1, 10**9)


@pytest.mark.parametrize("bad", [[], [0, 4], [4, 4], [8, 4]])
def test_tokens_schedule_validates(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        TokensSchedule(bad)


def test_memory_schedule_boundary() -> None:
    s = MemorySchedule(min_decision_tokens=4)
    # 10 rows of 99 tokens: the next step needs 10 * 100 = 1000 slots.
    assert not s.should_decide(20, 10, 99, 1000)  # exactly at budget: still fits
    assert s.should_decide(20, 10, 99, 999)  # one over: decide
    assert s.should_decide(20, 10, 100, 1000)  # one more token per row: decide


def test_memory_schedule_min_tokens() -> None:
    s = MemorySchedule(min_decision_tokens=16)
    assert not s.should_decide(15, 100, 1000, 10)  # way over budget but too early
    assert s.should_decide(16, 100, 1000, 10)


def test_memory_schedule_validates() -> None:
    with pytest.raises(ValueError):
        MemorySchedule(0)


def test_make_schedule() -> None:
    t = make_schedule([4, 9], 16)
    assert isinstance(t, TokensSchedule)
    assert t.decision_tokens == (4, 9)
    m = make_schedule(None, 16)
    assert isinstance(m, MemorySchedule)
    assert m.min_decision_tokens == 16


# ---------------------------------------------------------------- wave sizing


@pytest.mark.parametrize(
    ("remaining", "budget", "prompt", "horizon", "expected"),
    [
        (16, 1000, 50, 50, 10),  # 1000 // 100
        (8, 1000, 50, 50, 8),  # capped by remaining
        (16, 999, 50, 50, 9),
        (16, 50, 50, 50, 1),  # nothing fits: still start one
        (0, 1000, 50, 50, 0),
        (3, 0, 10, 10, 1),
        (5, 100, 0, 0, 5),  # zero-length rows: no memory limit
    ],
)
def test_wave_size(remaining: int, budget: int, prompt: int, horizon: int, expected: int) -> None:
    assert wave_size(remaining, budget, prompt, horizon) == expected


def test_wave_size_fits_until_memory_decision() -> None:
    # A wave sized to the first horizon does not trigger the memory schedule before it.
    prompt, horizon, budget = 37, 16, 5000
    rows = wave_size(1000, budget, prompt, horizon)
    sched = MemorySchedule(horizon)
    assert rows * (prompt + horizon) <= budget
    assert rows == 5000 // 53 == 94
    assert sched.should_decide(horizon, rows, prompt + horizon, budget) == (
        rows * (prompt + horizon + 1) > budget
    )


def test_wave_size_validates() -> None:
    with pytest.raises(ValueError):
        wave_size(-1, 10, 1, 1)


def test_first_horizon() -> None:
    assert first_horizon([32, 64], 16, 256, 0.5) == 32
    assert first_horizon([32, 64], 16, 20, 0.5) == 20
    assert first_horizon(None, 16, 256, 0.5) == 16
    assert first_horizon(None, 16, 8, 0.5) == 8
    # alpha 0 never rejects: rows must fit until the end.
    assert first_horizon([32], 16, 256, 0.0) == 256
    assert first_horizon(None, 16, 256, 0.0) == 256


# ---------------------------------------------------------------- metrics


def test_speedup() -> None:
    assert speedup(10.0, 4.0) == 2.5
    assert speedup(3.0, 6.0) == 0.5


@pytest.mark.parametrize(("bon", "sbon"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 2.0), (1.0, math.nan)])
def test_speedup_rejects_non_positive(bon: float, sbon: float) -> None:
    with pytest.raises(ValueError):
        speedup(bon, sbon)


def test_normalized_score() -> None:
    assert normalized_score([1.0, 3.0, 5.0], 4.0) == 75.0
    assert normalized_score([1.0, 3.0, 5.0], 5.0) == 100.0
    assert normalized_score([1.0, 3.0, 5.0], 1.0) == 0.0
    assert normalized_score([1.0, 3.0, 5.0], 6.0) == 125.0  # better than BoN's best
    assert normalized_score([-2.0, 2.0], -1.0) == 25.0


def test_normalized_score_zero_range() -> None:
    assert normalized_score([2.0, 2.0], 2.0) == 100.0
    assert normalized_score([2.0], 3.0) == 100.0
    assert normalized_score([2.0, 2.0], 1.0) == 0.0


def test_normalized_score_empty() -> None:
    with pytest.raises(ValueError):
        normalized_score([], 1.0)


def test_token_rate() -> None:
    assert token_rate(250, 1000) == 0.25
    assert token_rate(0, 10) == 0.0
    with pytest.raises(ValueError):
        token_rate(5, 0)
    with pytest.raises(ValueError):
        token_rate(-1, 10)


def test_counterfactual_token_rate() -> None:
    # lengths 100, 50, 10, 200 at tau 20; accepted: 0 and 3 in full (300), 1 cut (20),
    # 2 ended before tau (10): 330 / 360.
    rate = counterfactual_token_rate([100, 50, 10, 200], [True, False, False, True], 20)
    assert rate == pytest.approx(330 / 360)
    # Nothing accepted: the paper's display sum(min(l, tau)) / sum(l).
    assert counterfactual_token_rate([100, 50], [False, False], 20) == pytest.approx(40 / 150)
    # Everything accepted is Best-of-N.
    assert counterfactual_token_rate([7, 9], [True, True], 3) == 1.0


def test_counterfactual_token_rate_validates() -> None:
    with pytest.raises(ValueError):
        counterfactual_token_rate([], [], 5)
    with pytest.raises(ValueError):
        counterfactual_token_rate([1, 2], [True], 5)
    with pytest.raises(ValueError):
        counterfactual_token_rate([0, 0], [True, False], 5)


def test_mean_or_nan() -> None:
    assert mean_or_nan([1.0, 2.0, 6.0]) == 3.0
    assert math.isnan(mean_or_nan([]))
    assert mean_or_nan(x for x in [0.1] * 10) == pytest.approx(0.1)
