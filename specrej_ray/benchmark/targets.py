"""The issue's targets, with the measured values and met / not met (reported, never asserted)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specrej_ray.benchmark.matched import Matched

TARGET_N = 64  # the normalized-score and same-N speedup targets are stated at N = 64


@dataclass(frozen=True)
class Target:
    name: str
    goal: str
    measured: str
    status: str  # "met", "not met" or "n/a (why)"


def evaluate_targets(n: int, normalized_mean: float, same_n_speedup: float, matched: Matched,
                     throughput_ratio: float | None, batch: int, occupancy: float,
                     occupancy_norefill: float) -> list[Target]:
    at_n = None if n == TARGET_N else f"n/a (this run's N is {n}, the target's {TARGET_N})"
    if matched.speedup is not None:
        matched_value, matched_text = matched.speedup, f"{matched.speedup:.2f}x " \
            f"(Best-of-{matched.n})"
    else:
        matched_value = matched.lower_bound if matched.lower_bound is not None else math.nan
        matched_text = (f">= {matched.lower_bound:.2f}x (no Best-of-N reached SBoN)"
                        if matched.lower_bound is not None else "n/a")
    return [
        Target(f"SBoN normalized score vs Best-of-N at N = {TARGET_N}", ">= 99",
               f"{normalized_mean:.1f} (N = {n})", at_n or _status(normalized_mean, 99)),
        Target(f"wall-clock speedup vs Best-of-N at N = {TARGET_N}", ">= 3x",
               f"{same_n_speedup:.2f}x (N = {n})", at_n or _status(same_n_speedup, 3)),
        Target("speedup at matched reward", ">= 8x", matched_text, _status(matched_value, 8)),
        Target(f"engine tokens/s / model.generate tokens/s at batch {batch}", ">= 1.5x",
               "skipped" if throughput_ratio is None else f"{throughput_ratio:.2f}x",
               "n/a (skipped)" if throughput_ratio is None else _status(throughput_ratio, 1.5)),
        Target("batch occupancy with refill (SBoN)", ">= 80%",
               f"{occupancy:.1%} (without refill {occupancy_norefill:.1%})",
               _status(occupancy, 0.8)),
    ]


def _status(value: float, threshold: float) -> str:
    if math.isnan(value):
        return "n/a (no value)"
    return "met" if value >= threshold else "not met"
