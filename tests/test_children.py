"""A stop ends the run's own processes all at once (job/children.py), instead of Ray's
shutdown at exit asking them one by one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from specrej_ray.job.children import alive, command_line
from tests.helpers.runs import REPO

# A parent with a child and a grandchild (as a driver has Ray's raylet and its workers); it
# prints their pids, then what end_descendants left alive.
FAMILY = textwrap.dedent("""
    import os, subprocess, sys, time
    from specrej_ray.job.children import descendants, end_descendants
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    nested = [sys.executable, "-c",
              "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)",
              *sleeper]
    procs = [subprocess.Popen(sleeper), subprocess.Popen(nested)]
    while len(descendants(os.getpid())) < 3:
        time.sleep(0.05)
    print(*descendants(os.getpid()), flush=True)
    print(end_descendants(grace_s=10), flush=True)
""")


@pytest.mark.slow  # processes of its own: a parent, its children and a grandchild
def test_every_process_below_this_one_is_asked_to_end_at_once():
    done = subprocess.run([sys.executable, "-c", FAMILY], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pids, left = done.stdout.splitlines()
    assert len(pids.split()) == 3 and left == "[]"
    assert not [p for p in map(int, pids.split()) if alive(p)]  # the grandchild too


# A child that, asked to end, first starts a process of its own (as a raylet starts its agents
# when the stop lands during Ray's start), then ends a while later; the parent prints the late
# process's pid, then what end_descendants left alive.
LATE = textwrap.dedent("""
    import signal, subprocess, sys, time
    def late(*_):
        spawned = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(spawned.pid, flush=True)
        time.sleep(2)
        sys.exit(0)
    signal.signal(signal.SIGTERM, late)
    print("ready", flush=True)
    time.sleep(60)
""")
LATE_PARENT = textwrap.dedent("""
    import subprocess, sys
    from specrej_ray.job.children import end_descendants
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "ready"
    left = end_descendants(grace_s=10)
    print(child.stdout.readline().strip(), flush=True)
    print(left, flush=True)
""")


@pytest.mark.slow  # processes of its own: a parent, a child, and the child's late process
def test_a_process_started_below_this_one_while_the_rest_end_is_asked_to_end_too():
    done = subprocess.run([sys.executable, "-c", LATE_PARENT, LATE], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    spawned = int(lines[0]) if lines and lines[0].isdigit() else None
    try:
        assert done.returncode == 0, done.stderr
        assert lines[1:] == ["[]"]
        assert spawned is not None and not alive(spawned)
    finally:  # a late process left by a failure: ours only if it still runs our sleeper
        if spawned is not None and "time.sleep(60)" in (command_line(spawned) or ""):
            with contextlib.suppress(ProcessLookupError):
                os.kill(spawned, signal.SIGKILL)
