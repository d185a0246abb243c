"""Driver memory while assembling the final files: P prompts x 64 candidates of short text.

    python bench/assembly_memory.py --prompts 10000 100000 1000000 \
        --json bench/results/assembly-memory.json [--jsonl] [--src DIR] [--root /tmp/asm-bench]

For each P, writes fake finished shards straight to disk (the very files and records
OutputDir reads: `shards/<id>.{best,candidates}.parquet` + `shards/<id>.json`, 1000 prompts a
shard), then runs `OutputDir.assemble` in a fresh subprocess and reports its memory:
- `held_mb`: RSS once the output is opened, the prompt keys built and the resume worked out,
  before assembly (what the driver holds anyway: the keys as a compact table, the shard
  each prompt comes from, the shard records);
- `assembly_peak_mb`: the peak RSS while `assemble` runs, what is held included (the
  high-water mark is reset just before it, via /proc/self/clear_refs);
- `process_peak_mb`: the subprocess's peak RSS overall (getrusage of the children).
Then loads every file with `datasets.load_dataset("parquet", ...)` (memory-mapped) and checks
its row count. The output spec is the default one (every format; best.jsonl but no other
jsonl twin); `--jsonl` adds the twins, candidates.jsonl included. `--src DIR` runs the
assembly of another copy of the package (e.g. the code before streaming, from
`git archive`), to compare. The data is deleted after each P.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH: --src's package stays the one measured

from bench.results_io import save  # noqa: E402

N = 64  # candidates a prompt
SHARD = 1000  # prompts a shard
FINGERPRINT = "bench"
PROV = {"generator": "fake-gen", "reward_model": "fake-rm", "fingerprint": FINGERPRINT}


def prompt_ids(p: int) -> list[str]:
    return [f"p{i:07d}" for i in range(p)]


def keys_of(ids: list[str]) -> dict[str, dict[str, str]]:
    from specrej_ray.data.output import content_key

    return {pid: content_key(f"Question {pid}?", None, [len(pid)]) for pid in ids}


def driver_keys(ids: list[str]):
    """The keys as the driver holds them: a ContentKeys table built a shard at a time (code
    from before it, e.g. with --src, held a dict per prompt)."""
    try:
        from specrej_ray.data.content_keys import ContentKeys
    except ImportError:
        return keys_of(ids)
    return ContentKeys.concat(ContentKeys.of(keys_of(ids[i : i + SHARD]), indexed=False)
                              for i in range(0, len(ids), SHARD))


def candidates(ids: list[str], rng: np.random.Generator) -> tuple[pa.Table, np.ndarray]:
    """One shard's candidate rows (about half rejected, a tenth truncated, some duplicate
    texts) and each prompt's best candidate."""
    from specrej_ray.data.dataset import CANDIDATE_SCHEMA

    rows = len(ids) * N
    k = np.tile(np.arange(N), len(ids))
    finished = (rng.random(rows) < 0.5) | (k == 0)
    score = np.where(finished, rng.normal(size=rows), np.nan)
    best = np.nanargmax(score.reshape(len(ids), N), axis=1)
    pid = pa.array(np.repeat(np.array(ids, dtype=object), N), pa.string())
    suffix = pa.array([f"answer {j % 48}" for j in range(N)] * len(ids), pa.string())
    reason = np.where(rng.random(rows) < 0.1, "length", "eos")
    partial = pa.StructArray.from_arrays(
        [pa.array(np.full(rows, 8)), pa.array(np.nan_to_num(score) - 1)], ["tokens", "score"])
    empty = pa.StructArray.from_arrays([pa.array([], pa.string()), pa.array([], pa.float64())],
                                       ["name", "score"])
    columns = {
        "prompt_id": pid,
        "candidate": pa.array(k),
        "status": pa.array(np.where(finished, "finished", "rejected")),
        "finish_reason": pa.array(np.where(finished, reason, None), pa.string()),
        "rejected_round": pa.array(np.where(finished, None, 1), pa.int64()),
        "text": pc.binary_join_element_wise(pid, suffix, " "),
        "num_tokens": pa.array(rng.integers(8, 64, rows)),
        "final_score": pa.array(score, pa.float64(), from_pandas=True),
        "partial_scores": pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32)),
                                                   partial),
        "is_best": pa.array(k == np.repeat(best, N)),
        "component_scores": pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)),
                                                     empty),
    }
    table = pa.table([columns[f.name] for f in CANDIDATE_SCHEMA], schema=CANDIDATE_SCHEMA)
    return table, best


def best_rows(ids: list[str], cands: pa.Table, best: np.ndarray) -> list[dict]:
    scores = cands.column("final_score").to_numpy(zero_copy_only=False).reshape(len(ids), N)
    return [
        {"id": pid, "prompt": f"Question {pid}?", "system": None,
         "response": f"{pid} answer {b % 48}", "reward": float(scores[i, b]),
         "messages": [{"role": "user", "content": f"Question {pid}?"},
                      {"role": "assistant", "content": f"{pid} answer {b % 48}"}],
         "finish_reason": "eos", "n": N, "n0": N, "waves": 1, "rounds": 2,
         "prompt_tokens": 5, "tokens_generated": 2000, "candidates_finished": 32,
         "candidates_rejected": 32, "seconds": 1.0}
        for i, (pid, b) in enumerate(zip(ids, best, strict=True))
    ]


def write_fake_output(root: Path, p: int) -> None:
    """manifest.json through OutputDir, then each shard's two files and its record, exactly
    as OutputDir.write_shard lays them out (written directly: 64 M rows through Python dicts
    would take longer than the measurement)."""
    from specrej_ray.data.dataset import BEST_SCHEMA
    from specrej_ray.data.output import SHARDS, OutputDir

    with OutputDir.open(str(root), "overwrite", FINGERPRINT, {}) as outdir:
        outdir._write_header()  # a run writes it with its first shard
    ids = prompt_ids(p)
    rng = np.random.default_rng(0)
    for s in range(0, p, SHARD):
        shard_id, chunk = f"{s // SHARD:05d}", ids[s:s + SHARD]
        cands, best = candidates(chunk, rng)
        files = {}
        for kind, table in (("candidates", cands),
                            ("best", pa.Table.from_pylist(best_rows(chunk, cands, best),
                                                          schema=BEST_SCHEMA))):
            path = root / SHARDS / f"{shard_id}.{kind}.parquet"
            pq.write_table(table, path)
            files[kind] = path.stat().st_size
        record = {"fingerprint": FINGERPRINT, "prompts": keys_of(chunk), "files": files}
        (root / SHARDS / f"{shard_id}.json").write_text(json.dumps(record, indent=1))


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def child(root: str, p: int, jsonl: bool) -> None:
    """The measured process: open the output, build the keys, assemble; JSON on stdout."""
    import specrej_ray
    from specrej_ray.data.output import OutputDir
    from specrej_ray.spec import OutputSpec

    with OutputDir.open(root, "resume", FINGERPRINT, {}) as outdir:
        keys = driver_keys(prompt_ids(p))
        outdir.resume(keys)  # as the driver does before it runs the shards
        held = _status_mb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the assembly's own peak
        start = time.perf_counter()
        made = outdir.assemble(keys, OutputSpec(path=root, jsonl=jsonl), PROV)
        seconds = time.perf_counter() - start
    print(json.dumps({"package": specrej_ray.__file__, "held_mb": held,
                      "assembly_peak_mb": _status_mb("VmHWM"), "seconds": seconds,
                      "counts": made.counts, "files": made.files, "filters": made.filters}))


def check_loads(root: Path, files: list[str], counts: dict[str, int]) -> dict[str, int]:
    """Every parquet file loads with `datasets` (memory-mapped), with the rows it holds."""
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()
    rows = {}
    for name in (f for f in files if f.endswith(".parquet")):
        ds = load_dataset("parquet", data_files=str(root / name), split="train",
                          cache_dir=str(root / ".hf-cache"))
        assert ds.num_rows == pq.ParquetFile(root / name).metadata.num_rows, name
        rows[name] = ds.num_rows
        del ds
    assert rows["best.parquet"] == counts["prompts"], rows
    assert rows["candidates.parquet"] == counts["candidates"], rows
    return rows


def measure(root: Path, p: int, src: str | None, jsonl: bool) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    write_fake_output(root, p)
    setup = time.perf_counter() - start
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run([sys.executable, __file__, "--child", str(root), str(p),
                           str(int(jsonl))], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"assembly of {p} prompts failed:\n{done.stderr}")
    result = json.loads(done.stdout.splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of the children is the largest child so far: valid when it grew (a run with
    # more prompts than the last), else only an upper bound of the earlier one.
    result["process_peak_mb"] = peak / 1024 if peak > before else None
    result["sizes_mb"] = {f: round((root / f).stat().st_size / 2**20, 1)
                          for f in result["files"]}
    result["rows"] = check_loads(root, result["files"], result["counts"])
    shutil.rmtree(root, ignore_errors=True)
    return {"prompts": p, "candidates_per_prompt": N, "jsonl": jsonl, "shard_size": SHARD,
            "setup_seconds": round(setup, 1), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--root", default="/tmp/asm-bench")
    ap.add_argument("--src", help="a copy of the package to measure instead (its parent dir)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--jsonl", action="store_true", help="write the .jsonl twins too")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.child[2] == "1")
    results = []
    for p in sorted(args.prompts):
        results.append(measure(Path(args.root) / str(p), p, args.src, args.jsonl))
        r = results[-1]
        print(f"{p:>9,} prompts: held {r['held_mb']:.0f} MB, assembly peak "
              f"{r['assembly_peak_mb']:.0f} MB, process peak {r['process_peak_mb']} MB, "
              f"{r['seconds']:.1f} s  ({r['package']})", flush=True)
        save(args.json, {"rows": results})


if __name__ == "__main__":
    main()
