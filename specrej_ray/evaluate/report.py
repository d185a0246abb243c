"""The evaluation's results: eval.json (every figure with its interval, per model and
decoding, and every response), eval.md (the tables) and eval.png (evaluate.plot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specrej_ray.evaluate.responses import DECODINGS, EvalError, ModelEval
from specrej_ray.quality.instruction_eval import (
    METRICS,
    Compared,
    by_instruction,
    compare,
    finite,
)
from specrej_ray.quality.stats import BOOTSTRAP, CONFIDENCE

FORMAT = "specrej-ray-evaluate"
BOOTSTRAP_SEED = 0
ACCURACIES = ("prompt_strict", "instruction_strict", "prompt_loose", "instruction_loose")
NOTES = {
    "figures": "each model's figure, with its percentile interval over prompts resampled",
    "against_reference": "the model's figure minus the reference's (the first model), with "
                         "a paired bootstrap interval: each draw resamples the prompts once, "
                         "for both models and every figure",
    "distinct_2": "distinct word bigrams over all word bigrams of the responses; words split "
                  "on whitespace, as written; no bigram spans two responses. Its own interval "
                  "lies below it: a draw repeats some responses, and their bigrams with them; "
                  "read its difference from the reference, where both sides repeat alike",
}


def comparisons(evals: list[ModelEval]) -> dict[str, list[Compared]]:
    """Per decoding, each model's figures and its difference from the first model's."""
    return {d: compare([e.responses[d] for e in evals], seed=BOOTSTRAP_SEED) for d in DECODINGS}


def intervals(found: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if found is None else {m: finite(i) for m, i in found.items()}


def model_entry(e: ModelEval, label: str, compared: dict[str, Compared]) -> dict[str, Any]:
    """One model's figures by decoding (compared: its own Compared per decoding)."""
    return {"label": label, "model": e.model, "path": e.path, "revision": e.revision,
            "sha256": e.sha256, "seconds": e.seconds,
            "decodings": {d: {"figures": intervals(c.figures),
                              "against_reference": intervals(c.against_reference)}
                          for d, c in compared.items()}}


def build(evals: list[ModelEval], labels: list[str], about: dict[str, Any]) -> dict[str, Any]:
    """eval.json: `about` (the command, the settings), then per model its identity, its
    figures by decoding, and its responses."""
    found = comparisons(evals)
    models = []
    for k, e in enumerate(evals):
        entry = model_entry(e, labels[k], {d: found[d][k] for d in DECODINGS})
        for d, got in entry["decodings"].items():
            got["by_instruction"] = by_instruction(e.responses[d], e.instructions)
        entry["responses"] = e.to_json()["responses"]
        models.append(entry)
    return {
        "format": FORMAT, **about,
        "prompts": len(evals[0].instructions),
        "instructions": sum(len(v) for v in evals[0].instructions.values()),
        "decodings": DECODINGS, "metrics": METRICS, "notes": NOTES,
        "bootstrap": {"resamples": BOOTSTRAP, "confidence": CONFIDENCE, "seed": BOOTSTRAP_SEED,
                      "over": "prompts", "interval": "percentile"},
        "reference": labels[0],
        "models": models,
        "prompt_instructions": evals[0].instructions,
    }


def _pct(x: float | None, sign: bool = False) -> str:
    return "-" if x is None else f"{100 * x:{'+' if sign else ''}.1f}"


def _cell(metric: str, i: dict[str, float | None], diff: bool = False) -> str:
    if metric in ACCURACIES:
        fmt = lambda x: _pct(x, diff)  # noqa: E731 (one line)
    else:
        digits = 1 if metric == "mean_tokens" else 3
        fmt = lambda x: "-" if x is None else f"{x:{'+' if diff else ''}.{digits}f}"  # noqa: E731
    return f"{fmt(i['value'])} [{fmt(i['low'])}, {fmt(i['high'])}]"


HEADS = {"prompt_strict": "prompt strict %", "instruction_strict": "instr. strict %",
         "prompt_loose": "prompt loose %", "instruction_loose": "instr. loose %",
         "mean_tokens": "tokens", "distinct_2": "distinct-2"}


def table(report: dict[str, Any], key: str) -> list[str]:
    """One markdown table: every model and decoding, `key` figures or against_reference."""
    lines = ["| model | decoding | " + " | ".join(HEADS[m] for m in METRICS) + " |",
             "| --- | --- |" + " ---: |" * len(METRICS)]
    for m in report["models"]:
        for d, got in m["decodings"].items():
            if got[key] is not None:
                cells = " | ".join(_cell(x, got[key][x], key != "figures") for x in METRICS)
                lines.append(f"| {m['label']} | {d} | {cells} |")
    return lines


def by_instruction_table(report: dict[str, Any]) -> list[str]:
    """Per instruction id, strict follows over occurrences for every model and decoding: which
    instructions a round learned, and which none follows."""
    columns = [(m["label"], d, got["by_instruction"]) for m in report["models"]
               for d, got in m["decodings"].items()]
    ids = sorted({i for *_, counts in columns for i in counts})
    lines = ["| instruction | " + " | ".join(f"{label}, {d}" for label, d, _ in columns) + " |",
             "| --- |" + " ---: |" * len(columns)]
    for i in ids:
        cells = [f"{c[i]['strict']}/{c[i]['of']}" if i in c else "-" for *_, c in columns]
        lines.append(f"| `{i}` | " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    conf = f"{report['bootstrap']['confidence']:.0%}"
    lines = [f"# Instruction following: {report['prompts']} prompts, "
             f"{report['instructions']} instructions", ""]
    if report.get("command"):
        lines += [f"`{report['command']}`", ""]
    lines += [f"Each cell: the figure [{conf} interval, {report['bootstrap']['resamples']} "
              "resamples of the prompts]. Accuracies are IFEval's, in %: prompt-level, "
              "the prompts whose every instruction is followed; instruction-level, the "
              "instructions followed over all of them. Greedy: temperature 0; sampled: one "
              "response with the job's sampling and seed. tokens: mean response length in "
              f"generator tokens; distinct-2: {NOTES['distinct_2']}.", "",
              *table(report, "figures")]
    if len(report["models"]) > 1:
        lines += ["", f"## Against {report['reference']} (paired bootstrap over prompts)", "",
                  "Each cell: this model's figure minus the reference's (accuracies in "
                  f"points) [{conf} interval; each draw resamples the prompts once for both].",
                  "", *table(report, "against_reference")]
    lines += ["", "## By instruction (strict)", "",
              "Each cell: the responses that follow the instruction strictly, of the prompts "
              "that carry it.", "", *by_instruction_table(report)]
    lines += ["", "| model | path | weights |", "| --- | --- | --- |"]
    lines += [f"| {m['label']} | `{m['path']}` | "
              f"{(m['sha256'] or m['revision'] or '-')[:16]} |" for m in report["models"]]
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict[str, Any], png: bytes) -> list[Path]:
    paths = [out / "eval.json", out / "eval.md", out / "eval.png"]
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths[0].write_text(json.dumps(report, indent=1, allow_nan=False))
        paths[1].write_text(markdown(report))
        paths[2].write_bytes(png)
    except OSError as e:
        raise EvalError(f"--out {out}: cannot write results ({e.strerror or e})") from None
    return paths
