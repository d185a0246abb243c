"""A stop ends the run's own processes all at once (job/children.py), instead of Ray's
shutdown at exit asking them one by one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from specrej_ray.job.children import alive
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
