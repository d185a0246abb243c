"""`specrej-ray` and `python -m specrej_ray`: SIGTERM and SIGINT are a clean stop from the
first line on. The command line's modules take a second or more to load (pyarrow, pydantic,
and then torch, transformers and Ray), and a scheduler's signal may come at any time: before
this, one in those seconds killed the process with no word."""

from __future__ import annotations

import sys

from specrej_ray.job.interrupt import Interrupted, exit_code, handling_signals


def main() -> int:
    try:
        with handling_signals():  # `run` and `iterate` install their own inside
            from specrej_ray.cli import main as command

            return command()
    except Interrupted as e:
        print(f"specrej-ray: stopped by {e}; run the same command again to resume",
              file=sys.stderr)
        return exit_code(e.signum)


if __name__ == "__main__":
    sys.exit(main())
