"""`specrej-ray evaluate JOB.yaml --model M [--model M ...]`: how well models follow
verifiable instructions (IFEval's accuracies), each against the first model.

Pipeline: the options and every model source checked, the prompts read (all before any
model loads) -> responses (each model answers every prompt greedy and once sampled, judged
on its instructions) -> quality.instruction_eval (the figures, the paired bootstrap) ->
report (eval.json, eval.md) and plot (eval.png). `iterate` evaluates its policies with the
same pieces (iterate/evaluation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrej_ray.data.output_place import side_folder
from specrej_ray.evaluate.responses import (
    EvalError,
    check_model,
    eval_spec,
    evaluate_model,
    read_prompts,
    say,
)
from specrej_ray.spec import JobSpec

__all__ = ["EvalError", "EvalOptions", "run_evaluate", "settings"]


@dataclass(frozen=True)
class EvalOptions:
    models: tuple[str, ...] = ()  # none: the spec's generator.model
    prompts: str | None = None  # None: the spec's prompts
    limit: int | None = None
    out: str | None = None  # None: OUTPUT.PATH/eval
    command: str = ""


def run_evaluate(spec: JobSpec, opts: EvalOptions) -> list[Path]:
    """Evaluate every model; print the table and write eval.json, eval.md and eval.png."""
    from specrej_ray.evaluate.plot import accuracy_png
    from specrej_ray.evaluate.report import build, table, write
    from specrej_ray.job.runtime import set_torch_threads

    if opts.limit is not None and opts.limit < 1:
        raise EvalError(f"--limit: must be at least 1, got {opts.limit}")
    out = out_dir(opts.out, spec.output.path)
    models = opts.models or (spec.generator.model,)
    especs = [eval_spec(spec, m, opts.prompts, opts.limit) for m in models]
    for m in models:
        check_model(m)
    prompts = read_prompts(especs[0], "--prompts" if opts.prompts else "prompts.path")
    _make_dir(out)  # fail now, not after minutes of generation
    say(f"{len(prompts)} prompts from {especs[0].prompts.path}, {len(models)} model(s), "
        "greedy and sampled")
    set_torch_threads(spec.generator.threads)  # as the generator actor does
    evals = [evaluate_model(e) for e in especs]
    labels = labels_of(models)
    report = build(evals, labels, {"command": opts.command, "settings": settings(especs[0])})
    print("\n".join(table(report, "figures")))
    paths = write(out, report, accuracy_png(report))
    for p in paths:
        print(f"wrote {p}")
    return paths


def settings(espec: JobSpec) -> dict[str, Any]:
    """What the figures were made with, for eval.json."""
    g, p = espec.generator, espec.prompts
    return {"prompts": {"path": p.path, "offset": p.offset, "limit": p.limit},
            "sampling": g.sampling.model_dump(mode="json"), "seed": espec.seed,
            "engine": g.engine, "reward": espec.reward[0].model_dump(
                mode="json", include={"type", "instructions_field", "kwargs_field"})}


def labels_of(models: tuple[str, ...] | list[str]) -> list[str]:
    """Short, distinct labels: the source as given, its tail if long."""
    out: list[str] = []
    for m in models:
        label = m if len(m) <= 28 else "..." + m[-25:]
        while label in out:
            label += "'"
        out.append(label)
    return out


def out_dir(out: str | None, output_path: str) -> Path:
    """--out, else <output.path>/eval."""
    return side_folder(out, output_path, "eval", "evaluate", EvalError)


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EvalError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None
