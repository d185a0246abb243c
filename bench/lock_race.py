"""Racing starts: two `specrej-ray run` processes started at the same moment on one output.

    python bench/lock_race.py jobs/demo.yaml --tries 20 [--json bench/results/lock-race.json]

Each try starts two runs of the job at once on the same fresh output.path, with --overwrite
and different specs (search.alpha 0.5 and 0.7), a few prompts and short responses. One must
win; the other must exit 2 with one line naming the holder, or, if it started after the
winner finished, overwrite it completely. After each try the dataset must be one spec's
alone: every row's fingerprint equals the manifest's, every prompt exactly once. Prints a
line per try and a summary (refusal latency: from the loser's start to its exit, Python
start-up included); exit 1 if any try mixed, duplicated or lost rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402

SETTINGS = ["prompts.limit=3", "generator.sampling.max_new_tokens=16", "search.n=4",
            "search.schedule.tokens=[8]", "cluster.shard_size=1"]


def one_try(job: str, out: Path) -> dict:
    commands = [[sys.executable, "-m", "specrej_ray.cli", "run", job, "--overwrite",
                 "--set", f"output.path={out}", "--set", f"search.alpha={alpha}",
                 *[x for s in SETTINGS for x in ("--set", s)]] for alpha in (0.5, 0.7)]
    logs = [out.with_name(f"{out.name}-{i}.err") for i in range(2)]
    started = time.monotonic()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=log.open("w"))
             for c, log in zip(commands, logs, strict=True)]
    ended: dict[int, float] = {}
    while len(ended) < 2 and time.monotonic() - started < 600:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.02)
    results = [(p.wait(timeout=60), log.read_text().strip().splitlines())
               for p, log in zip(procs, logs, strict=True)]
    codes = [code for code, _ in results]
    refused = [i for i, (code, lines) in enumerate(results)
               if code == 2 and len(lines) == 1 and "is in use by" in lines[0]]
    rows = pq.read_table(out / "best.parquet", columns=["id", "fingerprint"]).to_pylist()
    manifest = json.loads((out / "manifest.json").read_text())
    ids = [r["id"] for r in rows]
    return {
        "codes": codes,
        "refused_after_s": [round(ended[i], 2) for i in refused],
        "writers_in_dataset": sorted({r["fingerprint"] for r in rows}),
        "manifest": manifest["fingerprint"],
        "rows": len(rows),
        "duplicates": len(ids) - len(set(ids)),
        "ok": (sorted(codes) in ([0, 0], [0, 2])
               and {r["fingerprint"] for r in rows} == {manifest["fingerprint"]}
               and len(ids) == len(set(ids)) == 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tries = []
    with tempfile.TemporaryDirectory(prefix="specrej-race-") as tmp:
        for i in range(args.tries):
            result = one_try(args.job, Path(tmp) / f"try-{i}")
            tries.append(result)
            print(f"try {i + 1}: {result}", flush=True)
    latencies = [s for t in tries for s in t["refused_after_s"]]
    summary = {
        "tries": len(tries),
        "ok": sum(t["ok"] for t in tries),
        "one_refused": sum(len(t["refused_after_s"]) == 1 for t in tries),
        "both_ran_one_after_the_other": sum(t["codes"] == [0, 0] for t in tries),
        "mixed_or_duplicated": sum(len(t["writers_in_dataset"]) != 1 or t["duplicates"] > 0
                                   for t in tries),
        "refusal_s": {"median": statistics.median(latencies), "max": max(latencies)}
        if latencies else None,
    }
    print(json.dumps(summary))
    save(args.json, {"summary": summary, "tries": tries})
    return 0 if summary["ok"] == len(tries) else 1


if __name__ == "__main__":
    sys.exit(main())
