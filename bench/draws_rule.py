"""Does the stopping rule for rewards without a ceiling pay (issue 56)? search.draws until: rule
against a fixed N, at matched mean best reward, on the likelihood reward.

    .venv/bin/python bench/draws_rule.py jobs/bench_cpu.yaml --prompts 24 --pool 64 \
        --set generator.sampling.max_new_tokens=128 --out bench/results/draws-rule

One Best-of-`pool` run per prompt on the job's engine (the in-process runner). By candidate
identity, Best-of-N drawn `wave` at a time *is* this pool taken in order, so the rule's result
for each cost is its replay on the pool: draw after draw until the rule stops it (exactly what
the engine would decode; one cost is also run live on the first prompts and must match). The
pool's candidates are i.i.d., so any order of them is as likely as the one drawn: the rule's
expected drawn, best reward and tokens are its replay averaged over `--orders` seeded orders
of each pool (the one drawn among them), as the Best-of-k figures average over subsets. The
fixed-N curve is the pool's unbiased Best-of-k estimate for every k (quality.pool). For each
cost: the rule's mean best reward and mean tokens, the Best-of-k of equal mean best reward
(interpolated in log k), and the ratio of that Best-of-k's tokens to the rule's, with 95%
bootstrap intervals over prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from specrej_ray.engine.task import DrawPlan
from specrej_ray.job.local import load_local
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.quality import stats
from specrej_ray.quality.pool import best_of_k, matched_k, tokens_of_k
from specrej_ray.search.pandora import enough
from specrej_ray.spec.load import load_spec

COSTS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
BOOTSTRAP = 400  # resamples of the prompts for each interval


def replay(rewards: list[float], tokens: list[int], wave: int, cost: float) -> tuple[int, ...]:
    """(candidates drawn, their best reward, their tokens) of the rule on a pool in order."""
    m = wave
    while m < len(rewards) and not enough(rewards[:m], cost):
        m += wave
    m = min(m, len(rewards))
    return m, max(rewards[:m]), sum(tokens[:m])


def expected(rewards: list[float], tokens: list[int], wave: int, cost: float,
             orders: int) -> tuple[float, float, float]:
    """The rule's (drawn, best, tokens) on one pool, averaged over seeded orders of it (the
    order drawn first)."""
    rng = random.Random(0)
    runs = []
    for k in range(orders):
        order = list(range(len(rewards)))
        if k:
            rng.shuffle(order)
        runs.append(replay([rewards[i] for i in order], [tokens[i] for i in order], wave, cost))
    return tuple(sum(x[j] for x in runs) / len(runs) for j in range(3))


def figures(pools: list[tuple[list[float], list[int]]], runs: list[tuple[float, ...]],
            picks: list[int] | None = None) -> dict:
    """The rule (its expected run on each pool, `runs`) against Best-of-k over these
    prompts (or a resample of them, `picks`)."""
    picks = picks or list(range(len(pools)))
    chosen, runs = [pools[i] for i in picks], [runs[i] for i in picks]
    best = sum(b for _, b, _ in runs) / len(runs)
    tokens = sum(t for _, _, t in runs) / len(runs)
    curves = [best_of_k(r) for r, _ in chosen]
    curve = [sum(c[k] for c in curves) / len(curves) for k in range(len(curves[0]))]
    k = matched_k(curve, best)
    bon = None
    if k is not None:
        per_token = sum(tokens_of_k(t)[0] for _, t in chosen) / len(chosen)
        bon = k * per_token  # Best-of-k's expected tokens: k candidates' mean length each
    return {"mean_drawn": sum(m for m, _, _ in runs) / len(runs),
            "mean_best": best, "mean_tokens": tokens, "matched_k": k,
            "bon_tokens_at_k": bon, "tokens_saved": None if bon is None else 1 - tokens / bon}


def analyse(pools: list[tuple[list[float], list[int]]], wave: int, orders: int) -> list[dict]:
    """Each cost's figures, with 95% intervals over resampled prompts."""
    if any(s is None for rewards, _ in pools for s in rewards):
        raise SystemExit("draws_rule: a candidate has no final score; the pool needs every "
                         "candidate to finish (Best-of-N)")
    rows, draws = [], stats.resamples(len(pools))
    for cost in COSTS:
        runs = [expected(r, t, wave, cost, orders) for r, t in pools]
        point = {"cost": cost, **figures(pools, runs)}
        resampled = [figures(pools, runs, d) for d in draws[:BOOTSTRAP]]
        for key in ("mean_best", "mean_tokens", "matched_k", "tokens_saved"):
            finite = [r[key] for r in resampled if r[key] is not None and math.isfinite(r[key])]
            ci = stats.interval(point[key], finite) if point[key] is not None else None
            point[f"{key}_ci"] = [ci.low, ci.high] if ci and finite else None
            point[f"{key}_resamples_kept"] = len(finite)
        rows.append(point)
        print(json.dumps(point), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", type=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--pool", type=int, default=64)
    ap.add_argument("--wave", type=int, default=8)
    ap.add_argument("--live", type=int, default=3, help="prompts the live check runs")
    ap.add_argument("--orders", type=int, default=200, help="orders of each pool replayed")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spec = load_spec(args.job, args.overrides)
    set_torch_threads(spec.generator.threads)
    job = load_local(spec)
    tasks = job.engine_tasks(args.prompts)
    pool = job.engine.best_of_n(args.pool).run(tasks)
    pools = [([c.final_score for c in r.candidates], [len(c.tokens) for c in r.candidates])
             for r in pool]
    rows = analyse(pools, args.wave, args.orders)
    # The replay is what the engine does: one cost live on the first prompts.
    cost = COSTS[2]
    plan = DrawPlan(args.pool, args.wave, enough=lambda finished: enough(
        [c.final_score if c.final_score is not None else c.components[
            job.engine.rewards.names[0]] for c in finished], cost))
    live = job.engine.with_search(n=args.wave, alpha=0.0, bounds_every=0, draws=plan).run(
        tasks[: args.live])
    check = [(len(r.candidates), max(c.final_score for c in r.candidates if c.finished))
             == replay(*pools[i], args.wave, cost)[:2] for i, r in enumerate(live)]
    result = {"command": " ".join(["bench/draws_rule.py", str(args.job), *sum(
        (["--set", o] for o in args.overrides), []), "--prompts", str(args.prompts),
        "--pool", str(args.pool), "--wave", str(args.wave), "--orders", str(args.orders)]),
        "prompts": len(pools), "pool": args.pool, "wave": args.wave, "orders": args.orders,
        "rows": rows, "pools": pools,
        "live_check": {"cost": cost, "prompts": len(check), "match": all(check)},
        "bon_curve": [sum(best_of_k(r)[k] for r, _ in pools) / len(pools)
                      for k in range(args.pool)]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draws-rule.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"live check at cost {cost}: {'match' if all(check) else 'MISMATCH'}")
    return 0 if all(check) else 1


if __name__ == "__main__":
    raise SystemExit(main())
