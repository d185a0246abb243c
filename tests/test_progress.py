"""Progress output: the bar on a terminal, throttled plain lines elsewhere (no Ray)."""

from __future__ import annotations

import io

from specrej_ray.job.progress import Progress, Snapshot, duration, is_terminal, stats_text


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (None, 0, 44.6, 65, 3599, 3600, 7620)] == [
        "?", "0s", "45s", "1m05s", "59m59s", "1h00m", "2h07m"]


def test_stats_name_prompts_rate_savings_and_eta():
    snap = Snapshot(done=30, total=100, elapsed=20.0, new_prompts=10, candidates=160,
                    tokens=600, bon_tokens=1000)
    text = stats_text(snap)
    assert "30/100 prompts" in text
    assert "8.0 cand/s" in text  # 160 candidates in 20 s
    assert "600 tokens, ~400 saved (40%)" in text
    assert "eta 2m20s" in text  # 70 prompts left at 0.5 prompts/s (this invocation's rate)
    assert "eta ?" in stats_text(Snapshot(0, 10, 5.0, 0, 0, 0, 0))  # no rate yet


def test_the_stream_decides_bar_or_lines():
    class Closed(io.StringIO):
        def isatty(self):
            raise ValueError("I/O operation on closed file")

    assert is_terminal(FakeTerminal()) and not is_terminal(io.StringIO())
    assert not is_terminal(Closed()) and not is_terminal(object())


def test_plain_lines_are_throttled_with_one_at_the_end():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(10, stream=stream, every_s=30.0, clock=clock)
    for step in range(4):  # at 101, 106, 111, 116: only the first is due
        clock.now += 1.0 if step == 0 else 5.0
        progress.update(1, 50, 4, 80)
    assert stream.getvalue().count("\n") == 1
    clock.now = 131.5  # 30.5 s after the first line
    progress.update(1, 50, 4, 80)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("[specrej] 5/10 prompts")
    clock.now += 1.0
    progress.update(2, 100, 8, 160)  # throttled
    progress.close()  # the last state is written once, at the end
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[2].startswith("[specrej] 7/10 prompts")
    assert "350 tokens, ~210 saved (38%)" in lines[2]
    assert "\r" not in stream.getvalue()


def test_the_last_prompt_is_always_reported():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(4, done_prompts=2, stream=stream, every_s=1e9, clock=clock)
    clock.now += 1.0
    progress.update(1, 10, 2, 10)
    clock.now += 1.0
    progress.update(1, 10, 2, 10)  # done == total: written although throttled
    progress.close()  # nothing new: no extra line
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["3/4", "4/4"]


def test_rates_count_from_the_first_shard_not_from_startup():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(4, stream=stream, clock=clock)
    clock.now += 60.0  # Ray and the models start
    progress.count_from(clock.now)
    clock.now += 10.0
    progress.update(2, 100, 20, 100)
    assert "2.0 cand/s" in stream.getvalue() and "eta 10s" in stream.getvalue()


def test_a_terminal_gets_one_line_redrawn_in_place():
    stream, clock = FakeTerminal(), Clock()
    progress = Progress(4, stream=stream, every_s=1e9, clock=clock)
    for _ in range(2):
        clock.now += 2.0
        progress.update(1, 20, 3, 30)
    out = stream.getvalue()
    assert out.count("\r") == 2 and "\n" not in out  # every update redraws, none scrolls
    assert "[######......" in out.split("\r")[1]  # 1/4 of a 24-wide bar
    assert "[############" in out.split("\r")[2]
    progress.close()
    assert stream.getvalue().endswith("\n") and stream.getvalue().count("\n") == 1
