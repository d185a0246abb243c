"""Generate each prompt's N candidates once (Best-of-N) and score their prefixes.

Every candidate is scored at each decision length t where it is still live, as the text a
live decision would see (`stopper.text(tokens[:t])`). A candidate finished by t keeps its
final reward row, as at a live decision. The rows at t are then combined by the job's
RewardSet over *all N candidates of the prompt*, whereas a live decision combines only the
candidates still in play. With one reward combining is the identity, so nothing changes;
with several, z-scores or ranks over all N are the counterfactual's approximation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specrej_ray.engine.engine import Engine, EngineTask, ScoreError
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.local import LocalJob
from specrej_ray.search.counterfactual import PromptCandidates
from specrej_ray.search.metrics import mean_or_nan
from specrej_ray.stats import kendall_tau_b, pearson


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


def score_prefixes(engine: Engine, task: EngineTask, result: PromptResult,
                   grid: Sequence[int]) -> PromptCandidates:
    cands = result.candidates
    unfinished = [c.index for c in cands if not c.finished or c.final_score is None]
    if unfinished:
        raise ValueError(f"prompt {task.prompt_id!r}: candidates {unfinished} did not finish")
    lengths = [len(c.tokens) for c in cands]
    todo = [(t, c) for t in grid for c in cands if lengths[c.index] > t]
    fresh = _rows(task, [engine.stopper.text(c.tokens[:t]) for t, c in todo]) if todo else []
    rows = {(t, c.index): row for (t, c), row in zip(todo, fresh, strict=True)}
    partial = {
        t: engine.rewards.combine([rows[t, c.index] if (t, c.index) in rows
                                   else _final_row(engine, c) for c in cands])
        for t in grid
    }
    final = tuple(float(c.final_score) for c in cands)  # type: ignore[arg-type]
    return PromptCandidates(tuple(lengths), final, partial)


def _final_row(engine: Engine, c: Candidate) -> list[float]:
    return [c.components[name] for name in engine.rewards.names]


def _rows(task: EngineTask, texts: list[str]) -> list[list[float]]:
    """One scorer call for all of a prompt's prefixes (each reward batches them itself)."""
    rows = [[float(s) for s in row] for row in task.score(texts)]
    if len(rows) != len(texts) or not all(math.isfinite(s) for row in rows for s in row):
        raise ScoreError(f"rewards returned {len(rows)} rows (or non-finite scores) for "
                         f"{len(texts)} partial responses of prompt {task.prompt_id!r}")
    return rows


@dataclass(frozen=True)
class Correlation:
    """Partial (at `tokens`) vs final reward, over the candidates still live at `tokens`."""

    tokens: int
    pearson: float  # mean over prompts where defined; NaN where no prompt has one
    kendall: float
    prompts: int  # prompts where Pearson is defined (>= 2 live candidates, both vary)
    live: float  # mean live candidates per prompt


def correlations(prompts: Sequence[PromptCandidates], grid: Sequence[int]) -> list[Correlation]:
    """Per decision length: per-prompt Pearson and Kendall tau-b, averaged over prompts.

    Finished candidates are left out: their partial reward is their final one, which would
    inflate the correlation while a decision can never reject them.
    """
    out = []
    for t in grid:
        rs, taus, live = [], [], []
        for p in prompts:
            ks = [k for k, n in enumerate(p.lengths) if n > t]
            live.append(len(ks))
            xs, ys = [p.partial[t][k] for k in ks], [p.final[k] for k in ks]
            r, tau = pearson(xs, ys), kendall_tau_b(xs, ys)
            rs += [r] if r is not None else []
            taus += [tau] if tau is not None else []
        out.append(Correlation(t, mean_or_nan(rs), mean_or_nan(taus), len(rs),
                               mean_or_nan(live)))
    return out
