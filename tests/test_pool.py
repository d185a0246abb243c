"""Best-of-k from one pool (quality.pool): each estimate equals its brute-force average over
every k-subset (every ordering, for sampling until the ceiling) of the pool."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from specrej_ray.quality.pool import (
    best_of_k,
    matched_k,
    tokens_of_k,
    tokens_until_ceiling,
    yield_of_k,
)

POOLS = st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.integers(1, 9)),
                 min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(POOLS)
def test_each_estimate_is_its_average_over_the_pools_subsets(pool):
    rewards, tokens = [r for r, _ in pool], [t for _, t in pool]
    hits = [r == 1.0 for r in rewards]
    m = len(pool)
    for k in range(1, m + 1):
        subsets = list(itertools.combinations(range(m), k))
        assert math.isclose(best_of_k(rewards)[k - 1],
                            sum(max(rewards[i] for i in s) for s in subsets) / len(subsets),
                            abs_tol=1e-12)
        assert math.isclose(yield_of_k(hits)[k - 1],
                            sum(any(hits[i] for i in s) for s in subsets) / len(subsets),
                            abs_tol=1e-12)
        assert math.isclose(tokens_of_k(tokens)[k - 1], k * sum(tokens) / m)
    for cap in range(1, m + 1):
        orders = list(itertools.permutations(range(m)))

        def spent(order, cap=cap):
            used = 0
            for i in order[:cap]:
                used += tokens[i]
                if hits[i]:
                    break
            return used

        want = sum(spent(o) for o in orders) / len(orders)
        assert math.isclose(tokens_until_ceiling(tokens, hits, cap), want, rel_tol=1e-12)


def test_large_pools_stay_finite_and_ordered():
    rewards = [i % 17 / 16 for i in range(4096)]
    curve = best_of_k(rewards[:512])
    assert all(a <= b + 1e-9 for a, b in zip(curve, curve[1:], strict=False))  # rounding
    assert math.isclose(curve[-1], max(rewards[:512]))
    assert yield_of_k([False] * 4095 + [True])[-1] == 1.0


def test_the_k_a_figure_matches_is_interpolated_in_log_k():
    curve = [0.1, 0.3, 0.5]
    assert matched_k(curve, 0.05) == 1.0
    assert math.isclose(matched_k(curve, 0.4), math.exp((math.log(2) + math.log(3)) / 2))
    assert matched_k(curve, 0.6) is None
