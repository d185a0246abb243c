"""bench.md: the figures as markdown, ready to paste into BENCHMARKS.md."""

from __future__ import annotations

from specrej_ray.report.text import fmt


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
        "Wall-clock is Engine.run over all prompts, rewards included, after one untimed "
        "warm-up prompt; every arm shares the model, sampling, KV budget and seed.",
        "",
        *_arms_table(r["arms"]),
        "",
        f"**Speedup at matched reward:** {r['matched']['note']}.",
        "",
    ]
    if r["throughput"]:
        lines += _throughput(r["throughput"]) + [""]
    if r["roofline"]:
        lines += ["### Roofline of one decode step", "", "```text", *r["roofline"]["lines"],
                  "```", ""]
    lines += _targets(r["targets"]) + ["", "![mean best reward vs wall-clock](bench.png)", ""]
    return "\n".join(lines)


def _arms_table(arms: list[dict]) -> list[str]:
    rows = [
        "| arm | N | alpha | refill | wall-clock (s) | tokens | tokens/s | mean best reward "
        "| normalized score vs BoN, same N (mean / median / min) | speedup vs BoN, same N "
        "| token rate | occupancy | mean rows |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for a in arms:
        ns = a.get("normalized_score")
        score = (f"{fmt(ns['mean'], 1)} / {fmt(ns['median'], 1)} / {fmt(ns['min'], 1)}"
                 if ns else "100 (reference)" if a["kind"] == "bon" else "n/a")
        rows.append(
            f"| {a['name']} | {a['n']} | {a['alpha']:g} | {'yes' if a['refill'] else 'no'} "
            f"| {a['seconds']:.2f} | {a['tokens']:,} | {a['tokens_per_s']:,.1f} "
            f"| {fmt(a['mean_best_reward'], 4)} | {score} "
            f"| {_x(a.get('speedup'))} | {fmt(a.get('token_rate'), 3)} "
            f"| {_pct(a['occupancy']) if a['decode_steps'] else 'n/a'} | {a['mean_rows']:.1f} |"
        )
    return rows


def _throughput(t: dict) -> list[str]:
    waves = "" if t["engine_waves"] == 1 else (
        f" The KV budget did not hold all {t['batch']} rows at once: the engine ran "
        f"{t['engine_waves']} waves (mean {t['engine_mean_rows']:.1f} rows).")
    return [
        f"### Engine throughput at batch {t['batch']}",
        "",
        f"One prompt ({t['prompt_tokens']} tokens), {t['batch']} rows, exactly "
        f"{t['new_tokens']} new tokens each (EOS and stop strings off in both), same sampling; "
        f"warm-up run excluded.{waves}",
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
