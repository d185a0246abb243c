"""What a slow reward costs a run: the demo job (SBoN with refill, on Ray) with a callable
reward that answers after a fixed latency a call, against the same reward at no latency
(issue 57: a step's reward work never blocks the batch).

    .venv/bin/python bench/reward_latency.py --latency 0,0.2 --out bench/results/reward-latency

Each run is `specrej-ray run` in a process of its own, on the demo's prompts and generator,
its reward replaced by a callable (a deterministic score of the text, then a sleep of the
latency), written into the run's folder with the spec. It reports each run's wall-clock from
start to exit, and run.json's split of it (Ray and the actors starting, then the shards), so
the ratio can be read on the whole command and on the part a reward's latency can lengthen.
Run it from a tree's directory with that tree's environment: the tree's package is the one
measured (its Ray workers import it from the same environment).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
REWARD = '''"""The bench's callable reward: the text's score, after a fixed latency a call."""
import time

LATENCY_S = {latency!r}


def score(prompts, responses):
    time.sleep(LATENCY_S)
    return [(sum(map(ord, r)) % 101) / 101 for r in responses]
'''


def spec_for(folder: Path, latency: float, demo: Path) -> Path:
    spec = yaml.safe_load(demo.read_text())
    spec["prompts"]["path"] = str((demo.parent.parent / spec["prompts"]["path"]).resolve())
    module = f"latency_{str(latency).replace('.', '_')}"
    (folder / f"{module}.py").write_text(REWARD.format(latency=latency))
    spec["reward"] = {"type": "callable", "function": f"{module}:score"}
    spec["output"] = {"path": str(folder / "out"), "if_exists": "overwrite"}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def one_run(folder: Path, latency: float, demo: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    job = spec_for(folder, latency, demo)
    env = {**os.environ, "PYTHONPATH": str(folder)}  # the reward module, in every Ray worker
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "specrej_ray", "run", str(job)], cwd=folder,
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (folder / "run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"reward_latency: the run at {latency} s failed (exit "
                         f"{proc.returncode}); see {folder / 'run.log'}")
    record = json.loads((folder / "out" / "run.json").read_text())
    seconds = record.get("seconds", {})
    return {"latency_s": latency, "wall_s": round(wall, 2),
            "startup_s": seconds.get("startup"), "shards_s": seconds.get("shards"),
            "prompts": record.get("counts", {}).get("prompts")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", default="0,0.2", help="seconds a call, comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each latency, interleaved")
    ap.add_argument("--demo", type=Path, default=REPO / "jobs" / "demo.yaml")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    latencies = [float(x) for x in args.latency.split(",")]
    rows = []
    for rep in range(args.repeats):
        for latency in latencies:
            row = one_run(args.out / f"latency-{latency}-{rep}", latency, args.demo)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = [r for r in rows if r["latency_s"] == latencies[0]]
    summary = {}
    for latency in latencies[1:]:
        mine = [r for r in rows if r["latency_s"] == latency]
        summary[str(latency)] = {
            key: round(sum(r[key] for r in mine) / sum(r[key] for r in base), 3)
            for key in ("wall_s", "shards_s") if all(r[key] for r in base + mine)}
    result = {"rows": rows, "ratio_to_first": summary}
    (args.out / "reward-latency.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
