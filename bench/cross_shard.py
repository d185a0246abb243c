"""Generators that never drain: a job run with cluster.shards_in_flight 1 (each generator
drains between shards) and 2 (the next shard joins the running batch), side by side.

    python bench/cross_shard.py jobs/demo.yaml --prompts 40 --shard-size 4 \
        --set prompts.path=bench/data/hh_rlhf_bench.jsonl [--json FILE]

Both arms run the same spec (same prompts, seed and engine) through `run_job` with one
generator, into temporary outputs. Reported per arm, from run.json: seconds.shards (first
shard sent .. last result in) and the generator engine's counters (decode steps, mean rows,
KV occupancy over decode steps); and whether every prompt's best response is the same in both
arms (candidate identity: it must be). Arms run one after the other on this machine: let
nothing else run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from specrej_ray.cli import USER_ERRORS
from specrej_ray.distributed.driver import run_job
from specrej_ray.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402


def arm(job: Path, overrides: list[str], in_flight: int, out_dir: str) -> dict:
    spec = load_spec(job, [*overrides, f"cluster.shards_in_flight={in_flight}",
                           f"output.path={out_dir}", "output.if_exists=overwrite"])
    info = run_job(spec, echo=lambda *a, **k: None)
    (engine,) = [g["engine"] for g in info["generators"].values() if "engine" in g]
    best = pq.read_table(Path(out_dir) / "best.parquet", columns=["id", "response"])
    return {"shards_in_flight": in_flight, "shards_s": round(info["seconds"]["shards"], 2),
            "startup_s": round(info["seconds"]["startup"], 2), **engine,
            "best": dict(zip(best.column("id").to_pylist(), best.column("response").to_pylist(),
                             strict=True))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", type=Path)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--shard-size", type=int, default=4)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    overrides = [*args.overrides, f"prompts.limit={args.prompts}", "cluster.generators=1",
                 f"cluster.shard_size={args.shard_size}"]
    arms = []
    try:
        for in_flight in (1, 2):
            with tempfile.TemporaryDirectory(prefix="specrej-cross-shard-") as out_dir:
                arms.append(arm(args.job, overrides, in_flight, out_dir))
                print({k: v for k, v in arms[-1].items() if k != "best"}, flush=True)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    same = sum(arms[0]["best"][i] == arms[1]["best"].get(i) for i in arms[0]["best"])
    result = {"job": str(args.job), "overrides": overrides,
              "arms": [{k: v for k, v in a.items() if k != "best"} for a in arms],
              "speedup": round(arms[0]["shards_s"] / arms[1]["shards_s"], 3),
              "best_identical": same, "best_compared": len(arms[0]["best"])}
    print(json.dumps(result))
    save(args.json, result)
    return 0 if same == len(arms[0]["best"]) else 1


if __name__ == "__main__":
    sys.exit(main())
