"""A bench's raw results, written one way: a JSON file holding the figures and, under
`provenance`, where they were measured, from which commit and by which command, so that a
figure quoted in BENCHMARKS.md leads back to its run."""

from __future__ import annotations

import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STARTED = time.strftime("%Y-%m-%dT%H:%M:%S%z")  # a script imports this first thing


def save(path: Path | str | None, result: dict) -> None:
    """`result` and its provenance as JSON at `path`, its folder made; nothing without a path.
    A value JSON cannot hold is written as its text rather than losing the run."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "provenance": provenance()}, indent=1, default=str)
                    + "\n")


@functools.cache
def provenance() -> dict:
    """This process's machine, commit and command (the same for every save of a run)."""
    changes = _git("status", "--porcelain", "--untracked-files=no")
    return {"machine": os.uname().nodename, "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "commit": _git("rev-parse", "HEAD"),
            "dirty": None if changes is None else bool(changes),  # tracked files changed
            "command": shlex.join(["python", *sys.argv]), "started": STARTED}


def _git(*args: str) -> str | None:
    """git's answer in this checkout, or None where there is no git or no repository (a copy
    of the tree on a bare machine)."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
