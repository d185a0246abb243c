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
    """The first `limit` prompts' candidates, generated in one batch as the run would;
    job.engine must run Best-of-N (alpha 0)."""
    if job.engine.search.alpha != 0:
        raise ValueError("collect needs a Best-of-N engine (alpha 0)")
    tasks = job.engine_tasks(limit)
    by_id = {t.prompt_id: t for t in tasks}
    out: list[Collected] = []

    def scored(result) -> None:
        # The prompts share one refilled batch; each is scored as its result comes.
        t0 = time.perf_counter()
        data = score_prefixes(job.engine, by_id[result.prompt_id], result, grid)
        seconds = result.seconds + time.perf_counter() - t0
        out.append(Collected(result.prompt_id, data, seconds))
        progress(f"tune: prompt {len(out)}/{len(tasks)} {result.prompt_id}: "
                 f"{len(data.lengths)} candidates, {sum(data.lengths)} tokens, {seconds:.1f} s")

    job.engine.run(tasks, on_result=scored)
    order = {t.prompt_id: i for i, t in enumerate(tasks)}
    return sorted(out, key=lambda c: order[c.prompt_id])
