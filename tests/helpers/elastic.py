"""A callable reward (reward.type: callable) for tests/test_elastic.py.

It scores like tests.helpers.rewards:vowels and reacts to markers in the prompt text:

- `[hold:PATH]`: wait until PATH exists (at most 60 s, then create it) before scoring;
  `PATH.held` is created first, so a test knows a shard is being held.
- `[report:DIR]`: write where this reward actor runs (node, placement group, GPU ids,
  CUDA_VISIBLE_DEVICES) to `DIR/<pid>.json`.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

_MARK = re.compile(r"\[(hold|report):([^\]]+)\]")


def score(prompts: list[str], responses: list[str]) -> list[float]:
    for prompt in dict.fromkeys(prompts):
        for kind, path in _MARK.findall(prompt):
            if kind == "hold":
                _hold(Path(path))
            else:
                _report(Path(path))
    return [float(sum(ch in "aeiou" for ch in r)) for r in responses]


def _hold(path: Path, limit_s: float = 60.0) -> None:
    Path(f"{path}.held").touch()
    end = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    path.touch()  # after a timeout, later holds (the next decision point) pass at once


def _report(folder: Path) -> None:
    import ray

    ctx = ray.get_runtime_context()
    where = {"node_id": ctx.get_node_id(), "placement_group": ctx.get_placement_group_id(),
             "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    tmp = folder / f".{os.getpid()}.tmp"
    tmp.write_text(json.dumps(where))
    tmp.replace(folder / f"{os.getpid()}.json")  # whole, for a test that reads it meanwhile
