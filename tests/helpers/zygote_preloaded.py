"""A module the test zygote preloads that registers an exit handler when imported, as torch,
pyarrow and Ray do: tests/test_zygote.py checks that it runs where it would in a fresh
interpreter (before the command's own first handler). It prints only in the probe's
processes (PROBE set), not in every forked run's output."""

import atexit
import os


def _said() -> None:
    if os.environ.get("PROBE"):
        print("a preloaded module's exit handler ran")


atexit.register(_said)
