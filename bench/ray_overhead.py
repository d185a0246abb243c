"""Ray overhead: a job's first K prompts run by `run_job` with one generator actor, against the
same engine called in this process on the same prompts.

    python bench/ray_overhead.py jobs/demo.yaml --prompts 8 [--json out/ray_overhead.json]

In process: `load_local(spec)` (timed apart, not compared), then `engine.run` on the shards the
driver would send (same shard_size and refill), scoring with the rewards in this process.
Distributed: `run_job` with cluster.generators=1 into a temporary output directory. Its
run.json splits the wall-clock into seconds.startup (Ray, actors, model loads) and
seconds.shards (first shard sent .. last result in); the overhead is shards / in-process.
Both runs must give every prompt the same best response (candidate identity): exit 1 if not.
Run it on a quiet machine: both timings share its cores with anything else running.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from specrej_ray.cli import USER_ERRORS
from specrej_ray.distributed.driver import run_job
from specrej_ray.job.local import load_local
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.spec import JobSpec, load_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402

TARGET = 1.10  # issue 4: the distributed run may take at most 10% longer


def in_process(spec: JobSpec) -> tuple[dict[str, str], float, float]:
    """Best response per prompt id, model load seconds, generation seconds."""
    set_torch_threads(spec.generator.threads)  # what the generator actor gives torch
    t0 = time.perf_counter()
    job = load_local(spec)
    load_s = time.perf_counter() - t0
    tasks, size = job.engine_tasks(), spec.cluster.shard_size
    t0 = time.perf_counter()
    results = [r for i in range(0, len(tasks), size)
               for r in job.engine.run(tasks[i : i + size], refill=spec.search.refill)]
    run_s = time.perf_counter() - t0
    best = {r.prompt_id: r.candidates[r.best].text if r.best is not None else "" for r in results}
    return best, load_s, run_s


def distributed(spec: JobSpec) -> tuple[dict[str, str], dict]:
    """Best response per prompt id and run.json's seconds."""
    info = run_job(spec, echo=lambda *a, **k: None)
    rows = pq.read_table(Path(spec.output.path) / "best.parquet").to_pylist()
    return {r["id"]: r["response"] for r in rows}, info["seconds"]


def measure(job: Path, prompts: int, out_dir: str) -> dict:
    overrides = [f"prompts.limit={prompts}", "cluster.generators=1",
                 f"output.path={out_dir}", "output.if_exists=overwrite"]
    spec = load_spec(job, overrides)
    local_best, load_s, local_s = in_process(spec)
    ray_best, seconds = distributed(spec)
    same = sum(local_best[pid] == ray_best.get(pid) for pid in local_best)
    return {
        "job": str(job), "prompts": len(local_best), "shard_size": spec.cluster.shard_size,
        "in_process_s": local_s, "model_load_s": load_s,
        "ray_shards_s": seconds["shards"], "ray_startup_s": seconds["startup"],
        "ray_generate_s": seconds["generate"], "ray_total_s": seconds["total"],
        "overhead": seconds["shards"] / local_s, "target": TARGET,
        "best_identical": same, "best_compared": len(local_best),
    }


def report(r: dict) -> str:
    return "\n".join([
        f"prompts: {r['prompts']} (shards of {r['shard_size']})",
        f"in process: {r['in_process_s']:.2f} s generating (model load {r['model_load_s']:.2f} s,"
        " not compared)",
        f"ray, 1 generator: {r['ray_shards_s']:.2f} s shards; startup {r['ray_startup_s']:.2f} s "
        f"(Ray, actors, models); run_job {r['ray_total_s']:.2f} s in all",
        f"overhead: {r['overhead']:.3f}x (target <= {r['target']:.2f}x)",
        f"best responses identical: {r['best_identical']}/{r['best_compared']}",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", type=Path, help="job spec YAML")
    p.add_argument("--prompts", type=int, default=8, metavar="K", help="first K prompts")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = p.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="specrej-overhead-") as out_dir:
            result = measure(args.job, args.prompts, out_dir)
    except USER_ERRORS as e:  # a bad spec, prompts or model: one line, as the CLI does
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(result))
    save(args.json, result)
    return 0 if result["best_identical"] == result["best_compared"] else 1


if __name__ == "__main__":
    sys.exit(main())
