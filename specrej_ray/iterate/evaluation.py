"""iterate.evaluate: every policy of the loop evaluated as `specrej-ray evaluate` does.

The base policy is evaluated before round 0, each round's trained model once it is
published. Each evaluation is kept in OUT/eval/policies/ under its policy's weight hash and
the evaluation's key (its job settings and prompts' content), so a resumed loop, or one run
again with more rounds, never evaluates a policy twice. iterate.json gets per policy its
figures and their difference from the base's (paired bootstrap); OUT/eval/ the eval.json,
eval.md and eval.png of every policy so far.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specrej_ray.data.dataset import locate, write_atomic
from specrej_ray.evaluate import settings
from specrej_ray.evaluate.report import build, comparisons, intervals
from specrej_ray.evaluate.report import write as write_report
from specrej_ray.evaluate.responses import (
    ModelEval,
    eval_spec,
    evaluate_model,
    prompts_key,
    read_prompts,
)
from specrej_ray.spec import JobSpec

FIELD = "iterate.evaluate.prompts"
EVAL_DIR = "eval"


def policy_label(r: int, last: bool) -> str:
    """The policy that generates round r (the final model: the one the last round trained)."""
    return "round 0 (base)" if r == 0 else f"round {r}" + (" (final)" if last else "")


class Evaluations:
    """The loop's evaluations, kept in `record["evaluations"]` (iterate.json)."""

    def __init__(self, spec: JobSpec, root: Path, record: dict[str, Any], echo) -> None:
        assert spec.iterate is not None and spec.iterate.evaluate is not None
        ev = spec.iterate.evaluate
        self.spec, self.root, self.record, self.echo = spec, root, record, echo
        self.base_spec = eval_spec(spec, None, ev.prompts, ev.limit)
        self.prompts = len(read_prompts(self.base_spec, FIELD))  # a bad file fails now
        self.key = prompts_key(self.base_spec, FIELD)
        self.done: dict[int, ModelEval] = {}
        record.setdefault("evaluations", [])

    @property
    def dir(self) -> Path:
        return self.root / EVAL_DIR

    def policy(self, r: int, path: str, sha256: str) -> None:
        """Evaluate round r's policy (r 0: generator.model), or read its kept evaluation."""
        kept = self.dir / "policies" / f"{sha256[:16]}-{self.key}.json"
        label = policy_label(r, r == self.spec.iterate.rounds)  # type: ignore[union-attr]
        if kept.exists():
            self.echo(f"[specrej] {label}: evaluation already recorded ({kept})")
            found = ModelEval.from_json(json.loads(kept.read_text()))
        else:
            self.echo(f"[specrej] {label}: evaluating on {self.prompts} prompts "
                      f"({self.spec.iterate.evaluate.prompts})")  # type: ignore[union-attr]
            espec = self.base_spec if r == 0 else eval_spec(
                self.spec, path, self.spec.iterate.evaluate.prompts,  # type: ignore[union-attr]
                self.spec.iterate.evaluate.limit)  # type: ignore[union-attr]
            found = evaluate_model(espec, lambda line: self.echo(f"[specrej] {label}: {line}"))
            _write(kept, found.to_json())
        self.done[r] = found
        self._record(r, label, path, sha256, kept)
        self._report()

    def _record(self, r: int, label: str, path: str, sha256: str, kept: Path) -> None:
        base = self.done[0]
        found = comparisons([base, self.done[r]] if r else [base])
        mine = {d: c[-1] for d, c in found.items()}
        entry = {"round": r, "label": label,
                 "policy": {"path": path, "sha256": sha256,
                            "trained_in_round": None if r == 0 else r - 1},
                 "key": self.key, "file": str(kept.relative_to(self.root)),
                 "prompts": len(base.instructions), "seconds": self.done[r].seconds,
                 "figures": {d: intervals(c.figures) for d, c in mine.items()},
                 "against_base": None if r == 0 else
                 {d: intervals(c.against_reference) for d, c in mine.items()}}
        rest = [x for x in self.record["evaluations"] if x["round"] != r]
        self.record["evaluations"] = sorted(rest + [entry], key=lambda x: x["round"])

    def _report(self) -> None:
        """OUT/eval/: every policy evaluated so far, in round order."""
        from specrej_ray.evaluate.plot import accuracy_png  # matplotlib: only when evaluating

        rounds = sorted(self.done)
        labels = [x["label"] for x in self.record["evaluations"] if x["round"] in self.done]
        report = build([self.done[r] for r in rounds], labels,
                       {"command": self.record.get("command"),
                        "settings": settings(self.base_spec), "iterate": str(self.root)})
        write_report(self.dir, report,
                     accuracy_png(report, "policy (the round it generates)"))


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(locate(str(path.parent)), path.name, json.dumps(data).encode())


def summary_lines(record: dict[str, Any]) -> list[str]:
    """One line per evaluated policy: strict accuracy (instruction-, prompt-level), greedy
    and sampled, the instruction-level rise over the base with its interval, length and
    distinct-2."""
    found = record.get("evaluations") or []
    if not found:
        return []
    lines = ["", f"evaluation on {found[0]['prompts']} held-out prompts ({EVAL_DIR}/eval.md): "
             "IFEval strict accuracy in %, instruction-level (instr) and prompt-level; "
             "vs base: instr in points [95% paired bootstrap]",
             f"{'policy':<18} {'weights':>7} {'greedy: instr':>13} {'prompt':>6}  {'vs base':<20} "
             f"{'sampled: instr':>14} {'prompt':>6}  {'vs base':<20} {'tokens g/s':>11} "
             f"{'distinct-2 g/s':>14}"]
    for x in found:
        cells = []
        for d in ("greedy", "sampled"):
            f, a = x["figures"][d], (x["against_base"] or {}).get(d)
            rise = "-" if a is None else _points(a["instruction_strict"])
            width = 13 if d == "greedy" else 14
            cells.append(f"{100 * f['instruction_strict']['value']:>{width}.1f} "
                         f"{100 * f['prompt_strict']['value']:>6.1f}  {rise:<20}")
        g, s = x["figures"]["greedy"], x["figures"]["sampled"]
        lines.append(f"{x['label']:<18} {x['policy']['sha256'][:7]:>7} {cells[0]} {cells[1]} "
                     f"{g['mean_tokens']['value']:>5.0f}/{s['mean_tokens']['value']:<5.0f} "
                     f"{g['distinct_2']['value']:>7.3f}/{s['distinct_2']['value']:.3f}")
    return lines


def _points(i: dict[str, float | None]) -> str:
    def p(v: float | None) -> str:
        return "?" if v is None else f"{100 * v:+.1f}"

    return f"{p(i['value'])} [{p(i['low'])}, {p(i['high'])}]"
