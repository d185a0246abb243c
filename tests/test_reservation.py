"""KV reservations as profiles over future steps (search.reservation): the arithmetic."""

from __future__ import annotations

import random

import pytest

from specrej_ray.search.reservation import FOREVER, Term, chunk_up, growth_terms, peak


def test_chunk_up() -> None:
    assert [chunk_up(t, 16) for t in (0, 1, 15, 16, 17, 32, 33)] == [0, 16, 16, 16, 32, 32, 48]
    assert chunk_up(-3, 16) == 0


def test_term_counts_inside_its_steps_only() -> None:
    t = Term(3, 5, rows=2, fed=10)
    assert [t.at(s, 4) for s in range(1, 8)] == [0, 0, 24, 24, 24, 0, 0]  # 10, 11, 12 fed
    hold = Term(1, FOREVER, rows=2, fed=10, grows=False)
    assert hold.at(1, 4) == hold.at(10**6, 4) == 24
    assert Term(1, 3, const=7).at(2, 4) == 7
    assert Term(1, 9, rows=10, fed=0, ceiling=50).at(9, 1) == 50


def test_term_validates() -> None:
    with pytest.raises(ValueError):
        Term(0, 3)
    with pytest.raises(ValueError):
        Term(1, FOREVER, rows=1)  # growing forever has no peak


def test_growth_terms_hold_one_token_less_than_they_sample() -> None:
    # Rows that have sampled nothing: step s samples token s and holds s - 1 fed tokens.
    (t,) = growth_terms([(5, 3)], 0)
    assert (t.first, t.last) == (1, 5)
    assert [t.at(s, 1) for s in range(1, 6)] == [0, 3, 6, 9, 12]
    # Rows at 10 tokens (9 fed): the next step feeds token 10.
    a, b = growth_terms([(12, 4), (20, 2)], 10, start=3)
    assert (a.first, a.last, a.at(3, 1)) == (3, 4, 40)
    assert (b.first, b.last, b.at(5, 1), b.at(12, 1)) == (5, 12, 24, 38)


def test_growth_terms_skip_phases_already_passed() -> None:
    assert growth_terms([(8, 5), (30, 2)], 10) == growth_terms([(30, 2)], 10)


def test_staggered_rows_peak_lower_than_the_sum_of_their_peaks() -> None:
    old = growth_terms([(100, 10)], 90)  # ends in 10 steps, at its largest now
    new = growth_terms([(100, 10)], 0)  # grows for 100 steps
    assert peak(old, 1) + peak(new, 1) == 10 * 99 * 2
    assert peak(old + new, 1) == 10 * 99 + 10 * 9  # the new rows at the old ones' end


def test_peak_counts_holds_from_their_first_step() -> None:
    terms = [Term(1, 5, rows=1, fed=0), Term(8, FOREVER, rows=1, fed=50, grows=False)]
    assert peak(terms, 1) == 50
    assert peak([], 1) == 0


@pytest.mark.parametrize("seed", range(30))
def test_peak_equals_the_step_by_step_maximum(seed: int) -> None:
    rng = random.Random(seed)
    terms = []
    for _ in range(rng.randint(1, 8)):
        first = rng.randint(1, 40)
        if rng.random() < 0.2:
            terms.append(Term(first, FOREVER, rows=rng.randint(1, 5), fed=rng.randint(0, 60),
                              grows=False, const=rng.randint(0, 9)))
        else:
            terms.append(Term(first, first + rng.randint(0, 40), rows=rng.randint(0, 5),
                              fed=rng.randint(0, 60), const=rng.randint(0, 9),
                              ceiling=rng.choice([FOREVER, rng.randint(10, 200)])))
    chunk = rng.choice([1, 4, 16])
    brute = max(sum(t.at(s, chunk) for t in terms) for s in range(1, 200))
    assert peak(terms, chunk) == brute
