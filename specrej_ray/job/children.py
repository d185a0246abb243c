"""The processes this one started, and theirs (a local Ray's GCS, raylet, agents and actors):
asked to end all at once when a stop ends the run. Ray's own shutdown at exit asks them one
by one, waiting up to a second for each, after a pause for its logs. Linux (/proc); elsewhere
there is nothing to list and Ray's shutdown does it."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below root."""
    children: dict[int, list[int]] = {}
    for name in _pids():
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(name))
    found, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            command = command_line(pid)
            if command is not None:
                found[pid] = command
                todo.append(pid)
    return found


def command_line(pid: int) -> str | None:
    """A process's command line, its arguments joined by spaces; None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def state(pid: int) -> str:
    """A process's state letter (R, S, T: stopped, Z: ended), "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    return state(pid) not in ("Z", "")


def end_descendants(grace_s: float) -> list[int]:
    """SIGTERM to every process below this one at once; wait up to grace_s for them to end,
    asking any that appear meanwhile too (a raylet starts its agents as the stop lands: once
    it is gone they are no longer below us, and they outlived the run). Returns those still
    alive (a direct child, e.g. Ray's raylet, is then killed by the kernel as this process
    exits: Ray starts them so)."""
    asked: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        for pid in descendants(os.getpid()).keys() - asked:
            asked.add(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        if not any(alive(p) for p in asked) or time.monotonic() >= deadline:
            return sorted(p for p in asked if alive(p))
        time.sleep(0.05)


def _pids() -> list[str]:
    try:
        return [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc (macOS)
        return []
