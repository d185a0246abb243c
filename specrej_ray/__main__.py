"""`specrej-ray` and `python -m specrej_ray`: SIGTERM and SIGINT are a clean stop from the
first line on. The command line's modules take a second or more to load (pyarrow, pydantic,
and then torch, transformers and Ray), and a scheduler's signal may come at any time: before
this, one in those seconds killed the process with no word."""

from __future__ import annotations

import os
import signal
import sys

from specrej_ray.job.interrupt import SIGNALS, Interrupted, exit_code, handling_signals


def main() -> int:
    try:
        with handling_signals():  # `run` and `iterate` install their own inside
            from specrej_ray.cli import main as command

            code = command()
    except Interrupted as e:
        print(f"specrej-ray: stopped by {e}; run the same command again to resume",
              file=sys.stderr)
        code = exit_code(e.signum)
    _done(code)
    return code


def _done(code: int) -> None:
    """The command is over; Ray's atexit shutdown still runs (a second or two). A signal
    then is ignored, the work being done (it was a KeyboardInterrupt traceback from inside
    Ray's shutdown); a second one ends the process at once, with the command's code."""
    def late(signum: int, frame: object) -> None:
        for s in SIGNALS:
            signal.signal(s, lambda *_: os._exit(code))

    for s in SIGNALS:
        signal.signal(s, late)


if __name__ == "__main__":
    sys.exit(main())
