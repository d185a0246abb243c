"""The KV cache against its budget, step by step, in the scenarios of shared/findings/kv-budget.md.

For each scenario the engine runs in this process on the packaged SmolLM2 (float32) with the
bench prompts, and every decode step records the bytes of the real K/V tensors (counted from
the tensors) and the cache's high-water mark (merge and compaction transients included).
Reported per scenario: the largest of each as a share of the budget, the mean occupancy and
allocation, stalls and evictions, and the wall-clock.

    .venv/bin/python bench/kv_budget.py --json bench/results/kv-budget.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specrej_ray.data.prompts import load_prompts, render_prompt
from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.hf.model_runner import ModelRunner
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.task import EngineTask, SearchParams
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.models.loader import load_causal_lm, resolve_model
from specrej_ray.spec import PromptsSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    prompts: int
    n: int
    max_new: int
    decisions: tuple[int, ...] | None
    alpha: float
    budget: int  # KV budget in tokens (the findings' figures)
    ignore_eos: bool = False


SCENARIOS = [
    Scenario("a", "bench_cpu settings, max_new 64", 3, 64, 64, (32,), 0.7, 15146),
    Scenario("b", "tight budget, decisions [16, 48]", 6, 32, 96, (16, 48), 0.5, 4000),
    Scenario("c", "1 prompt, N = 256, a budget that forces waves", 1, 256, 64, (32,), 0.7, 6700),
    Scenario("d", "bench_cpu.yaml as is (max_new 256)", 3, 64, 256, (32,), 0.7, 15146),
    Scenario("d'", "as d, EOS and stop strings off", 3, 64, 256, (32,), 0.7, 15146, True),
    Scenario("bon", "Best-of-64 in the same budget, EOS off", 3, 64, 256, None, 0.0, 15146,
             True),
]


def run(model, tokenizer, tasks: list[EngineTask], s: Scenario) -> dict:
    sampling = SamplingParams(0.8, 0.95, 0, s.max_new, (), ignore_eos=s.ignore_eos)
    search = SearchParams(s.n, s.alpha, s.decisions, 16, s.budget, seed=0)
    engine = Engine(model, tokenizer, sampling, search)
    held: list[int] = []
    decode = ModelRunner.decode

    def watched(runner, slots, tokens, pool_slots):
        out = decode(runner, slots, tokens, pool_slots)
        held.append(engine.scheduler.blocks.tokens() * runner.pool.slot_bytes())
        return out

    ModelRunner.decode = watched
    try:
        t0 = time.perf_counter()
        results = engine.run(tasks[: s.prompts])
        seconds = time.perf_counter() - t0
    finally:
        ModelRunner.decode = decode
    per_token, st = engine.runner.bytes_per_token, engine.stats
    limit = s.budget * per_token
    return {
        "scenario": s.name, "what": s.what, "prompts": s.prompts, "n": s.n,
        "max_new_tokens": s.max_new, "decisions": s.decisions, "alpha": s.alpha,
        "budget_tokens": s.budget, "ignore_eos": s.ignore_eos, "decode_steps": len(held),
        "max_held_tokens": max(held) // per_token,
        "max_held_share": max(held) / limit,
        "peak_share": st.peak_kv_bytes / limit,  # transients included
        "occupancy": st.occupancy, "allocated": st.allocated, "mean_rows": st.mean_rows,
        "stalls": st.stalls, "evictions": st.evictions,
        "replayed_tokens": st.replayed_tokens, "seconds": seconds,
        "tokens": sum(r.tokens_generated for r in results),
        "waves": [r.waves for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="bench/data/hh_rlhf_bench.jsonl")
    ap.add_argument("--only", nargs="+", choices=[s.name for s in SCENARIOS])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    set_torch_threads(args.threads)
    path = resolve_model("smollm2-135m-instruct", "generator.model")
    model, tokenizer = load_causal_lm(path, dtype="float32", device="cpu")
    prompts = load_prompts(PromptsSpec(path=args.prompts, id_field="id")).prompts
    tasks = [EngineTask(p.id, tokenizer(render_prompt(tokenizer, p, True),
                                        add_special_tokens=False).input_ids,
                        lambda r: [[float(len(x))] for x in r])
             for p in prompts]
    rows = []
    print("scenario | budget | max held (tokens) | max held / budget | peak with transients "
          "| occupancy | allocated | stalls | evictions | seconds")
    for s in SCENARIOS:
        if args.only and s.name not in args.only:
            continue
        row = run(model, tokenizer, tasks, s)
        rows.append(row)
        print(f"{s.name} | {s.budget:,} | {row['max_held_tokens']:,} | "
              f"{row['max_held_share']:.1%} | {row['peak_share']:.1%} | {row['occupancy']:.1%} "
              f"| {row['allocated']:.1%} | {row['stalls']} | {row['evictions']} "
              f"| {row['seconds']:.1f}", flush=True)
    save(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
