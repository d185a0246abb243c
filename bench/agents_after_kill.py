"""How long a `specrej-ray run`'s own Ray processes outlive a SIGKILL of the driver.

    python bench/agents_after_kill.py JOB.yaml [--after 4] [--limit 240]

Starts `specrej-ray run JOB --overwrite`, waits until its local Ray has started and
`--after` seconds more (the actors are at work), notes every process under the driver,
SIGKILLs the driver, then polls those processes (zombies count as gone) and prints when
each kind of process ended. Only the killed run's own processes are watched, never those of
another Ray on the machine. Use a job whose output.path may be overwritten.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", type=Path)
    p.add_argument("--after", type=float, default=4.0, help="seconds after Ray started")
    p.add_argument("--limit", type=float, default=240.0, help="seconds to watch at most")
    args = p.parse_args()
    log = Path(tempfile.mkstemp(prefix="specrej-kill-", suffix=".log")[1])
    with open(log, "wb") as out:
        driver = subprocess.Popen([sys.executable, "-m", "specrej_ray.cli", "run",
                                   str(args.job), "--overwrite"], stdout=out,
                                  stderr=subprocess.STDOUT)
    while "Started a local Ray" not in log.read_text(errors="replace"):
        if driver.poll() is not None:
            print(f"the run ended before Ray started; see {log}")
            return 1
        time.sleep(0.1)
    time.sleep(args.after)
    watched = {q.pid: q.name() for q in psutil.Process(driver.pid).children(recursive=True)}
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    killed = time.monotonic()
    gone: dict[int, float] = {}
    while len(gone) < len(watched) and time.monotonic() - killed < args.limit:
        for pid in set(watched) - set(gone):
            if not _alive(pid):
                gone[pid] = time.monotonic() - killed
        time.sleep(0.2)
    for pid, name in sorted(watched.items(), key=lambda kv: gone.get(kv[0], 1e9)):
        when = f"{gone[pid]:6.1f} s" if pid in gone else f"alive after {args.limit:.0f} s"
        print(f"{name:<32} pid {pid:<8} {when}")
    return 0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    sys.exit(main())
