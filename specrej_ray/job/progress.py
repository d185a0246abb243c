"""Run progress: a bar redrawn in place on a terminal, plain lines at most every few seconds
otherwise (job logs and files keep one line per report, never carriage returns)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

BAR_WIDTH = 24


@dataclass(frozen=True)
class Snapshot:
    done: int
    total: int
    elapsed: float  # seconds since this invocation started
    new_prompts: int  # prompts done in this invocation (a resume starts at 0)
    candidates: int
    tokens: int
    bon_tokens: int  # summary.estimate_bon_tokens of the same candidates

    @property
    def eta(self) -> float | None:
        rate = self.new_prompts / self.elapsed if self.elapsed > 0 else 0.0
        return (self.total - self.done) / rate if rate > 0 else None

    @property
    def saved(self) -> int:
        return max(self.bon_tokens - self.tokens, 0)


def duration(seconds: float | None) -> str:
    """'45s', '3m05s', '2h07m'; '?' when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def stats_text(s: Snapshot) -> str:
    rate = s.candidates / s.elapsed if s.elapsed > 0 else 0.0
    share = f" ({100 * s.saved / s.bon_tokens:.0f}%)" if s.bon_tokens else ""
    return (f"{s.done}/{s.total} prompts  {rate:.1f} cand/s  {s.tokens} tokens, "
            f"~{s.saved} saved{share}  elapsed {duration(s.elapsed)}  eta {duration(s.eta)}")


def plain_line(s: Snapshot) -> str:
    return f"[specrej] {stats_text(s)}"


def bar_line(s: Snapshot, width: int = BAR_WIDTH) -> str:
    filled = width * s.done // s.total if s.total else width
    return f"[specrej] [{'#' * filled}{'.' * (width - filled)}] {stats_text(s)}"


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """Counts finished prompts; `close()` writes the last state (and ends the bar's line)."""

    def __init__(self, total_prompts: int, done_prompts: int = 0, stream=None,
                 every_s: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total_prompts
        self.done = done_prompts
        self.start_done = done_prompts
        self.candidates = self.tokens = self.bon_tokens = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_terminal(self.stream)
        self.every_s = every_s
        self.clock = clock
        self.t0 = clock()
        self._last_write: float | None = None
        self._shown = True  # nothing new since the last line
        self._width = 0  # of the bar as last drawn, to blank a longer previous one

    def count_from(self, t: float) -> None:
        """Rates and ETA count from `t` (a time of `clock`): the driver passes when its first
        shard was sent, so starting Ray and loading models does not read as slow generation."""
        self.t0 = t

    def update(self, prompts: int, tokens: int, candidates: int, bon_tokens: int) -> None:
        self.done += prompts
        self.tokens += tokens
        self.candidates += candidates
        self.bon_tokens += bon_tokens
        self._shown = False
        now = self.clock()
        due = self._last_write is None or now - self._last_write >= self.every_s
        if self.tty or due or self.done >= self.total:
            self._write(now)

    def close(self) -> None:
        if not self._shown:
            self._write(self.clock())
        if self.tty and self._width:
            print(file=self.stream, flush=True)
            self._width = 0

    def snapshot(self, now: float | None = None) -> Snapshot:
        now = self.clock() if now is None else now
        return Snapshot(self.done, self.total, now - self.t0, self.done - self.start_done,
                        self.candidates, self.tokens, self.bon_tokens)

    def _write(self, now: float) -> None:
        snap = self.snapshot(now)
        if self.tty:
            text = bar_line(snap)
            self.stream.write("\r" + text.ljust(self._width))
            self.stream.flush()
            self._width = len(text)
        else:
            print(plain_line(snap), file=self.stream, flush=True)
        self._last_write, self._shown = now, True
