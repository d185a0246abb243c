"""The pure algorithm: keep counts, decisions, schedules and their reservations, metrics."""

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
from specrej_ray.search.reservation import peak
from specrej_ray.search.schedule import (
    BestOfN,
    Cohort,
    Layout,
    MemorySchedule,
    TokensSchedule,
    make_schedule,
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

LAYOUT = Layout(prompt_tokens=40, chunk=16)


def cohort(live, length, *, in_play=None, alpha=0.5, cap=0, kv_share=10**9, decided_at=0,
           max_new=256) -> Cohort:
    return Cohort(live, live if in_play is None else in_play, length, max_new, alpha, cap,
                  kv_share, decided_at)


def test_layout_counts_whole_chunks_and_one_prefix() -> None:
    assert LAYOUT.rows(3, 0) == 0
    assert LAYOUT.rows(3, 1) == LAYOUT.rows(3, 16) == 48
    assert LAYOUT.rows(3, 17) == 96
    assert LAYOUT.prompt(3, 17) == 40 + 96
    assert LAYOUT.fit(40 + 96, 17) == 3 and LAYOUT.fit(40 + 95, 17) == 2
    assert LAYOUT.fit(39, 5) == 0


def test_tokens_schedule_meets_at_each_length_then_runs_to_the_end() -> None:
    s = TokensSchedule([32, 64])
    assert [s.meeting(g, 256) for g in (0, 31, 32, 63, 64, 200)] == [32, 32, 64, 64, 256, 256]
    assert s.meeting(0, 20) == 20  # decisions past the end never happen
    assert s.first_horizon(256) == 32


def test_tokens_schedule_decides_once_at_each_length() -> None:
    s = TokensSchedule([8, 16])
    hits = [g for g in range(0, 40) if s.decide_now(cohort(10, g), LAYOUT)]
    assert hits == [8, 16]
    assert not s.decide_now(cohort(10, 8, decided_at=8), LAYOUT)
    assert s.decide_now(cohort(10**6, 8, kv_share=1), LAYOUT)  # memory plays no part


@pytest.mark.parametrize("bad", [[], [0, 4], [8, 8], [9, 4]])
def test_tokens_schedule_validates(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        TokensSchedule(bad)


def test_memory_schedule_first_decision_at_min_tokens_whatever_the_memory() -> None:
    s = MemorySchedule(16)
    assert s.meeting(0, 256) == 16 and s.meeting(16, 256) == 256
    assert not s.decide_now(cohort(100, 15, kv_share=1), LAYOUT)  # over budget but too early
    assert s.decide_now(cohort(2, 16), LAYOUT)  # room to spare: still the first decision
    assert not s.decide_now(cohort(2, 16, decided_at=16), LAYOUT)


def test_memory_schedule_decides_when_the_next_step_would_overflow_the_share() -> None:
    s = MemorySchedule(16)
    share = LAYOUT.prompt(10, 48)  # 10 rows of up to 48 tokens
    # At length L the next step feeds token L: 10 rows of 48 fit, of 49 do not.
    assert not s.decide_now(cohort(10, 48, kv_share=share, decided_at=16), LAYOUT)
    assert s.decide_now(cohort(10, 49, kv_share=share, decided_at=16), LAYOUT)
    # With overlap the rows may go on `cap` tokens before the cut: decide that much earlier.
    assert s.decide_now(cohort(10, 40, kv_share=share, cap=9, decided_at=16), LAYOUT)
    assert not s.decide_now(cohort(10, 32, kv_share=share, cap=9, decided_at=16), LAYOUT)


def test_memory_schedule_keeps_no_more_live_rows_than_the_share_holds() -> None:
    # alpha's cut counts finished candidates; memory is the hard limit on the live ones.
    s = MemorySchedule(4)
    share = LAYOUT.prompt(3, 100)
    assert s.max_live(cohort(9, 100, kv_share=share, decided_at=4), LAYOUT) == 3
    assert s.max_live(cohort(9, 100, kv_share=share, cap=20, decided_at=4), LAYOUT) == 2
    assert s.max_live(cohort(9, 100, kv_share=1, decided_at=4), LAYOUT) == 1  # never 0
    assert TokensSchedule([8]).max_live(cohort(9, 8, kv_share=1), LAYOUT) is None
    assert not s.decide_now(cohort(1, 100, kv_share=1, decided_at=4), LAYOUT)  # nothing to cut


def test_memory_schedule_share() -> None:
    s = MemorySchedule(16)
    # Fixed N: what N rows hold at the first decision (15 tokens fed), capped by the device,
    # and never less than one candidate to its end.
    assert s.kv_share(10**9, 8, LAYOUT, cap=0, max_new=128) == 40 + 8 * 16
    assert s.kv_share(10**9, 8, LAYOUT, cap=4, max_new=128) == 40 + 8 * 32
    assert s.kv_share(10**9, 2, LAYOUT, cap=0, max_new=128) == 40 + 128
    assert s.kv_share(100, 8, LAYOUT, cap=0, max_new=128) == 100
    assert TokensSchedule([8]).kv_share(100, 8, LAYOUT, 0, 128) == 100
    assert BestOfN().kv_share(100, 8, LAYOUT, 0, 128) == 100


def test_memory_schedule_validates() -> None:
    with pytest.raises(ValueError):
        MemorySchedule(0)


def test_auto_n_fills_the_budget_to_the_first_meeting() -> None:
    device = 40 + 100 * 16 + 15
    assert MemorySchedule(16).auto_n(device, LAYOUT, cap=0, max_new=256) == 100
    assert MemorySchedule(16).auto_n(device, LAYOUT, cap=1, max_new=256) == 100  # 16 fed
    assert MemorySchedule(16).auto_n(device, LAYOUT, cap=2, max_new=256) == 50  # 17: 32 slots
    assert TokensSchedule([32]).auto_n(device, LAYOUT, cap=0, max_new=256) == 50
    assert BestOfN().auto_n(device, LAYOUT, cap=9, max_new=16) == 100  # to the end, no cap
    assert MemorySchedule(16).auto_n(10, LAYOUT, cap=0, max_new=256) == 1  # never 0


def test_best_of_n_never_decides() -> None:
    s = BestOfN()
    assert not s.decides and s.meeting(0, 99) == 99
    assert not any(s.decide_now(cohort(64, g, kv_share=1), LAYOUT) for g in range(100))
    assert s.phases(cohort(64, 10, max_new=99)) == [(99, 64)]


def test_phases_cut_at_each_decision_with_one_cutoff() -> None:
    s = TokensSchedule([16, 64])
    # 64 in play at alpha 0.75: 16 survive at 16 tokens, 4 at 64; overlap adds cap tokens.
    assert s.phases(cohort(64, 0, alpha=0.75)) == [(16, 64), (64, 16), (256, 4)]
    assert s.phases(cohort(64, 0, alpha=0.75, cap=8)) == [(24, 64), (72, 16), (256, 4)]
    # Finished candidates stay in play: 10 live of 20 in play keep at most 5 live.
    assert s.phases(cohort(10, 20, in_play=20, alpha=0.75)) == [(64, 10), (256, 5)]


def test_reserve_places_each_phase_in_time() -> None:
    s = TokensSchedule([16])
    terms = s.reserve(cohort(8, 0, max_new=40), LAYOUT)
    # Steps 1..16 sample tokens 1..16 holding 0..15 fed tokens; then 4 rows to token 40.
    assert [(t.first, t.last, t.rows) for t in terms] == [(1, 16, 8), (17, 40, 4)]
    assert terms[0].at(1, 16) == 0 and terms[0].at(16, 16) == 8 * 16
    assert terms[1].at(17, 16) == 4 * 16 and terms[1].at(18, 16) == 4 * 32


def test_memory_reserve_stays_within_the_share() -> None:
    s = MemorySchedule(16)
    share = LAYOUT.prompt(8, 15)
    terms = s.reserve(cohort(8, 0, kv_share=share, max_new=200), LAYOUT)
    assert peak(terms, 16) <= share - 40
    assert max(t.last for t in terms) == 200  # the survivors may run to the end


def test_make_schedule() -> None:
    assert isinstance(make_schedule(0.0, [4, 9], 16), BestOfN)
    t = make_schedule(0.5, [4, 9], 16)
    assert isinstance(t, TokensSchedule) and t.decision_tokens == (4, 9)
    m = make_schedule(0.5, None, 16)
    assert isinstance(m, MemorySchedule) and m.min_decision_tokens == 16


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
