"""bench.md and bench.png from the report dict: the figures as markdown, ready to paste into a
topic file under bench/results/ (BENCHMARKS.md links them), and mean best reward against
wall-clock, one point per arm."""

from __future__ import annotations

import math

from matplotlib.ticker import FuncFormatter

from specrej_ray.figures import BEST, BON, figure, png
from specrej_ray.numbers import fmt


def render(r: dict) -> str:
    s = r["spec"]
    lines = [
        f"## {s['name']}: SBoN vs Best-of-N on the same engine ({r['date'][:10]})",
        "",
        f"Machine: {_machine(r['machine'])}.",
        f"Job: generator `{s['generator']}`, reward `{s['reward']}`, {r['prompts']} prompts, "
        f"N = {s['n']}, alpha = {s['alpha']:g}, schedule {s['schedule']}, "
        f"{_sampling(s['sampling'])}, seed {s['seed']} (spec fingerprint {s['fingerprint']}).",
        "",
        "```",
        r["command"],
        "```",
        "",
        r["reward_note"],
        r["score_note"],
        "Wall-clock is Engine.run over all prompts, rewards included, after one untimed "
        "warm-up prompt; every arm shares the model, sampling, KV budget, admission and seed. "
        f"Speedups and scores are against `{r['reference']}`; per-prompt speedups divide each "
        "prompt's cost (its share of the batch's steps by rows, plus its rewards).",
        "",
        *_arms_table(r["arms"]),
        "",
        *_bounds(r["arms"]),
        *_identity(r["identity"], r["reference"]),
        "",
        *_matched_arms(r),
        "",
        *_auto(r.get("auto")),
        *_engines(r.get("engines")),
    ]
    for t in r["throughput"]:
        lines += _throughput(t) + [""]
    for roof in r["roofline"]:
        lines += [f"### Roofline of one decode step at batch {roof['batch']}", "", "```text",
                  *roof["lines"], "```", ""]
    lines += _targets(r["targets"]) + ["", "![mean best reward vs wall-clock](bench.png)", ""]
    return "\n".join(lines)


def _arms_table(arms: list[dict]) -> list[str]:
    rows = [
        "| arm | N | alpha | refill | wall-clock (s) | speedup: totals / per-prompt mean "
        "| normalized score, eq. 6 (mean [95% CI] / min) | mean best reward "
        "| decoded tokens (discarded) | token rate | tokens/s | occupancy | allocated "
        "| mean rows | scoring s | reward tokens / token (full re-scoring) |",
        "| --- | ---: | ---: | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for a in arms:
        ns = a["normalized_score"]
        score = (f"{fmt(ns['mean'], 1)} [{fmt(ns['low'], 1)}-{fmt(ns['high'], 1)}] / "
                 f"{fmt(ns['min'], 1)}")
        speed = (f"{_x(a['speedup'])} / {_x(a['speedup_per_prompt']['value'])} "
                 f"[{fmt(a['speedup_per_prompt']['low'], 2)}-"
                 f"{fmt(a['speedup_per_prompt']['high'], 2)}]")
        rows.append(
            f"| {a['name']} | {a['n']} | {a['alpha']:g} | {'yes' if a['refill'] else 'no'} "
            f"| {a['seconds']:.1f} | {speed} | {score} | {fmt(a['mean_best_reward'], 4)} "
            f"| {a['decoded_tokens']:,} ({a['discarded_tokens']:,}) | {fmt(a['token_rate'], 3)} "
            f"| {a['tokens_per_s']:,.1f} | {_pct(a['occupancy'])} | {_pct(a['allocated'])} "
            f"| {a['mean_rows']:.1f} | {a['score_seconds']:.1f} "
            f"| {fmt(a['reward_tokens_per_token'], 2)} ({fmt(a['reward_full_per_token'], 2)}) |"
        )
    return rows


def _auto(a: dict | None) -> list[str]:
    if not a:
        return []
    c = a["choice"]
    where = ("held-out prompts (not bench prompts; their cost is not in the arm's time)"
             if a["held_out"] else "the bench's first prompts (Best-of-N answers, time included)")
    return [
        "### schedule: auto",
        "",
        f"Calibrated on {len(a['calibration_prompts'])} {where} in "
        f"{a['calibration_seconds']:.1f} s: {c['reason']}; ran {c['how']}. The SBoN arms ran "
        "the chosen setting too.",
        "",
        f"**auto, speedup at matched reward:** {a['matched']['note']}.",
        "",
    ]


def _identity(checks: dict, reference: str) -> list[str]:
    out = []
    for name, c in checks.items():
        if not isinstance(c, dict):
            continue
        verdict = "holds" if not c["mismatches"] else (
            f"**{c['mismatches']} mismatches** (first: {c['first_mismatch']})")
        out.append(f"Candidate identity, {name} vs {reference}: {verdict}: "
                   f"{c['finished_equal']} finished candidates equal, {c['rejected_prefix']} "
                   "rejected or pruned ones prefixes of theirs.")
    if "refill_changes_nothing" in checks:
        same = "identical" if checks["refill_changes_nothing"] else "**different**"
        out.append(f"sbon and sbon-norefill answers: {same}.")
    if "bounds_answers_are_best_of_n" in checks:
        same = "identical" if checks["bounds_answers_are_best_of_n"] else "**different**"
        out.append(f"bounds and {reference} answers (candidate, text, score): {same}.")
    return out


def _matched_arms(r: dict) -> list[str]:
    by_arm = r.get("matched_arms") or {"sbon": r["matched"]}
    return [f"**Speedup at matched reward, {name}:** {m['note']}." for name, m in by_arm.items()]


def _bounds(arms: list[dict]) -> list[str]:
    """What pruning from bounds stopped and what asking for bounds cost."""
    pruning = [a for a in arms if a.get("bounds_every")]
    if not pruning:
        return []
    return ["| arm | bounds every | checks | pruned | rejected by the rule | bounds seconds "
            "(share of wall-clock) | token rate [95% CI] |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
            *(f"| {a['name']} | {a['bounds_every']} | {a['bounds_checks']:,} | {a['pruned']:,} "
              f"| {a['rejected']:,} | {a['bounds_seconds']:.2f} ({_pct(a['bounds_share'])}) "
              f"| {fmt(a['token_rate'], 3)} [{fmt(a['token_rate_ci']['low'], 3)}-"
              f"{fmt(a['token_rate_ci']['high'], 3)}] |" for a in pruning), ""]


def _throughput(t: dict) -> list[str]:
    return [
        f"### Engine throughput at batch {t['batch']}",
        "",
        f"One prompt ({t['prompt_tokens']} tokens), {t['batch']} rows, exactly "
        f"{t['new_tokens']} new tokens each (EOS and stop strings off in both), same sampling; "
        f"warm-up run excluded; the engine's mean rows per step: {t['engine_mean_rows']:.1f}.",
        "",
        "| | seconds | tokens | tokens/s |",
        "| --- | ---: | ---: | ---: |",
        *(f"| {name} | {t[key]['seconds']:.3f} | {t[key]['tokens']:,} "
          f"| {t[key]['tokens_per_s']:,.1f} |"
          for name, key in (("specrej-ray engine", "engine"), ("model.generate", "generate"))),
        "",
        f"Engine / model.generate: **{t['ratio']:.2f}x**.",
    ]


def _targets(targets: list[dict]) -> list[str]:
    return [
        "### Targets",
        "",
        "| target | goal | measured | status |",
        "| --- | --- | --- | --- |",
        *(f"| {t['name']} | {t['goal']} | {t['measured']} | {t['status']} |" for t in targets),
    ]


def _machine(m: dict) -> str:
    where = m["gpu"] or "no GPU"
    mem = f", {m['memory_gib']:.0f} GiB" if m["memory_gib"] else ""
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    return (f"{m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads){mem}, "
            f"{where} (device {m['device']}); {versions}")


def _sampling(sp: dict) -> str:
    return (f"temperature {sp['temperature']:g}, top_p {sp['top_p']:g}, top_k {sp['top_k']}, "
            f"max_new_tokens {sp['max_new_tokens']}")


def _x(value: float | None) -> str:
    return fmt(value, 2) + ("x" if value is not None else "")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


# -- the figure -----------------------------------------------------------------------------


def reward_vs_time(arms: list[dict], reward: str) -> bytes:
    """BoN arms joined by a line and labelled with N; SBoN arms as stars (hollow: no refill)."""
    fig, ax = figure(height=5)
    points = [a for a in arms if not math.isnan(_num(a["mean_best_reward"]))]
    bon = sorted((a for a in points if a["kind"] == "bon"), key=lambda a: a["n"])
    if bon:
        ax.plot([a["seconds"] for a in bon], [a["mean_best_reward"] for a in bon], color=BON,
                marker="o", label="Best-of-N")
        for a in bon:
            ax.annotate(f"N={a['n']}", (a["seconds"], a["mean_best_reward"]),
                        textcoords="offset points", xytext=(5, -12), fontsize="small")
    for a in (a for a in points if a["kind"] == "sbon"):
        filled = a["refill"]
        bounds = ", bounds" if a.get("bounds_every") else ""
        ax.scatter([a["seconds"]], [a["mean_best_reward"]], marker="D" if bounds else "*",
                   s=120 if bounds else 220, zorder=3, color=BEST if filled else "white",
                   edgecolors=BEST, label=f"{a['name']} N={a['n']}, alpha {a['alpha']:g}"
                   + bounds + ("" if filled else ", no refill"))
    ax.set_xscale("log")
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # 20, not 2 x 10^1
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set(title="Mean best reward vs wall-clock (same engine, prompts and seed)",
           xlabel="wall-clock seconds (log scale)", ylabel=f"mean best reward: {reward}")
    ax.legend(loc="lower right")
    return png(fig)


def _num(value: float | None) -> float:
    return math.nan if value is None else value


def _engines(e: dict | None) -> list[str]:
    """The hf and vLLM arms side by side, each against its engine's Best-of-N at N."""
    if not e:
        return []
    rows = [
        "### Engines side by side", "",
        "Each arm against its own engine's Best-of-N at the spec's N (`vllm-n`, vLLM's own "
        "sampling with n=N, is an independent sample of it). Token rate and speedups as above; "
        "KV usage is vLLM's blocks in use over its cache, mean over steps / weighted by each "
        "step's time. Prefix hits: the share of the requests' prompt tokens that vLLM's "
        "prefix cache held. Re-prefill: what a survivor's continuation request prefilled "
        "again (mean / max tokens; its partial last block is never cached).", "",
        "| engine | arm | wall-clock (s) | speedup vs its BoN | normalized score, eq. 6 "
        "(mean [95% CI]) | mean best reward | tokens kept | discarded | decoded | tokens/s "
        "| KV usage (steps / time) | prefix hits | re-prefill | preemptions |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for a in e["arms"]:
        v = a.get("vllm") or {}
        sc = a["normalized_score"]
        rows.append(
            f"| {a['engine']} | {a['name']} | {a['seconds']:.1f} | {a['speedup']:.2f}x "
            f"| {fmt(sc['mean'], 1)} [{fmt(sc['low'], 1)}-{fmt(sc['high'], 1)}] "
            f"| {fmt(a['mean_best_reward'], 4)} | {a['tokens']:,} "
            f"| {a['discarded_tokens']:,} | {a['decoded_tokens']:,} "
            f"| {a['tokens_per_s']:.1f} "
            f"| {_usage(a, v)} "
            f"| {_pct(v['prefix_hit_rate']) if v else 'n/a'} "
            f"| {_reprefill(v)} "
            f"| {v['preemptions'] if v else 'n/a'} |")
    m = e["matched"]
    ident = e["identity"]
    rows += ["", f"**Speedup at matched reward, hf:** {m['hf']['summary']}.",
             f"**Speedup at matched reward, vLLM:** {m['vllm']['summary']}.",
             f"Best-of-N candidates with the same tokens on both engines: "
             f"{ident['bon_candidates_equal_across_engines']}.", ""]
    return rows


def _usage(arm: dict, v: dict) -> str:
    if arm["engine"] != "vllm":
        return "n/a"
    return f"{_pct(arm['occupancy'])} / {_pct(v.get('time_usage'))}"


def _reprefill(v: dict) -> str:
    if not v or not v.get("continuations"):
        return "n/a"
    return f"{v['mean_reprefill']:.1f} / {v['max_reprefill']}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"
