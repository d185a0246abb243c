"""The stopping rule for rewards without a ceiling (search.draws until: rule): Pandora's box on
a normal fit of the prompt's own finished rewards."""

from __future__ import annotations

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from specrej_ray.search.pandora import MIN_REWARDS, enough, gain


@given(st.floats(-4, 4))
def test_gain_is_the_expected_excess_of_a_normal_over_the_best(z):
    # E[(X - z)+] for X ~ N(0, 1), by the midpoint rule far into the tail.
    step, total, x = 1e-3, 0.0, z
    while x < z + 12:
        mid = x + step / 2
        total += (mid - z) * math.exp(-mid * mid / 2) / math.sqrt(2 * math.pi) * step
        x += step
    assert math.isclose(gain(z), total, rel_tol=1e-4, abs_tol=1e-9)


def test_a_prompt_stops_once_its_best_stands_far_enough_above_its_spread():
    assert gain(0) > gain(1) > gain(2) > 0
    rng = random.Random(0)
    rewards = [rng.gauss(0, 1) for _ in range(8)]
    assert not enough(rewards[: MIN_REWARDS - 1], cost=10.0)  # too few to fit a spread
    assert enough([0.3] * 5, cost=1e-9)  # all alike: another adds nothing
    scaled = [100 * r + 7 for r in rewards]  # the same rule on any reward's scale
    for cost in (0.01, 0.05, 0.2):
        assert enough(rewards, cost) == enough(scaled, cost)
    assert enough(rewards, 0.5) and not enough(rewards, 1e-4)
