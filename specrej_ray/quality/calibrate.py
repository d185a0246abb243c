"""Calibration data for a job: each calibration prompt's Best-of-N candidates with their
rewards at a grid of decision lengths, and the choice `schedule: auto` makes from them.

Every candidate is scored at each decision length t where it is still live, as the text a
live decision would see (`stopper.text(tokens[:t])`). A candidate finished by t keeps its
final reward row, as at a live decision. The rows at t are then combined by the job's
RewardSet over *all N candidates of the prompt*, whereas a live decision combines only the
candidates still in play. With one reward combining is the identity, so nothing changes;
with several, z-scores or ranks over all N are the counterfactual's approximation.
`specrej-ray tune` runs the same collection and replay, and prints the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specrej_ray.engine.decisions import scores_here, tracking_of
from specrej_ray.engine.hf.engine import Engine, ScoreError
from specrej_ray.engine.scoring import Scorer
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.engine.task import Choice, EngineTask
from specrej_ray.quality.calibration import ALPHAS, GRID, choose, default_settings
from specrej_ray.quality.stats import kendall_tau_b, pearson
from specrej_ray.search.counterfactual import PromptCandidates
from specrej_ray.search.metrics import mean_or_nan


def score_prefixes(engine: Engine, task: EngineTask, result: PromptResult,
                   grid: Sequence[int]) -> PromptCandidates:
    """Each candidate's rewards at each decision length where it is still live, combined
    over the prompt's N candidates. Lengths are scored in increasing order with each
    candidate named (engine.scoring.Tracking), so rewards that keep a cache per candidate
    feed only the new tokens; a free reward (the generator's own likelihood) is read off the
    decode loop's log-probabilities."""
    cands = result.candidates
    unfinished = [c.index for c in cands if not c.finished or c.final_score is None]
    if unfinished:
        raise ValueError(f"prompt {task.prompt_id!r}: candidates {unfinished} did not finish")
    lengths = [len(c.tokens) for c in cands]
    scorer = Scorer(task.prompt_id, engine.rewards.names, task.score)
    free = task.self_scored and engine.rewards.any_free
    rows: dict[tuple[int, int], list[float]] = {}
    for t in sorted(grid):
        live = [c for c in cands if lengths[c.index] > t]
        if not live:
            continue
        items = [(c, t) for c in live]
        texts = [engine.stopper.text(c.tokens[:t]) for c in live]
        local = scores_here(items, texts, engine.rewards, free, task.local)
        try:
            got = scorer.now(texts, live, local, tracking_of(items, last=t == max(grid)))
        except ScoreError as e:
            raise ScoreError(f"{e} (calibration, at {t} tokens)") from None
        rows.update(((t, c.index), row) for c, row in zip(live, got, strict=True))
    partial = {
        t: engine.rewards.combine([rows[t, c.index] if (t, c.index) in rows
                                   else _final_row(engine, c) for c in cands])
        for t in grid
    }
    final = tuple(float(c.final_score) for c in cands)  # type: ignore[arg-type]
    return PromptCandidates(tuple(lengths), final, partial)


def _final_row(engine: Engine, c: Candidate) -> list[float]:
    return [c.components[name] for name in engine.rewards.names]


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


def grid_for(max_new_tokens: int) -> tuple[int, ...]:
    """The decision lengths calibration scores: the default grid below max_new_tokens."""
    return tuple(t for t in GRID if t < max_new_tokens)


def table_json(p: PromptCandidates) -> dict:
    """A prompt's calibration data as a shard record keeps it."""
    return {"lengths": list(p.lengths), "final": list(p.final),
            "partial": {str(t): list(s) for t, s in p.partial.items()}}


def table_from_json(d: dict) -> PromptCandidates:
    return PromptCandidates(tuple(d["lengths"]), tuple(d["final"]),
                            {int(t): s for t, s in d["partial"].items()})


def decide_setting(tables: dict[str, PromptCandidates], target: float, fallback: str,
                   max_new_tokens: int) -> dict:
    """What `schedule: auto` runs the rest of the job with, and the evidence: every
    setting's token rate and normalized score with its 95% interval, the correlations of
    partial with final rewards. `run_with` is the chosen setting, or Best-of-N (alpha 0)
    when none qualifies, or the one with the highest lower bound (fallback `closest`)."""
    grid = grid_for(max_new_tokens)
    data = [tables[pid] for pid in sorted(tables)]
    settings = default_settings(grid, ALPHAS)
    choice = choose(data, settings, target)
    if choice.chosen is not None:
        run_with, how = choice.chosen, "chosen"
    elif fallback == "closest":
        run_with = max(choice.assessed, key=lambda a: (a.low, -a.token_rate))
        how = "closest (no setting reached the target)"
    else:
        run_with, how = None, "Best-of-N (no setting reached the target)"
    return {
        "prompts": sorted(tables), "target": target, "grid": list(grid),
        "alphas": list(ALPHAS), "reason": choice.reason, "how": how,
        "run_with": ({"alpha": run_with.setting.alpha,
                      "schedule": list(run_with.setting.schedule)}
                     if run_with is not None else {"alpha": 0.0, "schedule": None}),
        "settings": [{"alpha": a.setting.alpha, "schedule": list(a.setting.schedule),
                      "token_rate": a.token_rate, "mean_score": a.mean_score, "low": a.low,
                      "high": a.high, "resampled": a.resampled} for a in choice.assessed],
        "correlations": [_finite(asdict(c)) for c in correlations(data, grid)],
    }


def choice_from(run_with: dict) -> Choice:
    """decide_setting's `run_with` as the engine takes it."""
    schedule = run_with["schedule"]
    return Choice(run_with["alpha"], tuple(schedule) if schedule else None)


def _finite(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
