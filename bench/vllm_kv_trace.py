"""Where vLLM's KV cache goes unused in an SBoN run: a per-step trace of the vLLM backend.

Runs one arm (the bench job's SBoN, or Best-of-N with --alpha 0) through the vLLM backend
in this process and records, after every vLLM step, the share of KV blocks in use and the
requests running and waiting. Prints the mean usage and splits the steps: the cache is full
or vLLM has waiting requests (no room lost), or it has room and nothing waits. The latter are
split again into the run's tail (after the last prompt was handed to vLLM) and the rest.

    .venv/bin/python bench/vllm_kv_trace.py jobs/bench_cpu.yaml --set search.n=16 \\
        --set prompts.limit=12 --json bench/results/vllm-kv-trace-12.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specrej_ray.job.engines import make_engine
from specrej_ray.job.local import load_local
from specrej_ray.job.prepare import resolve_generator
from specrej_ray.spec.load import load_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--alpha", type=float, help="run this alpha instead of the spec's")
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = load_spec(args.job, args.overrides)
    job = load_local(spec)
    tasks = job.engine_tasks(None)
    engine = make_engine(spec, resolve_generator(spec), backend="vllm")
    if args.alpha is not None:
        engine = engine.with_search(alpha=args.alpha)
    engine.run(tasks[:1])  # warm-up, as the bench does
    engine = engine.with_search()
    trace, handed = [], {"all": None}
    probe, step = engine.probe, engine._step
    admit = engine._admit

    def admit_watched(queue, active, refill):
        admit(queue, active, refill)
        if not queue and handed["all"] is None:
            handed["all"] = len(trace)

    def step_watched(n):
        got = step(n)
        trace.append({"usage": probe.usage(), "running": probe.running(),
                      "waiting": probe.waiting(), "t": time.perf_counter()})
        return got

    engine._admit, engine._step = admit_watched, step_watched
    t0 = time.perf_counter()
    results = engine.run(tasks)
    seconds = time.perf_counter() - t0
    full = [s for s in trace if s["waiting"] or s["usage"] >= 0.8]
    room = [i for i, s in enumerate(trace) if not (s["waiting"] or s["usage"] >= 0.8)]
    tail_from = handed["all"] if handed["all"] is not None else len(trace)
    out = {
        "arm": f"alpha {engine.search.alpha}", "prompts": len(results), "seconds": seconds,
        "steps": len(trace), "mean_usage": sum(s["usage"] for s in trace) / len(trace),
        "steps_full_or_waiting": len(full),
        "steps_with_room_and_nothing_waiting": len(room),
        "of_which_in_the_tail": sum(1 for i in room if i >= tail_from),
        "tail_steps": len(trace) - tail_from,
        "mean_usage_before_tail": (sum(s["usage"] for s in trace[:tail_from])
                                   / max(1, tail_from)),
        "mean_running": sum(s["running"] for s in trace) / len(trace),
        "vllm": engine.vllm.as_dict(),
    }
    print(json.dumps(out, indent=2))
    save(args.json, {**out, "trace": [{k: round(v, 4) if isinstance(v, float) else v
                                       for k, v in s.items() if k != "t"} for s in trace]})
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
