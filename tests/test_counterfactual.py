"""The counterfactual replay of SBoN on pre-generated Best-of-N candidates (hand-built cases)."""

from __future__ import annotations

import random

import pytest

from specrej_ray.search.counterfactual import (
    PromptCandidates,
    evaluate,
    replay,
)
from specrej_ray.search.metrics import counterfactual_token_rate


def prompt(lengths, final, partial=None) -> PromptCandidates:
    return PromptCandidates(tuple(lengths), tuple(final), partial or {})


def random_prompt(rng: random.Random, n: int, grid: list[int]) -> PromptCandidates:
    lengths = [rng.randint(1, 20) for _ in range(n)]
    final = [rng.uniform(-1, 1) for _ in range(n)]
    partial = {t: [rng.uniform(-1, 1) for _ in range(n)] for t in grid}
    return prompt(lengths, final, partial)


@pytest.mark.parametrize("schedule", [(), (2,), (2, 4), (1, 5, 9)])
def test_alpha_zero_is_best_of_n(schedule):
    rng = random.Random(0)
    prompts = [random_prompt(rng, 7, [1, 2, 4, 5, 9]) for _ in range(5)]
    r = evaluate(prompts, 0.0, schedule)
    assert r.token_rate == 1.0 and r.sbon_tokens == r.bon_tokens
    assert r.bon_tokens == sum(sum(p.lengths) for p in prompts)
    assert r.mean_score == 100.0 and r.min_score == 100.0
    for p in prompts:
        one = replay(p, 0.0, schedule)
        assert one.rejected == {} and p.final[one.best] == max(p.final)


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.8, 0.95])
def test_perfect_partial_ranking_keeps_the_best(alpha):
    rng = random.Random(1)
    for _ in range(20):
        n = rng.randint(2, 12)
        lengths = [rng.randint(5, 30) for _ in range(n)]
        final = [rng.uniform(0, 10) for _ in range(n)]
        # Partial scores ordered exactly like the final ones (an affine map of them).
        partial = {4: [2 * f - 3 for f in final], 5: [f / 2 for f in final]}
        p = prompt(lengths, final, partial)
        out = replay(p, alpha, (4, 5))
        assert out.score == 100.0
        assert p.final[out.best] == max(final)
        assert out.rejected  # something was stopped: all candidates were live at 4
        assert out.sbon_tokens < out.bon_tokens


def test_finished_candidates_rank_with_their_final_score_and_are_never_rejected():
    # Candidate 0 finished at 2 tokens with the best final score; its partial entry at 4
    # (-100) must be ignored: it takes one of the 2 kept places, so 2 live ones are rejected.
    p = prompt([2, 10, 10, 10], [9.0, 1.0, 2.0, 3.0], {4: [-100.0, 1.0, 2.0, 3.0]})
    out = replay(p, 0.5, (4,))
    assert out.rejected == {1: 4, 2: 4}
    assert out.best == 0 and out.score == 100.0
    assert out.sbon_tokens == 2 + 4 + 4 + 10


def test_a_finished_candidate_below_the_cutoff_stays():
    # Candidate 3 finished (length 3 <= 4) with the lowest score: outside the top, not rejected.
    p = prompt([10, 10, 10, 3], [1.0, 2.0, 3.0, -5.0], {4: [1.0, 2.0, 3.0, 0.0]})
    out = replay(p, 0.5, (4,))
    assert 3 not in out.rejected
    assert out.rejected == {0: 4}


def test_a_candidate_ending_exactly_at_the_decision_is_finished():
    # Length 4 at a decision at 4: it finished on that step, so it is never rejected.
    p = prompt([4, 10, 10], [0.0, 1.0, 2.0], {4: [9.0, 1.0, 2.0]})
    out = replay(p, 0.6, (4,))
    assert 0 not in out.rejected
    assert out.rejected == {1: 4}  # finals rank 0 lowest, so both live ones compete


def test_no_decision_when_everything_in_play_has_finished():
    p = prompt([2, 3, 3], [1.0, 2.0, 3.0], {4: [0.0, 0.0, 0.0]})
    out = replay(p, 0.9, (4,))
    assert out.rejected == {} and out.sbon_tokens == out.bon_tokens == 8


def test_token_accounting_rejected_count_their_length_at_the_decision():
    lengths = [3, 8, 5, 6, 12, 4]
    final = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    p = prompt(lengths, final, {4: [0.0, 5.0, 1.0, 4.0, 2.0, 3.0]})
    out = replay(p, 0.5, (4,))
    # In play at 4: all six; finished: 0 (3 tokens) and 5 (4 tokens). Ranked by score:
    # 5 (final 5), 1 (5.0), 3 (4.0) kept; 4 (2.0) and 2 (1.0) rejected; 0 finished.
    assert out.rejected == {2: 4, 4: 4}
    assert out.sbon_tokens == 3 + 8 + 4 + 6 + 4 + 4
    accepted = [k not in out.rejected for k in range(len(lengths))]
    assert out.sbon_tokens / out.bon_tokens == counterfactual_token_rate(lengths, accepted, 4)


def test_two_decisions_only_rank_what_is_still_in_play():
    lengths = [20] * 8
    final = [float(k) for k in range(8)]
    partial = {
        2: [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # keeps 0..3
        6: [0.0, 9.0, 1.0, 8.0, 99.0, 99.0, 99.0, 99.0],  # 4..7 already gone: ignored
    }
    out = replay(prompt(lengths, final, partial), 0.5, (2, 6))
    assert out.rejected == {4: 2, 5: 2, 6: 2, 7: 2, 0: 6, 2: 6}
    assert out.sbon_tokens == 4 * 2 + 2 * 6 + 2 * 20
    assert out.best == 3
    assert out.score == pytest.approx(100 * (1 - (7 - 3) / 7))


def test_ties_keep_the_lower_index():
    p = prompt([10] * 4, [1.0, 2.0, 3.0, 4.0], {5: [1.0, 1.0, 1.0, 1.0]})
    out = replay(p, 0.5, (5,))
    assert out.rejected == {2: 5, 3: 5}
    assert out.best == 1


def test_normalized_score_when_the_best_is_rejected():
    p = prompt([10] * 4, [0.0, 10.0, 5.0, 8.0], {2: [3.0, 0.0, 2.0, 1.0]})
    out = replay(p, 0.5, (2,))
    assert out.best == 2 and out.best_score == 5.0
    assert out.score == pytest.approx(50.0)


def test_evaluate_pools_tokens_and_averages_scores():
    big = prompt([100] * 2, [0.0, 1.0], {10: [1.0, 0.0]})  # rejects the best: score 0
    small = prompt([4] * 2, [0.0, 1.0], {2: [0.0, 1.0], 10: [0.0, 1.0]})  # nothing live at 10
    r = evaluate([big, small], 0.5, (10,))
    assert r.sbon_tokens == 100 + 10 + 8 and r.bon_tokens == 208
    assert r.token_rate == pytest.approx(118 / 208)  # pooled, not the mean of per-prompt rates
    assert r.scores == (0.0, 100.0)
    assert r.mean_score == 50.0 and r.min_score == 0.0


def test_bad_inputs_raise():
    p = prompt([5, 5], [0.0, 1.0], {2: [0.0, 1.0]})
    with pytest.raises(ValueError, match="no partial scores at decision length 3"):
        replay(p, 0.5, (3,))
    with pytest.raises(ValueError, match="increasing"):
        replay(p, 0.5, (2, 2))
    with pytest.raises(ValueError, match="alpha"):
        replay(p, 1.0, (2,))
    with pytest.raises(ValueError, match="final scores"):
        prompt([5, 5], [0.0])
    with pytest.raises(ValueError, match="partial scores at t=2"):
        prompt([5, 5], [0.0, 1.0], {2: [0.0]})
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate([], 0.5, (2,))
