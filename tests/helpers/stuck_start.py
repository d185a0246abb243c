"""`python -m tests.helpers.stuck_start JOB`: `specrej-ray run JOB` whose local Ray start is
stuck where a signal cannot cut it short, as Ray's own waits for the GCS it started are under
load (C calls, seconds long): the thread that runs the start blocks SIGTERM and SIGINT, says
so, and sleeps. A stop must act at once all the same (tests/test_ray_start.py)."""

from __future__ import annotations

import signal
import sys
import time

from specrej_ray.distributed import cluster
from specrej_ray.job.interrupt import SIGNALS

STUCK = "[stuck-start] Ray's start is stuck"


def stuck(**kwargs) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    print(STUCK, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    cluster.start_local_ray = stuck
    from specrej_ray.__main__ import main

    sys.argv = ["specrej-ray", "run", sys.argv[1]]
    sys.exit(main())
