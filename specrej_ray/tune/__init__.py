"""`specrej-ray tune JOB.yaml`: the paper's counterfactual analysis (section 6.2).

Pipeline: options (checked before loading anything) -> collect (N full candidates per prompt
with Best-of-N, partial rewards at a grid of decision lengths) -> search.counterfactual
(replay SBoN for every alpha x schedule) -> output (table, tune.json) and plot (tune.png).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specrej_ray.search.counterfactual import evaluate, recommend
from specrej_ray.spec import JobSpec
from specrej_ray.tune.options import TuneError, TuneOptions, decision_grid, out_dir, schedules
from specrej_ray.tune.output import TuneReport, table, to_json

__all__ = ["TuneError", "TuneOptions", "run_tune"]


def run_tune(spec: JobSpec, opts: TuneOptions, job_path: str = "",
             overrides: list[str] | None = None) -> TuneReport:
    """Generate, score, replay; print the table and write tune.json and tune.png."""
    from specrej_ray.job.local import load_local
    from specrej_ray.tune.collect import collect, correlations
    from specrej_ray.tune.plot import tune_png

    grid = decision_grid(opts.decisions, spec.generator.sampling.max_new_tokens)
    out = out_dir(opts.out, spec.output.path)
    _make_dir(out)  # fail now, not after minutes of generation
    bon = spec.model_copy(deep=True)
    bon.search.mode = "bon"  # the same engine, alpha 0: every candidate runs to the end
    bon.search.bounds = False
    job = load_local(bon)
    if not job.tasks:
        raise TuneError(f"prompts: {spec.prompts.path} has no usable prompt "
                        "(run `specrej-ray validate` to see why)")
    collected = collect(job, grid, opts.prompts,
                        lambda line: print(line, file=sys.stderr, flush=True))
    data = [c.data for c in collected]
    results = [evaluate(data, a, s) for a in opts.alphas for s in schedules(grid)]
    report = TuneReport(
        settings=_settings(spec, opts, grid, out, job_path, overrides or []),
        prompts=collected,
        baseline=evaluate(data, 0.0, ()),
        results=results,
        recommended=recommend(results, opts.target),
        correlation=correlations(data, grid),
    )
    print(table(report))
    _write(out, report, tune_png(report))
    return report


def _settings(spec: JobSpec, opts: TuneOptions, grid: tuple[int, ...], out: Path,
              job_path: str, overrides: list[str]) -> dict:
    return {
        "job": job_path, "overrides": overrides, "out": str(out),
        "prompts": opts.prompts, "alphas": list(opts.alphas), "decisions": list(grid),
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
