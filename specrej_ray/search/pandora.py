"""When another draw is not worth its cost, for rewards without a ceiling (pure): a
Pandora's-box stopping rule on the prompt's own finished rewards (search.draws.until: rule).

Weitzman's rule for Pandora's box opens another box while what it can add is worth its cost:
with the best reward so far b and a candidate's reward X ~ N(mu, sigma) (the prompt's own
finished rewards, fitted), one more candidate adds E[(X - b)+] = sigma g(z), z = (b - mu) /
sigma, g(z) = phi(z) - z (1 - Phi(z)). The prompt stops drawing once that is at most `cost`
sigma: each candidate costs a fixed share of the prompt's own spread, so the rule means the
same on every reward's scale (a likelihood's differences are small, a classifier's large).
The fit ignores the uncertainty of mu and sigma themselves (BEACON integrates it out); the
rule is measured before it is trusted (BENCHMARKS.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Fewer finished rewards than this fit no spread: draw on.
MIN_REWARDS = 3


def gain(z: float) -> float:
    """E[(X - b)+] / sigma for X ~ N(mu, sigma) and z = (b - mu) / sigma."""
    phi = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    tail = 0.5 * math.erfc(z / math.sqrt(2))
    return phi - z * tail


def enough(rewards: Sequence[float], cost: float) -> bool:
    """Whether one more candidate is worth at most `cost` of the rewards' spread."""
    if len(rewards) < MIN_REWARDS:
        return False
    mu = math.fsum(rewards) / len(rewards)
    sigma = math.sqrt(math.fsum((r - mu) ** 2 for r in rewards) / (len(rewards) - 1))
    if sigma == 0:
        return True  # every candidate the same: another one adds nothing
    return gain((max(rewards) - mu) / sigma) <= cost
