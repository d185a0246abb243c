"""`specrej-ray tune JOB.yaml`: the paper's counterfactual analysis (section 6.2).

Pipeline: options (checked before loading anything) -> collect (N full candidates per prompt
with Best-of-N, partial rewards at a grid of decision lengths), or saved (those of an earlier
tune.json) -> search.counterfactual (replay SBoN for every alpha x schedule) and
quality.calibration (the same on resampled candidates, the recommendation) -> output (table,
tune.json) and plot (tune.png).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specrej_ray.quality.calibration import RESAMPLES, Setting, assess_all, decide, recommend
from specrej_ray.search.counterfactual import evaluate
from specrej_ray.spec import JobSpec
from specrej_ray.tune.collect import Collected
from specrej_ray.tune.options import (
    PROMPTS,
    TuneError,
    TuneOptions,
    decision_grid,
    out_dir,
    schedules,
)
from specrej_ray.tune.output import TuneReport, table, to_json

__all__ = ["TuneError", "TuneOptions", "run_tune"]

def run_tune(spec: JobSpec, opts: TuneOptions, job_path: str = "",
             overrides: list[str] | None = None) -> TuneReport:
    """Generate (or read --from), score, replay; print the table, write tune.json and .png."""
    from specrej_ray.tune.collect import correlations
    from specrej_ray.tune.plot import tune_png

    out = out_dir(opts.out, spec.output.path)
    if opts.from_json is not None:
        collected, grid = _saved(spec, opts, out)
        _make_dir(out)
    else:
        _make_dir(out)  # fail now, not after minutes of generation
        collected, grid = _generated(spec, opts)
    data = [c.data for c in collected]
    settings = [Setting(a, s) for a in opts.alphas for s in schedules(grid)]
    results = [evaluate(data, s.alpha, s.schedule) for s in settings]
    assessed = assess_all(data, settings)
    chosen = recommend(assessed, opts.target)
    report = TuneReport(
        settings=_settings(spec, opts, len(collected), grid, out, job_path, overrides or []),
        prompts=collected,
        baseline=evaluate(data, 0.0, ()),
        results=results,
        assessed=assessed,
        recommended=None if chosen is None else results[assessed.index(chosen)],
        auto=decide(assessed, opts.target),
        correlation=correlations(data, grid),
    )
    print(table(report))
    _write(out, report, tune_png(report))
    return report


def _saved(spec: JobSpec, opts: TuneOptions,
           out: Path) -> tuple[list[Collected], tuple[int, ...]]:
    """--from's candidates, and the decision lengths to replay."""
    from specrej_ray.tune.saved import load_saved

    assert opts.from_json is not None
    if Path(opts.from_json).resolve() == (out / "tune.json").resolve():
        raise TuneError(f"--out {out}: would replace --from {opts.from_json}, the only copy "
                        "of its candidates; pass another --out")
    collected, grid = load_saved(opts.from_json, spec, opts.prompts, opts.decisions)
    return collected, decision_grid(grid, spec.generator.sampling.max_new_tokens)


def _generated(spec: JobSpec, opts: TuneOptions) -> tuple[list[Collected], tuple[int, ...]]:
    """Each prompt's N candidates, generated, with partial rewards at the decision lengths."""
    from specrej_ray.job.local import load_local
    from specrej_ray.tune.collect import collect

    grid = decision_grid(opts.decisions, spec.generator.sampling.max_new_tokens)
    bon = spec.model_copy(deep=True)
    bon.search.mode = "bon"  # the same engine, alpha 0: every candidate runs to the end
    bon.search.bounds = False
    job = load_local(bon)
    if not job.tasks:
        raise TuneError(f"prompts: {spec.prompts.path} has no usable prompt "
                        "(run `specrej-ray validate` to see why)")
    return collect(job, grid, opts.prompts or PROMPTS,
                   lambda line: print(line, file=sys.stderr, flush=True)), grid


def _settings(spec: JobSpec, opts: TuneOptions, prompts: int, grid: tuple[int, ...],
              out: Path, job_path: str, overrides: list[str]) -> dict:
    return {
        "job": job_path, "overrides": overrides, "out": str(out),
        "prompts": prompts, "from": opts.from_json, "resamples": RESAMPLES,
        "alphas": list(opts.alphas), "decisions": list(grid),
        "schedules": [list(s) for s in schedules(grid)], "target": opts.target,
        "n": spec.search.n, "mode": spec.search.mode, "seed": spec.seed,
        "max_new_tokens": spec.generator.sampling.max_new_tokens,
        "generator": spec.generator.model, "reward": spec.reward_label,
    }


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TuneError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None


def _write(out: Path, report: TuneReport, png: bytes) -> None:
    try:
        (out / "tune.json").write_text(json.dumps(to_json(report), indent=1, allow_nan=False))
        (out / "tune.png").write_bytes(png)
    except OSError as e:
        raise TuneError(f"--out {out}: cannot write results ({e.strerror or e})") from None
    print(f"wrote {out / 'tune.json'} and {out / 'tune.png'}")
