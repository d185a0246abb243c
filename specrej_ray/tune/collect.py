"""Generate each prompt's N candidates once (Best-of-N) and score their prefixes (the
scoring and the correlation table are calibrate.py's, which `schedule: auto` shares)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specrej_ray.job.local import LocalJob
from specrej_ray.quality.calibrate import Correlation, correlations, score_prefixes
from specrej_ray.search.counterfactual import PromptCandidates

__all__ = ["Collected", "Correlation", "collect", "correlations", "score_prefixes"]


@dataclass(frozen=True)
class Collected:
    prompt_id: str
    data: PromptCandidates
    seconds: float  # generation and scoring


def collect(job: LocalJob, grid: Sequence[int], limit: int,
            progress: Callable[[str], None]) -> list[Collected]:
    """The first `limit` prompts' candidates; job.engine must run Best-of-N (alpha 0)."""
    if job.engine.search.alpha != 0:
        raise ValueError("collect needs a Best-of-N engine (alpha 0)")
    tasks = job.engine_tasks(limit)
    out: list[Collected] = []
    for i, task in enumerate(tasks, 1):
        t0 = time.perf_counter()
        result = job.engine.generate(task.prompt_id, task.input_ids, task.score)
        data = score_prefixes(job.engine, task, result, grid)
        seconds = time.perf_counter() - t0
        out.append(Collected(task.prompt_id, data, seconds))
        progress(f"tune: prompt {i}/{len(tasks)} {task.prompt_id}: {len(data.lengths)} "
                 f"candidates, {sum(data.lengths)} tokens, {seconds:.1f} s")
    return out
