"""The driver at scale: `run_job` against a fake generator pool (no model), P prompts in shards.

    python bench/driver_scale.py --prompts 10000 100000 1000000 --shard-size 1000 \
        --json bench/results/driver-scale.json [--kill-at 0.6]

For each P: a prompt file of P short prompts and a tiny random model (its tokenizer: the
driver renders and tokenizes every prompt as `run` does); generator actors that answer each
shard at once with N fake candidates per prompt (so what is measured is the driver: prompt
preparation, planning, dispatch, writing each shard, assembly and run.json); a callable
reward. The run is a fresh `specrej-ray run`-like process each time, and reports:

- the driver's peak RSS and what it holds per prompt;
- the shard loop's seconds per shard (first shard sent to last result in, over shards);
- the sizes of manifest.json, run.json and the shard records;
- with --kill-at F: the driver is SIGKILLed once a fraction F of the shards are written, run
  again, and the shards the second run made are compared with those written at the kill
  (a resume redoes at most the shards that were in flight).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

N = 4  # candidates per prompt
REPO = Path(__file__).resolve().parents[1]


def child(job_path: str) -> None:
    """The driver itself, with fake generators (defined here so Ray ships them by value)."""
    import ray

    from specrej_ray.distributed import driver
    from specrej_ray.distributed.placement import GeneratorGroup
    from specrej_ray.engine.sequence import Candidate, PromptResult, Status
    from specrej_ray.job.shards import ShardOutput
    from specrej_ray.spec import load_spec

    @ray.remote(max_restarts=-1, max_concurrency=4)
    class FakeGenerator:
        def info(self) -> dict:
            return {"threads": 1, "device": "fake", "engine": None, "node_id": "fake"}

        def run_shard(self, tasks, choice=None, audit=(), grid=()) -> ShardOutput:
            out = []
            for t in tasks:
                cands = [Candidate(k, tokens=[1, 2, 3], status=Status.FINISHED,
                                   finish_reason="eos", final_score=float(k),
                                   components={"reward": float(k)}, text=f"answer {k}")
                         for k in range(N)]
                out.append(PromptResult(t.prompt_id, cands, N - 1, N, 1, 0, len(t.input_ids),
                                        0.0, 0.0))
            return ShardOutput(out)

    driver.start_group = lambda spec, gen_path, rm_paths, shared, label: GeneratorGroup(
        label, FakeGenerator.options(num_cpus=0.1).remote())
    info = driver.run_job(load_spec(job_path), echo=lambda *a, **k: None)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "seconds": info["seconds"], "counts": info["counts"],
                      "rss_at_end_mb": rss_parts()}), flush=True)


def rss_parts() -> dict[str, float]:
    """The driver's resident memory at the end, by kind: anonymous (its heap), file-backed
    (mapped files: its libraries) and shared memory (Ray's object store, mapped into the
    driver)."""
    parts = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            parts[name] = int(value.split()[0]) / 1024
    return parts


def make_job(root: Path, prompts: int, shard_size: int, model: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"id": f"p{i:07d}", "prompt": f"Question number {i}?"}) + "\n")
    job = {
        "name": "driver-scale",
        "prompts": {"path": str(root / "prompts.jsonl"), "id_field": "id"},
        "generator": {"model": str(model), "sampling": {"max_new_tokens": 8}},
        "reward": {"type": "callable", "function": "bench.driver_scale:constant"},
        "search": {"n": N, "alpha": 0.5, "schedule": {"tokens": [4]}, "audit_fraction": 0},
        "cluster": {"generators": 4, "shard_size": shard_size, "cpus_per_generator": 0.1},
        "output": {"path": str(root / "out"), "formats": ["sft"]},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def constant(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.0 for _ in responses]


def shards_written(out: Path) -> int:
    return len(list((out / "shards").glob("*.json"))) if (out / "shards").exists() else 0


def run_driver(job: Path, kill_at: int | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, __file__, "child", str(job)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    if kill_at is not None:
        out = job.parent / "out"
        while proc.poll() is None and shards_written(out) < kill_at:
            time.sleep(0.2)
        written = shards_written(out)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"killed_at_shards": written}
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"driver failed ({proc.returncode}): {stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def measure(prompts: int, shard_size: int, root: Path, model: Path, kill_at: float | None):
    job = make_job(root, prompts, shard_size, model)
    shards = -(-prompts // shard_size)
    row = {"prompts": prompts, "shard_size": shard_size, "shards": shards}
    before: dict[str, float] = {}
    if kill_at is not None:
        row.update(run_driver(job, kill_at=int(kill_at * shards)))
        before = {p.name: p.stat().st_mtime for p in (root / "out" / "shards").glob("*.json")}
    t0 = time.perf_counter()
    got = run_driver(job)
    row["wall_s"] = time.perf_counter() - t0
    row.update(peak_rss_mb=got["peak_rss_mb"], seconds=got["seconds"],
               rss_at_end_mb=got.get("rss_at_end_mb"))
    out = root / "out"
    row["per_prompt_kb"] = got["peak_rss_mb"] * 1024 / prompts
    loop = got["seconds"].get("shards")
    done = shards - len(before)
    row["loop_s"] = loop
    row["loop_s_per_shard"] = loop / max(done, 1) if loop else None
    row["manifest_kb"] = (out / "manifest.json").stat().st_size / 1024
    row["run_json_kb"] = (out / "run.json").stat().st_size / 1024
    row["shard_records_kb"] = sum(p.stat().st_size for p in (out / "shards").glob("*.json")) / 1024
    if kill_at is not None:
        after = {p.name: p.stat().st_mtime for p in (out / "shards").glob("*.json")}
        # A written shard is never made again; only the shards in flight at the kill are
        # lost (at most generators x shards_in_flight), and the resume makes the rest.
        row["written_at_kill"] = len(before)
        row["rewritten_by_resume"] = sum(after[name] != t for name, t in before.items())
        row["made_by_resume"] = len(set(after) - set(before))
    return row


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--kill-at", type=float, default=None)
    ap.add_argument("--root", type=Path, default=Path("/tmp/driver-scale"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tests.tiny import save_tiny_lm

    model = args.root / "model"
    if not model.exists():
        save_tiny_lm(model)
    rows = []
    for p in args.prompts:
        root = args.root / f"p{p}"
        subprocess.run(["rm", "-rf", str(root)], check=True)
        row = measure(p, args.shard_size, root, model, args.kill_at)
        rows.append(row)
        print(json.dumps(row), flush=True)
        subprocess.run(["rm", "-rf", str(root)], check=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
