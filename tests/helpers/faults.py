"""A callable reward (reward.type: callable) that injects faults, for tests/test_fault_tolerance.py.

It scores like tests.helpers.rewards:vowels, so runs with and without faults are comparable,
and reacts to markers in the prompt text (the reward runs in a reward actor):

- `[exit-reward-once:PATH]`: the reward actor's process exits (os._exit) while scoring, the
  first time only: PATH is created first, so the resubmitted batch is scored normally.
- `[kill-generator-once:PATH]`: SIGKILL the generator actor waiting for these scores (a
  simulated OOM kill in the middle of its shard), the first time only; PATH gets its pid.
- `[kill-generator-always]`: SIGKILL the generator every time it asks for these scores.
- `[hold-until:PATH]`: wait (at most 120 s) until PATH exists, having created PATH.held: a
  shard that stays in flight until the test lets it go (tests/test_signals.py).

The generator is found as the `ray::GeneratorActor...` process that is a sibling of this one
(same raylet parent), so a Ray cluster of another session on the same machine is never touched.
"""

from __future__ import annotations

import os
import re
import signal
import time

_MARK = re.compile(
    r"\[(exit-reward-once|kill-generator-once|kill-generator-always|hold-until)"
    r"(?::([^\]]+))?\]"
)


def score(prompts: list[str], responses: list[str]) -> list[float]:
    for prompt in dict.fromkeys(prompts):
        for kind, path in _MARK.findall(prompt):
            if kind == "kill-generator-always":
                _kill_generators()
            elif kind == "hold-until":
                _hold_until(path)
            elif not os.path.exists(path):
                with open(path, "x") as f:  # first, so the retry finds it
                    if kind == "exit-reward-once":
                        f.close()
                        os._exit(1)
                    f.write(" ".join(map(str, _kill_generators())))
    return [float(sum(ch in "aeiou" for ch in r)) for r in responses]


def _hold_until(path: str, limit_s: float = 120.0) -> None:
    if os.path.exists(path):
        return
    open(path + ".held", "a").close()
    end = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def _kill_generators() -> list[int]:
    killed = []
    for pid in _sibling_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0]
            if title.startswith(b"ray::GeneratorActor"):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except OSError:
            continue  # gone meanwhile
    return killed


def _sibling_pids() -> list[int]:
    parent, me = os.getppid(), os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            out.append(int(name))
    return out
