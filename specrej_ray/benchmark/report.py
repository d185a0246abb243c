"""The bench's figures as one dict (bench.json), and the issue's targets against them.

Every arm is measured against the reference, Best-of-N at the spec's N: its normalized score
(paper eq. 6, per prompt, with a bootstrap CI over prompts), its token rate (decode work,
discarded and replayed tokens counted) and its speedups (ratio of totals and the paper's
per-prompt mean), so every speed figure stands next to the quality it was bought at.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from specrej_ray.benchmark.arms import BOUNDS, SBON, SBON_BOUNDS, SBON_NOREFILL, ArmRun
from specrej_ray.benchmark.auto import AUTO, AutoRun
from specrej_ray.benchmark.engine_arms import PREFIX
from specrej_ray.benchmark.hardware import Roofline, Throughput
from specrej_ray.benchmark.quality import (
    best_reward,
    cost,
    matched,
    normalized_scores,
    speedups,
    summary,
    token_rates,
)
from specrej_ray.benchmark.render import render, reward_vs_time
from specrej_ray.benchmark.vllm_users import USERS
from specrej_ray.quality.identity import identity
from specrej_ray.search.metrics import mean_or_nan, token_rate
from specrej_ray.spec import JobSpec

REWARD_NOTE = (
    "Arms are compared on the raw score of the first reward, `{name}`: with one reward that is "
    "the final score; with several, the combined final score is a per-prompt z-score or rank "
    "and is not comparable across arms."
)
SCORE_NOTE = (
    "Normalized score: paper eq. 6, per prompt, 100 x (1 - (max_ref - best) / (max_ref - "
    "min_ref)) over the reference's finished candidates; eq. 6 compares arms on the same "
    "candidates, which candidate identity makes every arm's (eq. 5 would draw Best-of-N "
    "anew). Mean over prompts with a {confidence} bootstrap interval over prompts."
)


def arm_figures(run: ArmRun, reward: str) -> dict:
    best = {r.prompt_id: best_reward(r, reward) for r in run.results}
    st = run.stats
    bounds_s = sum(r.bounds_seconds for r in run.results)
    return {
        "name": run.arm.name,
        "kind": "bon" if run.arm.is_bon else "sbon",
        "n": run.arm.n,
        "alpha": run.arm.alpha,
        "refill": run.arm.refill,
        "bounds_every": run.arm.bounds_every,
        "pruned": sum(r.pruned for r in run.results),
        "rejected": sum(r.rejected for r in run.results),
        # What asking for bounds cost: the reward's bounds and the pruning rule.
        "bounds_checks": sum(r.bounds_checks for r in run.results),
        "bounds_seconds": bounds_s,
        "bounds_share": bounds_s / run.seconds if run.seconds else math.nan,
        "seconds": run.seconds,
        "score_seconds": run.score_seconds,
        "tokens": run.tokens,
        "discarded_tokens": st.discarded_tokens,
        "replayed_tokens": st.replayed_tokens,
        "decoded_tokens": run.decoded,
        "tokens_per_s": run.decoded / run.seconds,
        "mean_best_reward": mean_or_nan(v for v in best.values() if v is not None),
        "best_reward": best,
        "cost_seconds": {r.prompt_id: cost(r) for r in run.results},
        "occupancy": st.occupancy,
        "allocated": st.allocated,
        "slack": st.slack,
        "mean_rows": st.mean_rows,
        "decode_steps": st.decode_steps,
        "budget_tokens": st.budget_tokens,
        "peak_kv_bytes": st.peak_kv_bytes,
        "stalls": st.stalls,
        "evictions": st.evictions,
        "oom_backoffs": st.oom_backoffs,
        "rewards": run.rewards,
        # Reward-model tokens per decoded token: processed, and what full re-scoring of the
        # same requests would have processed (model rewards only; callables count nothing).
        "reward_tokens_per_token": sum(r["tokens"] for r in run.rewards) / max(run.decoded, 1),
        "reward_full_per_token": sum(r["full_tokens"] for r in run.rewards)
        / max(run.decoded, 1),
    }


def paired_figures(run: ArmRun, ref: ArmRun, reward: str) -> dict:
    """Against the reference: eq. 6 per prompt, token rate, speedups."""
    per_prompt = normalized_scores(run.results, ref.results, reward)
    s = speedups(run.results, ref.results)
    return {
        "normalized_score": {**summary(list(per_prompt.values())), "per_prompt": per_prompt},
        "token_rate": token_rate(run.decoded, ref.decoded),
        "token_rate_ci": token_rates(run.results, ref.results).as_dict(),
        "speedup": ref.seconds / run.seconds,
        "speedup_totals": s.totals.as_dict(),
        "speedup_per_prompt": s.per_prompt.as_dict(),
    }


def build(spec: JobSpec, command: str, machine: dict, runs: Sequence[ArmRun], reward: str,
          throughput: Sequence[Throughput], roofline: Sequence[Roofline],
          kv_bytes_per_token: int, auto: AutoRun | None = None,
          engine_runs: Sequence[ArmRun] = ()) -> dict:
    """Every figure; `runs` holds the arms of arms.plan_arms (SBoN, SBoN without refill, BoN),
    `auto` the auto arm (schedule: auto), whose choice the SBoN arms ran."""
    ref = next(r for r in runs if r.arm.is_bon and r.arm.n == spec.search.n)
    everything = [auto.run, *runs] if auto is not None else list(runs)
    arms = [{**arm_figures(r, reward), **paired_figures(r, ref, reward)} for r in everything]
    by_name = {r.arm.name: r for r in runs}
    ours = [r for r in runs if not r.arm.is_bon]
    sbon = by_name[SBON]
    checks: dict = {r.arm.name: dataclasses.asdict(identity(r.results, ref.results))
                    for r in ours}
    if SBON_NOREFILL in by_name:
        checks["refill_changes_nothing"] = _same_answers(sbon, by_name[SBON_NOREFILL])
    if BOUNDS in by_name:
        checks["bounds_answers_are_best_of_n"] = _same_best(by_name[BOUNDS], ref)
    bon = {r.arm.n: r.results for r in runs if r.arm.is_bon}
    match = matched(bon, sbon.results, reward)
    figures = {a["name"]: a for a in arms}
    g = spec.generator
    report = {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "spec": {
            "name": spec.name, "fingerprint": spec.fingerprint(), "seed": spec.seed,
            "generator": g.model, "reward": spec.reward_label, "n": spec.search.n,
            "alpha": spec.search.alpha, "schedule": spec.search.decision_tokens or "memory",
            "sampling": g.sampling.model_dump(mode="json"),
        },
        "prompts": len(ref.results),
        "prompt_ids": [r.prompt_id for r in ref.results],
        "reference": ref.arm.name,
        "reward_compared": reward,
        "reward_note": REWARD_NOTE.format(name=reward),
        "score_note": SCORE_NOTE.format(confidence="95%"),
        "kv_bytes_per_token": kv_bytes_per_token,
        "machine": machine,
        "arms": arms,
        "identity": checks,
        "matched": _matched(match),
        "matched_arms": {r.arm.name: _matched(matched(bon, r.results, reward,
                                                      _label(r.arm.name)))
                         for r in ours},
        "throughput": [_throughput(t) for t in throughput],
        "roofline": [_roofline(r, next((t for t in throughput if t.batch == r.batch), None))
                     for r in roofline],
    }
    if auto is not None:
        bon = {r.arm.n: r.results for r in runs if r.arm.is_bon}
        report["auto"] = {
            "choice": auto.choice, "calibration_seconds": auto.calibration_seconds,
            "calibration_prompts": auto.calibration_ids, "held_out": auto.held_out,
            "matched": _matched(matched(bon, auto.run.results, reward)),
        }
        report["spec"]["schedule"] = "auto"
    if engine_runs:
        report["engines"] = engines_section(spec.search.n, runs, engine_runs, reward)
    report["targets"] = [dataclasses.asdict(t) for t in targets(report, figures)]
    return report


def engines_section(n: int, hf_runs: Sequence[ArmRun], vllm_runs: Sequence[ArmRun],
                    reward: str) -> dict:
    """hf's SBoN and Best-of-N beside the vLLM arms, each against its own engine's
    Best-of-N at N (the users' arm: an independent sample of the same N)."""
    by_name = {r.arm.name: r for r in [*hf_runs, *vllm_runs]}
    hf_ref, v_ref = by_name[f"bon-{n}"], by_name[f"{PREFIX}bon-{n}"]
    rows = []
    for engine, ref, runs in (("hf", hf_ref, [by_name[SBON], hf_ref]), ("vllm", v_ref, vllm_runs)):
        for r in runs:
            rows.append({"engine": engine, **arm_figures(r, reward),
                         **paired_figures(r, ref, reward), "vllm": r.vllm,
                         "reference": ref.arm.name})
    v_sbon = by_name[f"{PREFIX}{SBON}"]
    same = sum(a.tokens == b.tokens for x, y in zip(v_ref.results, hf_ref.results, strict=True)
               for a, b in zip(x.candidates, y.candidates, strict=True))
    total = sum(len(x.candidates) for x in hf_ref.results)
    return {
        "arms": rows,
        "matched": {
            "hf": _matched(matched({r.arm.n: r.results for r in hf_runs if r.arm.is_bon},
                                   by_name[SBON].results, reward)),
            "vllm": _matched(matched({r.arm.n: r.results for r in vllm_runs
                                      if r.arm.is_bon and r.arm.name.startswith(PREFIX)},
                                     v_sbon.results, reward)),
        },
        "identity": {"vllm_sbon_vs_vllm_bon": dataclasses.asdict(
                         identity(v_sbon.results, v_ref.results)),
                     "bon_candidates_equal_across_engines": f"{same}/{total}"},
    }


def write(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = _no_nan(report)
    paths = [out_dir / "bench.json", out_dir / "bench.md", out_dir / "bench.png"]
    paths[0].write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    paths[1].write_text(render(clean))
    paths[2].write_bytes(reward_vs_time(clean["arms"], clean["reward_compared"]))
    return paths


# -- targets (reported, never asserted) ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    goal: str
    measured: str
    status: str  # "met", "not met" or "n/a (why)"


def targets(report: dict, arms: dict[str, dict]) -> list[Target]:
    sbon, ref = arms[SBON], arms[report["reference"]]
    limit = report["kv_bytes_per_token"]
    held = {a["name"]: a["peak_kv_bytes"] / (a["budget_tokens"] * limit) for a in report["arms"]}
    over = [name for name, share in held.items() if share > 1]
    out = [
        Target("KV bytes held never exceed the budget (every arm)", "always",
               f"peak {max(held.values()):.1%} of the budget"
               + (f"; over in {', '.join(over)}" if over else ""),
               "not met" if over else "met"),
        Target("SBoN occupancy with refill", ">= 80%", f"{sbon['occupancy']:.1%}",
               _status(sbon["occupancy"], 0.8)),
        Target(f"{ref['name']} occupancy within 10 points of SBoN's", ">= SBoN - 10 points",
               f"{ref['occupancy']:.1%} vs {sbon['occupancy']:.1%}",
               _status(ref["occupancy"] - sbon["occupancy"], -0.10)),
    ]
    for t in report["throughput"]:
        out.append(Target(f"engine tokens/s / model.generate at batch {t['batch']}", ">= 1.5x",
                          f"{t['ratio']:.2f}x", _status(t["ratio"], 1.5)))
    for r in report["roofline"][-1:]:
        share = (r["fraction_of_bound"] or {}).get("engine")
        out.append(Target(f"engine at batch {r['batch']} / this machine's roofline", ">= 35%",
                          "n/a" if share is None else f"{share:.1%}",
                          "n/a (no throughput)" if share is None else _status(share, 0.35)))
    n = report["spec"]["n"]
    at_64 = None if n == 64 else f"n/a (this run's N is {n})"
    score = sbon["normalized_score"]
    m = report["matched"]
    out += [
        Target("SBoN normalized score (eq. 6) vs Best-of-64 (issue 3)", ">= 99",
               f"{score['mean']:.1f} (95% CI {score['low']:.1f}-{score['high']:.1f})",
               at_64 or _status(score["mean"], 99)),
        Target("wall-clock speedup vs Best-of-64 (issue 3)", ">= 3x",
               f"{sbon['speedup']:.2f}x at normalized score {score['mean']:.1f}",
               at_64 or _status(sbon["speedup"], 3)),
        Target("speedup at matched reward (issue 3)", ">= 8x",
               m["summary"], _status(m["speedup"] if m["speedup"] is not None else math.nan, 8)),
    ]
    return out + bounds_targets(report, arms) + auto_targets(report, arms) \
        + engine_targets(report)


def bounds_targets(report: dict, arms: dict[str, dict]) -> list[Target]:
    """Issue 43's targets, where the reward gives bounds: SBoN's score and speed against
    Best-of-64, at matched reward, and bounds alone exact for less."""
    if BOUNDS not in arms:
        return []
    n = report["spec"]["n"]
    at_64 = None if n == 64 else f"n/a (this run's N is {n})"
    out = []
    for name in (SBON, SBON_BOUNDS):
        a, m = arms[name], report["matched_arms"][name]
        score = a["normalized_score"]
        out += [
            Target(f"{name}: normalized score >= 99 and >= 3x faster than Best-of-64",
                   ">= 99 and >= 3x",
                   f"{score['mean']:.1f} (95% CI {score['low']:.1f}-{score['high']:.1f}) at "
                   f"{a['speedup']:.2f}x (95% CI {a['speedup_totals']['low']:.2f}-"
                   f"{a['speedup_totals']['high']:.2f})",
                   at_64 or ("met" if score["mean"] >= 99 and a["speedup"] >= 3 else "not met")),
            Target(f"{name}: speedup at matched reward", ">= 2x, 95% low >= 1.5x", m["summary"],
                   "n/a (no value)" if m["speedup"] is None else
                   ("met" if m["speedup"] >= 2 and (m["low"] or 0) >= 1.5 else "not met")),
        ]
    b = arms[BOUNDS]
    per = list(b["normalized_score"]["per_prompt"].values())
    exact = report["identity"]["bounds_answers_are_best_of_n"]
    out += [
        Target("bounds alone: normalized score exactly 100 on every prompt (Best-of-N's answer)",
               "every prompt 100, same answers",
               f"{sum(v == 100 for v in per)}/{len(per)} prompts at 100; answers "
               f"{'identical' if exact else 'different'}",
               "met" if per and all(v == 100 for v in per) and exact else "not met"),
        Target("bounds alone: token rate", "<= 0.8",
               f"{b['token_rate']:.3f} (95% CI {b['token_rate_ci']['low']:.3f}-"
               f"{b['token_rate_ci']['high']:.3f}); bounds took {b['bounds_share']:.1%} of "
               "the arm's time",
               "met" if b["token_rate"] <= 0.8 else "not met"),
    ]
    return out


def engine_targets(report: dict) -> list[Target]:
    """Issue 20's targets for the vLLM arms (`--engines hf,vllm`): SBoN on vLLM against
    Best-of-N as vLLM users run it and against SBoN on the hf engine, vLLM's KV usage, and
    what survivors re-prefill."""
    e = report.get("engines")
    if not e:
        return []
    by = {(a["engine"], a["name"]): a for a in e["arms"]}
    n = report["spec"]["n"]
    v_sbon, hf_sbon = by[("vllm", f"{PREFIX}{SBON}")], by[("hf", SBON)]
    users = by[("vllm", f"{USERS}{n}")]
    v = v_sbon["vllm"]
    score = v_sbon["normalized_score"]
    kept = (f" at normalized score {score['mean']:.1f} ({score['low']:.1f}-{score['high']:.1f}) "
            f"vs vLLM Best-of-{n}")
    tokens = report["spec"]["sampling"]["max_new_tokens"]
    at_512 = None if tokens == 512 else f"n/a (the goal is at 512 tokens; this run's {tokens})"
    vs_users = users["seconds"] / v_sbon["seconds"]
    vs_hf = hf_sbon["seconds"] / v_sbon["seconds"]
    block = v.get("block_size")
    return [
        Target(f"SBoN on vLLM vs Best-of-{n} on vLLM the users' way (n={n}), wall-clock",
               ">= 2x", f"{vs_users:.2f}x ({users['seconds']:.1f} s / "
               f"{v_sbon['seconds']:.1f} s){kept}",
               at_512 or _status(vs_users, 2)),
        Target("SBoN on vLLM vs SBoN on the hf engine, wall-clock", ">= 1x",
               f"{vs_hf:.2f}x ({hf_sbon['seconds']:.1f} s / {v_sbon['seconds']:.1f} s)",
               _status(vs_hf, 1)),
        Target("SBoN on vLLM: mean KV-cache usage (over steps; over time)", ">= 80%",
               f"{v_sbon['occupancy']:.1%}; {v.get('time_usage', math.nan):.1%}",
               _status(v_sbon["occupancy"], 0.8)),
        Target("SBoN on vLLM: survivors re-prefill at most one block per decision",
               f"max <= {block} tokens" if block else "max <= a block",
               f"max {v['max_reprefill']}, mean {v['mean_reprefill']:.1f} tokens over "
               f"{v['continuations']} continuations; prefix-cache hit rate "
               f"{v['prefix_hit_rate']:.1%}",
               "n/a (no block size)" if not block else
               ("met" if v["max_reprefill"] <= block else "not met")),
    ]


def auto_targets(report: dict, arms: dict[str, dict]) -> list[Target]:
    """Issue 11's targets for schedule auto (N = 64 against Best-of-64)."""
    if "auto" not in report:
        return []
    a, m = arms[AUTO], report["auto"]["matched"]
    n = report["spec"]["n"]
    at_64 = None if n == 64 else f"n/a (this run's N is {n})"
    score = a["normalized_score"]
    apart = ("; calibration on held-out prompts, "
             f"{report['auto']['calibration_seconds']:.0f} s, not counted"
             if report["auto"]["held_out"] else "; calibration included")
    return [
        Target("auto: normalized score (eq. 6) vs Best-of-64", "mean >= 99, 95% low >= 97",
               f"{score['mean']:.1f} (95% CI {score['low']:.1f}-{score['high']:.1f})",
               at_64 or ("met" if score["mean"] >= 99 and score["low"] >= 97 else "not met")),
        Target("auto: token rate vs Best-of-64", "<= 0.45", f"{a['token_rate']:.3f}",
               at_64 or ("met" if a["token_rate"] <= 0.45 else "not met")),
        Target("auto: wall-clock speedup vs Best-of-64", ">= 2x",
               f"{a['speedup']:.2f}x at normalized score {score['mean']:.1f}{apart}",
               at_64 or _status(a["speedup"], 2)),
        Target("auto: speedup at matched reward (log-N interpolated)", ">= 2x", m["summary"],
               _status(m["speedup"] if m["speedup"] is not None else math.nan, 2)),
    ]


def _status(value: float, threshold: float) -> str:
    if value is None or math.isnan(value):
        return "n/a (no value)"
    return "met" if value >= threshold else "not met"


# -- helpers --------------------------------------------------------------------------------


def _same_answers(a: ArmRun, b: ArmRun) -> bool:
    """Refill changes timing only: the same candidates, decisions and best answers."""
    def key(run: ArmRun):
        return [[(c.tokens, c.status, c.rejected_round) for c in r.candidates] + [r.best]
                for r in run.results]
    return key(a) == key(b)


def _same_best(run: ArmRun, ref: ArmRun) -> bool:
    """Each prompt's answer (candidate, text, score) is the reference's."""
    def key(r):
        best = r.candidates[r.best] if r.best is not None else None
        return (r.prompt_id, r.best, best.text if best else None,
                best.final_score if best else None)
    return [key(r) for r in run.results] == [key(r) for r in ref.results]


def _matched(m) -> dict:
    ci = m.speedup
    return {
        "sbon_reward": m.sbon_reward, "n": m.n, "bracket": list(m.bracket) if m.bracket else None,
        "speedup": ci.value if ci else None, "low": ci.low if ci else None,
        "high": ci.high if ci else None, "bound": m.bound, "note": m.note,
        "summary": (f"{ci.value:.2f}x at Best-of-{m.n:.1f} (95% CI {ci.low:.2f}-{ci.high:.2f})"
                    if ci else m.bound or m.note),
    }


def _throughput(t: Throughput) -> dict:
    side = {name: {**dataclasses.asdict(s), "tokens_per_s": s.tokens_per_s}
            for name, s in (("engine", t.engine), ("generate", t.generate))}
    return {"batch": t.batch, "prompt_tokens": t.prompt_tokens, "new_tokens": t.new_tokens,
            **side, "ratio": t.ratio, "engine_mean_rows": t.engine_mean_rows}


def _roofline(r: Roofline, t: Throughput | None) -> dict:
    lines = list(r.lines)
    fractions = {}
    if t is not None:
        for name, side in (("engine", t.engine), ("model.generate", t.generate)):
            fractions[name] = side.tokens_per_s / r.tokens_per_s
            lines.append(f"{name}: {side.tokens_per_s:,.1f} tokens/s = "
                         f"{fractions[name]:.1%} of the bound")
    return {**dataclasses.asdict(r), "lines": lines, "fraction_of_bound": fractions or None}


def _no_nan(value):
    """NaN (no data) as null: strict JSON, and markdown shows n/a."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def _label(arm: str) -> str:
    """How a matched-reward note names the arm it is about."""
    return "SBoN" if arm == "sbon" else f"the {arm} arm"
