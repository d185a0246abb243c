"""A callable reward whose module takes two minutes to import: a reward actor that is still
loading its model when the test stops the run (tests/test_signals.py)."""

from __future__ import annotations

import time

time.sleep(120)


def score(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.0] * len(responses)
