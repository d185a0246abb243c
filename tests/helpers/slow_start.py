"""A callable reward whose module takes two minutes to import in a Ray worker: a reward
actor that is still loading its model when the test stops the run (tests/test_signals.py).
The driver imports it too, before Ray starts, to check the function exists: there it loads
at once."""

from __future__ import annotations

import time

import ray

if ray.is_initialized():  # a worker: the actor's load; the driver checks before Ray starts
    time.sleep(120)


def score(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.0] * len(responses)
