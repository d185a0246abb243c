"""The bench's figures as one dict, written as bench.json, bench.md and bench.png."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from specrej_ray.benchmark.arms import SBON, SBON_NOREFILL, ArmRun
from specrej_ray.benchmark.markdown import render
from specrej_ray.benchmark.matched import BonPoint, matched_speedup
from specrej_ray.benchmark.plot import reward_vs_time
from specrej_ray.benchmark.roofline import Roofline
from specrej_ray.benchmark.scores import best_reward, paired_normalized_scores, summary
from specrej_ray.benchmark.targets import evaluate_targets
from specrej_ray.benchmark.throughput import Throughput
from specrej_ray.search.metrics import mean_or_nan, speedup, token_rate
from specrej_ray.spec import JobSpec

REWARD_NOTE = (
    "Arms are compared on the raw score of the first reward, `{name}`: with one reward that is "
    "the final score; with several, the combined final score is a per-prompt z-score or rank "
    "and is not comparable across arms."
)


def arm_figures(run: ArmRun, reward: str) -> dict:
    best = {r.prompt_id: best_reward(r, reward) for r in run.results}
    st = run.stats
    return {
        "name": run.arm.name,
        "kind": "bon" if run.arm.is_bon else "sbon",
        "n": run.arm.n,
        "alpha": run.arm.alpha,
        "refill": run.arm.refill,
        "seconds": run.seconds,
        "score_seconds": run.score_seconds,
        "tokens": run.tokens,
        "tokens_per_s": run.tokens / run.seconds,
        "mean_best_reward": mean_or_nan(v for v in best.values() if v is not None),
        "best_reward": best,
        "occupancy": st.occupancy,
        "occupancy_note": None if st.decode_steps else "no decode steps: occupancy undefined",
        "mean_rows": st.mean_rows,
        "decode_steps": st.decode_steps,
        "padding": st.padding,
        "budget_tokens": st.budget_tokens,
        "oom_backoffs": st.oom_backoffs,
    }


def paired_figures(sbon: ArmRun, bon: ArmRun, reward: str) -> dict:
    """SBoN against Best-of-N at the same N: eq. 5 per prompt, token rate and speedup."""
    per_prompt = paired_normalized_scores(sbon.results, bon.results, reward)
    return {
        "vs": bon.arm.name,
        "normalized_score": {**summary(list(per_prompt.values())), "per_prompt": per_prompt},
        "token_rate": token_rate(sbon.tokens, bon.tokens),
        "speedup": speedup(bon.seconds, sbon.seconds),
    }


def build(spec: JobSpec, command: str, machine: dict, runs: Sequence[ArmRun], reward: str,
          batch: int, throughput: Throughput | None, roofline: Roofline | None) -> dict:
    """Every figure; `runs` holds the arms of arms.plan_arms (SBoN, SBoN without refill, BoN)."""
    bon_same_n = next(r for r in runs if r.arm.is_bon and r.arm.n == spec.search.n)
    arms = []
    for run in runs:
        fig = arm_figures(run, reward)
        if not run.arm.is_bon:
            fig.update(paired_figures(run, bon_same_n, reward))
        arms.append(fig)
    by_name = {a["name"]: a for a in arms}
    sbon, norefill = by_name[SBON], by_name[SBON_NOREFILL]
    matched = matched_speedup(
        [BonPoint(a["n"], a["mean_best_reward"], a["seconds"]) for a in arms if a["kind"] == "bon"],
        sbon["mean_best_reward"], sbon["seconds"])
    targets = evaluate_targets(spec.search.n, sbon["normalized_score"]["mean"], sbon["speedup"],
                               matched, throughput.ratio if throughput else None, batch,
                               sbon["occupancy"], norefill["occupancy"])
    g = spec.generator
    return {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "spec": {
            "name": spec.name, "fingerprint": spec.fingerprint(), "seed": spec.seed,
            "generator": g.model, "reward": spec.reward_label, "n": spec.search.n,
            "alpha": spec.search.alpha, "schedule": spec.search.decision_tokens or "memory",
            "sampling": g.sampling.model_dump(mode="json"),
        },
        "prompts": len(runs[0].results),
        "prompt_ids": [r.prompt_id for r in runs[0].results],
        "reward_compared": reward,
        "reward_note": REWARD_NOTE.format(name=reward),
        "machine": machine,
        "arms": arms,
        "matched": dataclasses.asdict(matched),
        "throughput": _throughput(throughput),
        "roofline": _roofline(roofline, throughput),
        "targets": [dataclasses.asdict(t) for t in targets],
    }


def write(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = _no_nan(report)
    paths = [out_dir / "bench.json", out_dir / "bench.md", out_dir / "bench.png"]
    paths[0].write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    paths[1].write_text(render(clean))
    paths[2].write_bytes(reward_vs_time(clean["arms"], clean["reward_compared"]))
    return paths


def _throughput(t: Throughput | None) -> dict | None:
    if t is None:
        return None
    side = {name: {**dataclasses.asdict(s), "tokens_per_s": s.tokens_per_s}
            for name, s in (("engine", t.engine), ("generate", t.generate))}
    return {"batch": t.batch, "prompt_tokens": t.prompt_tokens, "new_tokens": t.new_tokens,
            **side, "ratio": t.ratio, "engine_waves": t.engine_waves,
            "engine_mean_rows": t.engine_mean_rows}


def _roofline(r: Roofline | None, t: Throughput | None) -> dict | None:
    if r is None:
        return None
    lines = list(r.lines)
    fractions = {}
    if t is not None:
        for name, side in (("engine", t.engine), ("model.generate", t.generate)):
            fractions[name] = side.tokens_per_s / r.tokens_per_s
            lines.append(f"{name}: {side.tokens_per_s:,.1f} tokens/s = "
                         f"{fractions[name]:.1%} of the bound")
    return {**dataclasses.asdict(r), "lines": lines, "fraction_of_bound": fractions}


def _no_nan(value):
    """NaN (no data) as null: strict JSON, and markdown shows n/a."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value
