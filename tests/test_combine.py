"""Combining several rewards: z-scores, ranks, weights, the single-reward pass-through."""

from __future__ import annotations

import math

import pytest

from specrej_ray.search.combine import combine, ranks, zscores


def test_single_reward_passes_through():
    assert combine([[3.0], [-1.5], [2.0]], [5.0], "zscore") == [3.0, -1.5, 2.0]


def test_zscores_by_hand():
    # mean 2, population std sqrt(8/3)
    s = math.sqrt(8 / 3)
    assert zscores([0.0, 2.0, 4.0]) == pytest.approx([-2 / s, 0.0, 2 / s])
    assert zscores([7.0, 7.0]) == [0.0, 0.0]


def test_ranks_with_ties():
    assert ranks([10.0, 30.0, 20.0]) == [0.0, 1.0, 0.5]
    assert ranks([1.0, 1.0, 5.0]) == [0.25, 0.25, 1.0]
    assert ranks([4.0]) == [1.0]


def test_weighted_zscore_sum_is_scale_free():
    rows = [[1.0, 100.0], [2.0, 300.0], [3.0, 200.0]]
    scaled = [[a, b * 1000] for a, b in rows]
    assert combine(rows, [1, 1], "zscore") == pytest.approx(combine(scaled, [1, 1], "zscore"))
    z0, z1 = zscores([1, 2, 3]), zscores([100, 300, 200])
    expected = [(3 * a + 1 * b) / 4 for a, b in zip(z0, z1, strict=True)]
    assert combine(rows, [3, 1], "zscore") == pytest.approx(expected)


def test_rank_average():
    rows = [[1.0, 9.0], [2.0, 8.0], [3.0, 7.0]]
    assert combine(rows, [1, 1], "rank") == pytest.approx([0.5, 0.5, 0.5])
    assert combine(rows, [3, 1], "rank") == pytest.approx([0.25, 0.5, 0.75])


def test_bad_input():
    with pytest.raises(ValueError, match="unknown combination"):
        combine([[1.0]], [1.0], "mean")
    with pytest.raises(ValueError, match="one score per weight"):
        combine([[1.0, 2.0]], [1.0], "rank")
    assert combine([], [1.0, 1.0], "rank") == []
