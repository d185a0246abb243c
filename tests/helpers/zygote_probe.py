"""What a process started as `python -m tests.helpers.zygote_probe WHAT` sees and how it ends,
for tests/test_zygote.py: a fork of the zygote must match a fresh interpreter."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

if __name__ == "__main__":
    what = sys.argv[1]
    atexit.register(print, "atexit ran")
    import tests.helpers.zygote_preloaded  # noqa: F401  (its handler runs before ours)
    print(f"argv={sys.argv[1:]} cwd={os.getcwd()} PROBE={os.environ.get('PROBE')} "
          f"own_session={os.getsid(0) == os.getpid()} main={__name__} "
          f"sigterm={signal.getsignal(signal.SIGTERM)} sigint={signal.getsignal(signal.SIGINT)}",
          flush=True)
    print("to stderr", file=sys.stderr)
    if what == "exit":
        sys.exit(int(sys.argv[2]))
    if what == "message":
        sys.exit("a message")
    if what == "raise":
        raise ValueError("boom")
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "wait":
        time.sleep(60)
