"""How fast, and how cleanly, a user's mistake is refused (issue 31): each case run as a user
runs it, `specrej-ray validate JOB` and `specrej-ray run JOB` from a cold process, timed from
start to exit. Reported: the exit code, the seconds, the lines printed, whether the run
started any Ray process (every process below it is watched while it runs) and whether it
left anything at output.path.

    .venv/bin/python bench/refusals.py [--out bench/results/refusals.json]

The model is a tiny random Llama (tests/tiny.py), so what is timed is the tool, not a model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_io import save  # noqa: E402
from tests.helpers.runs import descendants  # noqa: E402
from tests.tiny import save_tiny_lm  # noqa: E402


def _truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _wider(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))


def _no_change(model: Path) -> None:
    pass


# name -> (how the model is spoiled, what the generator section gets, the output path)
CASES: dict[str, tuple[Callable[[Path], None], dict, str | None]] = {
    "truncated model.safetensors": (_truncate, {}, None),
    "config of other weights": (_wider, {}, None),
    "vllm: tensor_parallel_size 3 on a CPU machine": (
        _no_change, {"engine": "vllm", "tensor_parallel_size": 3}, None),
    "vllm: max_model_len 100000000": (
        _no_change, {"engine": "vllm", "vllm": {"max_model_len": 100_000_000}}, None),
    "vllm: engine_kwargs max_num_seqs: abc": (
        _no_change, {"engine": "vllm", "vllm": {"engine_kwargs": {"max_num_seqs": "abc"}}},
        None),
    "output.path empty": (_no_change, {}, ""),
}


def _job(tmp: Path, model: Path, generator: dict, out: str | None) -> Path:
    prompts = tmp / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Say hello."}\n')
    job = {"name": "refusal", "prompts": {"path": str(prompts), "id_field": "id"},
           "generator": {"model": str(model), "threads": 1,
                         "sampling": {"max_new_tokens": 8}, **generator},
           "reward": {"type": "callable", "function": "tests.helpers.rewards:vowels"},
           "search": {"n": 4}, "output": {"path": str(tmp / "out") if out is None else out}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _timed(command: str, job: Path, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    proc = subprocess.Popen([str(REPO / ".venv/bin/specrej-ray"), command, str(job)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    while proc.poll() is None:
        seen |= {c.split()[0].rsplit("/", 1)[-1] for c in descendants(proc.pid).values() if c}
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    stdout, stderr = proc.communicate()
    lines = [x for x in stderr.splitlines() if x.startswith("specrej-ray:")]
    return {"command": command, "exit": proc.returncode, "seconds": round(seconds, 2),
            "lines": lines, "traceback": "Traceback" in stderr,
            "ray_processes": sorted(p for p in seen if "ray" in p or "gcs" in p),
            "left_output": out.exists()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/refusals.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        base = save_tiny_lm(tmp / "tiny-lm")
        for name, (spoil, generator, out) in CASES.items():
            case = tmp / f"case{len(results)}"
            case.mkdir()
            model = Path(shutil.copytree(base, case / "model"))
            spoil(model)
            job = _job(case, model, generator, out)
            for command in ("validate", "run"):
                row = {"case": name, **_timed(command, job, case / "out")}
                results.append(row)
                print(f"{name:<46} {command:<8} exit {row['exit']}  {row['seconds']:5.1f} s  "
                      f"ray: {row['ray_processes'] or 'none'}  left: {row['left_output']}  "
                      f"{row['lines'][-1] if row['lines'] else ''}"[:220], flush=True)
    save(args.out, {"cases": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
