"""Runs of `python -m specrej_ray run` in a subprocess, and what they leave behind:
for the tests that stop the driver (tests/test_fault_tolerance.py, tests/test_signals.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from specrej_ray.job.children import (  # noqa: F401 - for the tests
    alive,
    command_line,
    descendants,
    state,
)
from tests.helpers.zygote import launch

REPO = Path(__file__).resolve().parents[2]


def run_command(job_path: Path, command: str = "run") -> list[str]:
    return [sys.executable, "-m", "specrej_ray", command, str(job_path)]


@dataclass
class Done:
    """What a CLI invocation ended with, as subprocess.CompletedProcess has it."""

    returncode: int
    stdout: str
    stderr: str


def cli(*argv) -> Done:
    """`specrej-ray ARGV` through its main() in this process, output and exit code captured:
    for the tests where the process is not what they test. A run uses the process's Ray (the
    shared cluster: take the ray_cluster fixture), so it pays no interpreter, import or Ray
    start."""
    from specrej_ray.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors
            code = e.code if isinstance(e.code, int) else 1
    return Done(code, out.getvalue(), err.getvalue())


def cli_env() -> dict[str, str]:
    """The environment without RAY_ADDRESS: the run starts its own local Ray."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def start_run(job_path: Path, log: Path, command: str = "run",
              fork: bool = True) -> subprocess.Popen:
    """The CLI run (or `command`) in its own session (its process group is ours to kill),
    output to log; a fork of the test zygote unless fork=False (tests/helpers/zygote.py)."""
    with open(log, "wb") as f:
        return launch(run_command(job_path, command), cwd=REPO, env=cli_env(), stdout=f,
                      stderr=subprocess.STDOUT, start_new_session=True, fork=fork)


def phase_lengths(proc: subprocess.Popen, log: Path,
                  phases: dict[str, str | None]) -> dict[str, float]:
    """Seconds each phase of the process just started lasted: a phase starts when its line
    first shows in the log (None: the process's start) and ends where the next one starts,
    or at the exit. Fails with the log if the run fails or a phase never starts."""
    t0, starts = time.monotonic(), {}
    while len(starts) < len(phases):
        done, text = proc.poll() is not None, log.read_text()
        for phase, line in phases.items():
            if phase not in starts and (line is None or line in text):
                starts[phase] = time.monotonic() - t0
        if done:
            break
        time.sleep(0.05)
    assert proc.wait() == 0 and starts.keys() == phases.keys(), log.read_text()
    ends = [*list(starts.values())[1:], time.monotonic() - t0]
    return {phase: end - at for (phase, at), end in zip(starts.items(), ends, strict=True)}


def wait_for(condition, proc: subprocess.Popen, log: Path, what: str, limit_s: float = 60):
    """Poll until condition() holds while proc runs; fail with the run's log otherwise."""
    deadline = time.monotonic() + limit_s
    while not condition() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()}"
    assert condition(), f"not {what} within {limit_s:.0f} s:\n{log.read_text()}"


def dataset_rows(out: Path) -> tuple[list[dict], list[dict]]:
    """best.parquet without its wall-clock column, and candidates.parquet."""
    best = [{k: v for k, v in r.items() if k != "seconds"}
            for r in pq.read_table(out / "best.parquet").to_pylist()]
    return best, pq.read_table(out / "candidates.parquet").to_pylist()


def shard_records(out: Path) -> dict[str, list[str]]:
    """Shard id -> its prompt ids, for every shard whose record is written (output.py)."""
    shards = {}
    for record in sorted((out / "shards").glob("*.json")) if (out / "shards").is_dir() else []:
        try:
            shards[record.stem] = list(json.loads(record.read_text())["prompts"])
        except (OSError, ValueError, KeyError):  # being replaced right now
            continue
    return shards


def finished_shards(out: Path) -> int:
    return len(shard_records(out))


def in_group(pgid: int) -> list[int]:
    """Live processes of a process group (a run started in a session of its own: its Ray's
    processes stay in it unless they start sessions of their own)."""
    found = []
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pgid and alive(pid):
                found.append(pid)
    return found


def kill_tree(proc: subprocess.Popen, deadline_s: float = 20.0) -> dict[int, str]:
    """SIGKILL the driver's process group, then anything it started that left the group
    (by pid: only our own processes); wait until all of them are gone."""
    tree = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=deadline_s)
    end = time.monotonic() + deadline_s
    while any(alive(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.1)
    left = {p: c for p, c in tree.items() if alive(p)}
    assert not left, f"processes of the killed run are still alive: {left}"
    return tree
