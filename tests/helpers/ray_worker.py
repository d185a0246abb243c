"""A Ray worker process started as a fork of the test zygote (tests/helpers/zygote.py).

Ray's raylet starts every worker as `python default_worker.py ARGS`; a fresh interpreter then
imports Ray, and the actor's module imports torch and transformers: 4 to 6 CPU-seconds a
worker on this machine, paid by ~190 actors and ~140 idle prestarted workers a suite
(docs/testing.md). In the tests' Ray clusters the raylet runs this file instead (Ray's
`worker_path`, set by `use_forked_workers`). It imports nothing heavy: it asks the zygote for
a fork that runs default_worker.py with its arguments, environment, cwd and standard streams,
and stands in for it towards the raylet:

- the fork leads a process group of its own, as the raylet starts every worker;
- its signals go to the fork, and it ends as the fork ends (same exit code, same signal);
- if it is killed (the raylet's SIGKILL before the worker registered), the fork dies with it:
  the fork holds the read end of a pipe only this process writes, and kills itself when that
  pipe closes;
- with no zygote to ask, it execs default_worker.py itself: the worker Ray would have started.

The fork's own pid is what the worker reports to the raylet, so the raylet's kills after
registration reach it directly. The hooks into Ray this takes are zygote_hooks'; where one is
missing, Ray starts its workers itself.
"""

import json
import os
import signal
import socket
import sys

if __package__:
    from tests.helpers import zygote_hooks
else:  # Ray's worker command: this folder is sys.path[0], and the repository may not be
    import zygote_hooks

SOCKET_ENV = "SPECREJ_TEST_ZYGOTE_SOCKET"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def use_forked_workers(warn: bool = True) -> str | None:
    """Make every Ray node this process starts from now on run its workers through this file,
    while a zygote is there to fork them (SOCKET_ENV, set by the workers' zygote's start).
    Where a hook it needs is missing, nothing changes (Ray starts its own workers): that hook,
    named in one line, is returned and (`warn`) warned of."""
    missing = zygote_hooks.worker_hooks_missing()
    if missing is None:
        zygote_hooks.fork_workers(os.path.abspath(__file__),
                                  lambda: bool(os.environ.get(SOCKET_ENV)))
    elif warn:
        zygote_hooks.fall_back(missing, zygote_hooks.WORKERS_FALLBACK)
    return missing


def _exec_fresh(script: str, args: list[str]) -> None:
    """Become the worker Ray would have started."""
    os.execv(sys.executable, [sys.executable, script, *args])


def main() -> int:
    script, args = zygote_hooks.default_worker(), sys.argv[1:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(os.environ[SOCKET_ENV])
    except (KeyError, OSError):
        _exec_fresh(script, args)
    life_r, life_w = os.pipe()  # life_w stays here, never written: it closes when we die
    request = {"script": script, "argv": args, "cwd": os.getcwd(), "env": dict(os.environ),
               "new_session": False,
               # The raylet starts each worker in a process group of its own and ends the
               # worker with its group: the fork must lead one too, or that ends the zygote's
               # group (the test process and all it started).
               "new_group": os.getpgid(0) == os.getpid(),
               # What the raylet left ignored stays so, as for exec.
               "ignored": [int(s) for s in (signal.SIGINT, signal.SIGTERM)
                           if signal.getsignal(s) == signal.SIG_IGN]}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, life_r])
    os.close(life_r)
    pid = json.loads(conn.recv(4096))["pid"]
    if pid is None:  # the zygote's imports would differ from this worker's: a fresh one
        _exec_fresh(script, args)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _: os.kill(pid, s))
    msg = conn.recv(4096)
    if not msg:  # the zygote went away (the test session ended): the fork goes too
        os.kill(pid, signal.SIGKILL)
        return 1
    code = json.loads(msg)["exit"]
    if code < 0:  # died by a signal: so do we
        if -code != signal.SIGKILL:  # whose handler cannot be set (nor needs to be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
