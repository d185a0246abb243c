"""How fast, and how cleanly, a user's mistake is refused (issues 31 and 44): each case run as
a user runs it, `specrej-ray validate JOB` and `specrej-ray run JOB` from a cold process
(`python -m specrej_ray`, this checkout's code), timed from start to exit. Reported: the exit
code, the seconds, the lines printed, whether the run started any Ray process (every process
below it is watched while it runs), whether it imported torch or transformers (`-X
importtime`) and whether it left anything at output.path.

    .venv/bin/python bench/refusals.py [--out bench/results/refusals.json]
        [--only models|prompts] [--big-mb 100]

The model is a tiny random Llama (tests/tiny.py), so what is timed is the tool, not a model.
The prompt-file cases (issue 44's target: each refused in at most 2 s, torch not imported)
include files of --big-mb MB: binary garbage, rows without a prompt, one line, not UTF-8,
and a CSV without the prompt column.
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


MB = 1 << 20


def _garbage(path: Path, size: int) -> None:
    """Random bytes, written a MB at a time (a file of any size in flat memory)."""
    with open(path, "wb") as f:
        for _ in range(size // MB):
            f.write(os.urandom(MB))


def _repeated(line: bytes) -> Callable[[Path, int], None]:
    def write(path: Path, size: int) -> None:
        block = line * max(1, MB // len(line))
        with open(path, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
    return write


def _one_line(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.write(b'{"prompt": "')
        for _ in range(size // MB):
            f.write(b"x" * MB)


def _csv_without_prompt(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.write(b"id,text\n")
        block = b"a,some text that is no prompt column\n" * (MB // 37)
        for _ in range(size // len(block)):
            f.write(block)


def _folder(path: Path, size: int) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("not a dataset")


def _write(data: bytes) -> Callable[[Path, int], None]:
    return lambda path, size: path.write_bytes(data)


# name -> (the file's name, how it is written given --big-mb's bytes)
PROMPT_CASES: dict[str, tuple[str, Callable[[Path, int], None]]] = {
    "prompts: an empty file": ("p.jsonl", _write(b"")),
    "prompts: binary garbage, 1 MB": ("p.jsonl", lambda p, size: _garbage(p, MB)),
    "prompts: a single 5 MB line": ("p.jsonl", lambda p, size: _one_line(p, 5 * MB)),
    "prompts: invalid UTF-8": ("p.jsonl", _write(b'{"prompt": "\xff\xfe"}\n' * 1000)),
    "prompts: a folder": ("folder", _folder),
    "prompts: a CSV without the prompt column": ("p.csv", _write(b"id,text\na,hi\n")),
    "prompts: a parquet file that is not one": ("p.parquet", lambda p, size: _garbage(p, MB)),
    "prompts: BIG binary garbage": ("p.jsonl", _garbage),
    "prompts: BIG rows without a prompt": ("p.jsonl", _repeated(b'{"text": "no prompt"}\n')),
    "prompts: BIG invalid UTF-8": ("p.jsonl", _repeated(b'{"prompt": "\xff\xfe"}\n')),
    "prompts: BIG single line": ("p.jsonl", _one_line),
    "prompts: BIG CSV without the prompt column": ("p.csv", _csv_without_prompt),
}


def _job(tmp: Path, model: Path, generator: dict, out: str | None,
         prompts: Path | None = None) -> Path:
    if prompts is None:
        prompts = tmp / "p.jsonl"
        prompts.write_text('{"id": "a", "prompt": "Say hello."}\n')
    job = {"name": "refusal", "prompts": {"path": str(prompts)},
           "generator": {"model": str(model), "threads": 1,
                         "sampling": {"max_new_tokens": 8}, **generator},
           "reward": {"type": "callable", "function": "tests.helpers.rewards:vowels"},
           "search": {"n": 4}, "output": {"path": str(tmp / "out") if out is None else out}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _timed(command: str, job: Path, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "specrej_ray", command,
                             str(job)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    while proc.poll() is None:
        seen |= {c.split()[0].rsplit("/", 1)[-1] for c in descendants(proc.pid).values() if c}
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    stdout, stderr = proc.communicate()
    lines = [x for x in stderr.splitlines() if x.startswith("specrej-ray:")]
    imported = {x.rsplit("|", 1)[-1].strip() for x in stderr.splitlines()
                if x.startswith("import time:")}
    return {"command": command, "exit": proc.returncode, "seconds": round(seconds, 2),
            "lines": lines, "traceback": "Traceback" in stderr,
            "heavy_imports": sorted(imported & {"torch", "transformers", "datasets", "vllm"}),
            "ray_processes": sorted(p for p in seen if "ray" in p or "gcs" in p),
            "left_output": out.exists()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/refusals.json")
    parser.add_argument("--only", choices=("models", "prompts"),
                        help="only the model, vLLM and output cases, or only the prompt files")
    parser.add_argument("--big-mb", type=int, default=100,
                        help="size of the BIG prompt files in MB (default 100)")
    args = parser.parse_args()
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        base = save_tiny_lm(tmp / "tiny-lm")
        cases = []
        for name, (spoil, generator, out) in (CASES if args.only != "prompts" else {}).items():
            case = tmp / f"case{len(cases)}"
            case.mkdir()
            model = Path(shutil.copytree(base, case / "model"))
            spoil(model)
            cases.append((name, case, _job(case, model, generator, out)))
        for name, (file, write) in (PROMPT_CASES if args.only != "models" else {}).items():
            case = tmp / f"case{len(cases)}"
            case.mkdir()
            write(case / file, args.big_mb * MB)
            cases.append((name.replace("BIG", f"{args.big_mb} MB"), case,
                          _job(case, base, {}, None, case / file)))
        for name, case, job in cases:
            for command in ("validate", "run"):
                row = {"case": name, **_timed(command, job, case / "out")}
                results.append(row)
                print(f"{name:<46} {command:<8} exit {row['exit']}  {row['seconds']:5.1f} s  "
                      f"heavy: {','.join(row['heavy_imports']) or 'none'}  "
                      f"ray: {row['ray_processes'] or 'none'}  left: {row['left_output']}  "
                      f"{row['lines'][-1] if row['lines'] else ''}"[:240], flush=True)
            shutil.rmtree(case)  # the big files go as soon as they are timed
    save(args.out, {"cases": results, "load_at_end": os.getloadavg()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
