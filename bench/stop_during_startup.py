"""How fast a stop during start-up ends `specrej-ray run` (issue 44, point 6): a tiny job run
cold, signalled at random points between the process's start and its first finished prompt,
each point timed from the signal to the process's exit.

    .venv/bin/python bench/stop_during_startup.py [--points 10] [--signals TERM,INT]
        [--seed 44] [--limit-s 5] [--out bench/results/stop_during_startup.json]

First one undisturbed run gives the start-up's length (process start to the first shard
record on disk); then, per signal, --points runs each signalled at a seeded uniform point in
it. A point reports the delay to exit, the exit code, whether the output folder was left
behind (the run finished no prompt on a path it created: it must not be), whether a
traceback was printed, and whether a prompt had finished before the signal after all (the
start-up varies run to run: such a point is a stop mid-run, not one during start-up). Exits
1 unless every start-up point exits with 128 + signum within --limit-s and leaves no folder.

The model is a tiny random Llama (tests/tiny.py) as generator and likelihood reward: what
is timed is the tool's start and stop, not a model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.runs import in_group  # noqa: E402
from tests.tiny import save_tiny_lm  # noqa: E402

PROMPTS = 4
HANG_S = 120.0  # a run that has not exited this long after its signal is reported as hung


def make_job(tmp: Path, model: Path, k: int) -> tuple[Path, Path]:
    """The k-th run's job spec and output path (each run its own, created by the run)."""
    prompts = tmp / "p.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Tell me about {i}."})
                                   + "\n" for i in range(PROMPTS)))
    out = tmp / f"out{k}"
    job = {"name": "stop", "prompts": {"path": str(prompts), "id_field": "id"},
           "generator": {"model": str(model), "threads": 1, "sampling": {"max_new_tokens": 12}},
           "reward": {"type": "lm_likelihood", "model": str(model), "threads": 1},
           "search": {"n": 6, "alpha": 0.5, "schedule": {"tokens": [4, 8]}},
           "cluster": {"shard_size": 2}, "output": {"path": str(out)}}
    path = tmp / f"job{k}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path, out


def start(job: Path, log: Path) -> subprocess.Popen:
    """`specrej-ray run JOB` from this tree, in a session of its own, as a user starts it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "specrej_ray", "run", str(job)],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def first_prompt_done(out: Path) -> bool:
    """A shard record on disk: the first prompts finished (data/output.py writes it last)."""
    shards = out / "shards"
    return shards.is_dir() and any(shards.glob("*.json"))


def clean_up(proc: subprocess.Popen, grace_s: float = 0.0) -> list[str]:
    """Whatever of the run is still alive `grace_s` after it ended (Ray's processes end with
    the driver, a moment after it), killed; returns their command lines."""
    deadline = time.monotonic() + grace_s
    while in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [command_line(pid) for pid in in_group(proc.pid)]
    if proc.poll() is None or left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return left


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return f"pid {pid}"


def undisturbed(job: Path, out: Path, log: Path) -> float:
    """Seconds from the process's start to its first finished prompt; the run completes."""
    t0 = time.monotonic()
    proc = start(job, log)
    first = None
    while proc.poll() is None:
        if first is None and first_prompt_done(out):
            first = time.monotonic() - t0
        time.sleep(0.02)
    clean_up(proc)
    if proc.returncode != 0 or first is None:
        sys.exit(f"the undisturbed run failed (exit {proc.returncode}):\n{log.read_text()}")
    return first


def signalled(job: Path, out: Path, log: Path, signum: int, at_s: float) -> dict:
    """The run, sent `signum` `at_s` seconds after its start: how long it took to exit."""
    proc = start(job, log)
    time.sleep(max(0.0, at_s - 0.005))
    late = first_prompt_done(out)  # a prompt finished already: a stop mid-run
    sent = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        code = proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        code = None
    delay = time.monotonic() - sent
    left = clean_up(proc, grace_s=5.0)
    text = log.read_text(errors="replace")
    return {"signal": signal.Signals(signum).name, "at_s": round(at_s, 2),
            "exit_s": round(delay, 2), "code": code, "folder_left": out.exists(),
            "traceback": "Traceback" in text, "ray_started": "Started a local Ray" in text,
            "processes_left": left, "prompt_done_before_signal": late}


def verdict(row: dict, limit_s: float) -> bool:
    want = 128 + int(getattr(signal, row["signal"]))
    return (row["code"] == want and row["exit_s"] <= limit_s and not row["folder_left"]
            and not row["traceback"] and not row["processes_left"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=10, help="signalled runs per signal")
    parser.add_argument("--signals", default="TERM,INT", help="which, e.g. TERM or TERM,INT")
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--limit-s", type=float, default=5.0, help="the target, seconds")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/stop_during_startup.json")
    args = parser.parse_args()
    signums = [getattr(signal, "SIG" + s.strip().upper()) for s in args.signals.split(",")]
    rng = random.Random(args.seed)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="stop-startup-") as tmp_dir:
        tmp = Path(tmp_dir)
        model = save_tiny_lm(tmp / "tiny-lm")
        job, out = make_job(tmp, model, 0)
        startup_s = undisturbed(job, out, tmp / "run0.log")
        print(f"start-up (process start to the first finished prompt): {startup_s:.2f} s",
              flush=True)
        for signum in signums:
            for _ in range(args.points):
                k = len(rows) + 1
                job, out = make_job(tmp, model, k)
                row = signalled(job, out, tmp / f"run{k}.log", signum, rng.uniform(0, startup_s))
                row["ok"] = verdict(row, args.limit_s)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if not row["ok"]:
                    print((tmp / f"run{k}.log").read_text(errors="replace")[-3000:], flush=True)
    during = [r for r in rows if not r["prompt_done_before_signal"]]
    passed = sum(r["ok"] for r in during)
    worst = max((r["exit_s"] for r in during), default=0.0)
    print(f"{passed} of {len(during)} start-up points stopped cleanly within {args.limit_s:g} s "
          f"(slowest {worst:.2f} s); {len(rows) - len(during)} point(s) came after a prompt "
          "had finished", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(),
                                    "load_average": os.getloadavg(), "startup_s": startup_s,
                                    "limit_s": args.limit_s, "points": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0 if passed == len(during) else 1


if __name__ == "__main__":
    sys.exit(main())
