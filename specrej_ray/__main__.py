"""`specrej-ray` and `python -m specrej_ray`: SIGTERM and SIGINT are a clean stop from the
first line on. The command line's modules take a second or more to load (pyarrow, pydantic,
and then torch, transformers and Ray), and a scheduler's signal may come at any time: before
this, one in those seconds killed the process with no word."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

from specrej_ray.job.children import end_descendants
from specrej_ray.job.interrupt import SIGNALS, Interrupted, exit_code, handling_signals


def main() -> int:
    # Registered before Ray's, so it runs after Ray's shutdown, last.
    atexit.register(_exit_now)
    try:
        with handling_signals():  # `run` and `iterate` install their own inside
            from specrej_ray.cli import main as command

            code = command()
    except Interrupted as e:
        print(f"specrej-ray: stopped by {e}; run the same command again to resume",
              file=sys.stderr)
        code = exit_code(e.signum)
    except SystemExit as e:  # argparse: a usage error (2), --help (0)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    _done(code)
    if code in STOPPED:
        # A stop: what is finished is written and the output released. Ray's shutdown at
        # exit took seconds on a loaded machine (a pause for its logs, then each of its
        # processes asked to end in turn): the run's own Ray processes are asked at once
        # instead, and a cluster drops the job's actors when its driver goes. Ray's threads
        # in this process (its log printer) then fail on the calls cut short: that is the
        # ending, said already in the stop line, not a traceback for the user.
        threading.excepthook = _quiet_about_ray(threading.excepthook)
        end_descendants(STOP_GRACE_S)
        _exit_now()
    return code


def _done(code: int) -> None:
    """The command is over; Ray's atexit shutdown still runs (a second or two). A signal
    then is ignored, the work being done (it was a KeyboardInterrupt traceback from inside
    Ray's shutdown); a second one ends the process at once, with the command's code."""
    def late(signum: int, frame: object) -> None:
        for s in SIGNALS:
            signal.signal(s, lambda *_: os._exit(code))

    global _code
    _code = code
    for s in SIGNALS:
        signal.signal(s, late)


def _quiet_about_ray(previous: Callable[[threading.ExceptHookArgs], object]):
    """A thread-exception hook for after a stop: an error Ray raised (its module ray.*) is
    Ray's processes ending, and says nothing; any other goes to `previous`, as it would."""
    def hook(args: threading.ExceptHookArgs) -> None:
        if not getattr(args.exc_type, "__module__", "").startswith("ray."):
            previous(args)

    return hook


_code = 1
STOPPED = frozenset(exit_code(s) for s in SIGNALS)  # 143, 130
STOP_GRACE_S = 1.0  # for the run's own processes to end on a stop; the kernel ends the rest


def _exit_now() -> None:
    """The last exit handler: the output is written and Ray is shut down, so the process
    ends here, with the command's code. The interpreter's own teardown after this took 3 s
    here (torch, transformers and Ray's modules freed one by one), and it puts SIGTERM and
    SIGINT back to the OS's default first: a signal then killed a finished run (exit -15)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(_code)


if __name__ == "__main__":
    sys.exit(main())
