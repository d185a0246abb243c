"""The driver at scale: `run_job` against a fake generator pool (no model), P prompts in shards.

    python bench/driver_scale.py --prompts 10000 100000 1000000 --shard-size 1000 \
        --json bench/results/driver-scale.json [--kill-at 0.6]
    python bench/driver_scale.py --prompts 100000 --shard-size 100 --generators 16 \
        --in-flight 4 --store s3 --json bench/results/load-s3.json

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
  (a resume redoes at most the shards that were in flight);
- with --store s3: the output is on an S3 API (moto's server, tests/helpers/s3.py), and the
  driver counts its requests to it by operation (per shard written) and reports its lease's
  renewals (missed: failed, or over half a period late).

--generators G --in-flight K: G fake generators holding K shards each (G x K in flight).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402

N = 4  # candidates per prompt


def child(job_path: str) -> None:
    """The driver itself, with fake generators (defined here so Ray ships them by value)."""
    import ray

    from specrej_ray.distributed import driver
    from specrej_ray.distributed.placement import GeneratorGroup
    from specrej_ray.engine.sequence import Candidate, PromptResult, Status
    from specrej_ray.job.shards import ShardOutput
    from specrej_ray.spec import load_spec

    requests = _count_s3_requests()
    spec = load_spec(job_path)

    @ray.remote(max_restarts=-1, max_concurrency=64)
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
    info = driver.run_job(spec, echo=lambda *a, **k: None)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "seconds": info["seconds"], "counts": info["counts"],
                      "rss_at_end_mb": rss_parts(), "lease": info.get("lease"),
                      "requests": requests}), flush=True)


def _count_s3_requests() -> dict[str, int]:
    """Every request s3fs makes from now on, by S3 operation (all go through _call_s3)."""
    counts: dict[str, int] = {}
    try:
        import fsspec.asyn
        import s3fs
    except ImportError:
        return counts
    call = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        name = method if isinstance(method, str) else getattr(method, "__name__", "?")
        counts[name] = counts.get(name, 0) + 1
        return await call(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted
    # the sync wrapper captured the original: the lease's own calls go through it
    s3fs.S3FileSystem.call_s3 = fsspec.asyn.sync_wrapper(counted)
    return counts


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


def make_job(root: Path, prompts: int, shard_size: int, model: Path, out: str | None = None,
             generators: int = 4, in_flight: int = 1) -> Path:
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
        "cluster": {"generators": generators, "shard_size": shard_size,
                    "cpus_per_generator": 0.1, "shards_in_flight": in_flight},
        "output": {"path": out or str(root / "out"), "formats": ["sft"]},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def constant(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.0 for _ in responses]


class Output:
    """Where a run writes (a local folder, or s3:// on moto's server) and how to look."""

    def __init__(self, url: str, fs, env: dict[str, str]) -> None:
        self.url, self.fs, self.env = url, fs, env
        self.root = url.removeprefix("s3://")

    def records(self) -> dict[str, object]:
        """Shard record name -> a stamp that changes when it is rewritten (mtime / ETag)."""
        self.fs.invalidate_cache()
        found = {}
        for path, info in self.fs.glob(f"{self.root}/shards/*.json", detail=True).items():
            found[path.rsplit("/", 1)[-1]] = info.get("mtime") or info.get("ETag")
        return found

    def size_kb(self, name: str) -> float:
        return self.fs.size(f"{self.root}/{name}") / 1024

    def records_kb(self) -> float:
        return sum(info["size"] for info in self.fs.glob(
            f"{self.root}/shards/*.json", detail=True).values()) / 1024


def run_driver(job: Path, out: Output, kill_at: int | None = None,
               start: Callable[..., subprocess.Popen] = subprocess.Popen) -> dict:
    """The driver (`child`) as a process of its own, started by `start` (subprocess.Popen, or
    a launcher with its arguments: the tests fork theirs from a preloaded process)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | out.env
    cmd = [sys.executable, "-m", "bench.driver_scale", "child", str(job)]
    with tempfile.TemporaryFile() as err:
        proc = start(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                     start_new_session=True)
        if kill_at is not None:
            while proc.poll() is None and len(out.records()) < kill_at:
                time.sleep(0.2)
            written = len(out.records())
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"killed_at_shards": written}
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-2000:].decode(errors="replace")
            raise SystemExit(f"driver failed ({proc.returncode}): {tail}")
    return json.loads(stdout.strip().splitlines()[-1])


def measure(prompts: int, shard_size: int, root: Path, model: Path, kill_at: float | None,
            out: Output | None = None, generators: int = 4, in_flight: int = 1,
            start: Callable[..., subprocess.Popen] = subprocess.Popen):
    import fsspec

    out = out or Output(str(root / "out"), fsspec.filesystem("file"), {})
    job = make_job(root, prompts, shard_size, model, out.url, generators, in_flight)
    shards = -(-prompts // shard_size)
    row = {"prompts": prompts, "shard_size": shard_size, "shards": shards,
           "store": "s3" if out.url.startswith("s3://") else "local",
           "in_flight": generators * in_flight}
    before: dict[str, object] = {}
    if kill_at is not None:
        row.update(run_driver(job, out, kill_at=int(kill_at * shards), start=start))
        before = out.records()
    t0 = time.perf_counter()
    got = run_driver(job, out, start=start)
    row["wall_s"] = time.perf_counter() - t0
    row.update(peak_rss_mb=got["peak_rss_mb"], seconds=got["seconds"],
               rss_at_end_mb=got.get("rss_at_end_mb"), lease=got.get("lease"))
    row["per_prompt_kb"] = got["peak_rss_mb"] * 1024 / prompts
    loop = got["seconds"].get("shards")
    done = shards - len(before)
    row["loop_s"] = loop
    row["loop_s_per_shard"] = loop / max(done, 1) if loop else None
    if got.get("requests"):
        row["requests"] = got["requests"]
        row["requests_per_shard"] = sum(got["requests"].values()) / max(done, 1)
    row["manifest_kb"] = out.size_kb("manifest.json")
    row["run_json_kb"] = out.size_kb("run.json")
    row["shard_records_kb"] = out.records_kb()
    if kill_at is not None:
        after = out.records()
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
    ap.add_argument("--generators", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=1, help="shards in flight per generator")
    ap.add_argument("--store", choices=("local", "s3"), default="local")
    ap.add_argument("--root", type=Path, default=Path("/tmp/driver-scale"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tests.helpers.s3 import MotoServer
    from tests.tiny import save_tiny_lm

    model = args.root / "model"
    if not model.exists():
        save_tiny_lm(model)
    server = MotoServer().start() if args.store == "s3" else None
    rows = []
    try:
        if server is not None:
            server.make_bucket("load")
        for p in args.prompts:
            root = args.root / f"p{p}"
            subprocess.run(["rm", "-rf", str(root)], check=True)
            out = None
            if server is not None:
                out = Output(f"s3://load/p{p}-{int(time.time())}/out", server.fs(),
                             server.env())
            row = measure(p, args.shard_size, root, model, args.kill_at, out,
                          args.generators, args.in_flight)
            rows.append(row)
            print(json.dumps(row), flush=True)
            subprocess.run(["rm", "-rf", str(root)], check=True)
    finally:
        if server is not None:
            server.stop()
    save(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
