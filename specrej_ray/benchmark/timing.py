"""Wall-clock timing that waits for the accelerator (CUDA calls return before they finish)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """fn's result and its seconds, the device's queued work included."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` runs: the least disturbed by anything else on the machine."""
    return min(timed(fn, device)[1] for _ in range(repeats))


def say(message: str) -> None:
    """A progress line on stderr (stdout is left for results)."""
    print(f"bench: {message}", file=sys.stderr, flush=True)
