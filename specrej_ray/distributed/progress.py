"""Progress lines for long runs (plain lines: they read well in terminals and job logs)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_prompts: int, done_prompts: int = 0, stream=sys.stderr) -> None:
        self.total = total_prompts
        self.done = done_prompts
        self.start_done = done_prompts
        self.tokens = 0
        self.t0 = time.monotonic()
        self.stream = stream

    def update(self, prompts: int, tokens: int) -> None:
        self.done += prompts
        self.tokens += tokens
        elapsed = time.monotonic() - self.t0
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        print(
            f"[specrej] {self.done}/{self.total} prompts  {self.tokens} tokens  "
            f"{self.tokens / max(elapsed, 1e-9):.0f} tok/s  elapsed {elapsed:.0f}s  "
            f"eta {eta:.0f}s",
            file=self.stream,
            flush=True,
        )
