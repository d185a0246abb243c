"""Ray's start, tried again when it times out (an overloaded machine: "The current node timed
out during startup ... the GCS has become overloaded"), then one line and exit 1; and a stop
while Ray starts, acted on at once (issue 44, points 4 and 6)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from specrej_ray.distributed import cluster
from specrej_ray.distributed.cluster import (
    START_BACKOFF_S,
    START_LIMIT_S,
    START_TRIES,
    is_start_timeout,
    start_with_retries,
)
from specrej_ray.errors import JobError
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import cli, cli_env, command_line, in_group, start_run, wait_for
from tests.helpers.stuck_start import STUCK
from tests.helpers.zygote import launch

# What Ray 2.60 raises when its node does not come up in time (ray/_private/node.py).
RAY_TIMEOUT = Exception("The current node timed out during startup. This could happen because "
                        "some of the raylet failed to startup or the GCS has become overloaded.")


class FlakyStart:
    """A start that times out `fails` times, then succeeds; the clock moves `takes_s` a try."""

    def __init__(self, fails: int, error: Exception = RAY_TIMEOUT, takes_s: float = 1.0):
        self.fails, self.error, self.takes_s = fails, error, takes_s
        self.tries, self.now, self.sleeps, self.began = 0, 0.0, [], []

    def __call__(self) -> None:
        self.tries += 1
        self.began.append(self.now)
        self.now += self.takes_s
        if self.tries <= self.fails:
            raise self.error

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


@pytest.fixture
def shutdowns(monkeypatch) -> list[int]:
    """ray.shutdown, counted instead of run: a failed start's leftovers are cleared each time."""
    calls: list[int] = []
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: calls.append(1))
    return calls


def _start(flaky: FlakyStart) -> None:
    start_with_retries(flaky, "the local Ray did not start", "do this",
                       sleep=flaky.sleep, clock=flaky.clock)


def test_a_start_that_times_out_is_tried_again_after_a_growing_pause(shutdowns):
    flaky = FlakyStart(fails=START_TRIES - 1)
    _start(flaky)
    assert flaky.tries == START_TRIES
    assert flaky.sleeps == [START_BACKOFF_S * 2**k for k in range(START_TRIES - 1)]
    assert len(shutdowns) == START_TRIES - 1  # each failed start cleared before the next


def test_a_start_that_keeps_timing_out_ends_in_one_line_naming_cause_and_remedy(shutdowns):
    flaky = FlakyStart(fails=99)
    with pytest.raises(JobError) as e:
        _start(flaky)
    assert flaky.tries == START_TRIES and len(flaky.sleeps) == START_TRIES - 1
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"the local Ray did not start in {START_TRIES} tries over ")
    assert "(the last said: The current node timed out during startup." in message
    assert message.endswith("; do this")


@pytest.mark.parametrize("takes", [0.98, 0.5, 0.3])
def test_no_try_begins_past_the_limit(shutdowns, takes):
    """Tries that each take long (Ray itself waits 30 s for its raylet) end the retries
    before START_LIMIT_S: every try began within it, and the next would have begun past it."""
    flaky = FlakyStart(fails=99, takes_s=START_LIMIT_S * takes)
    with pytest.raises(JobError):
        _start(flaky)
    assert all(began <= START_LIMIT_S for began in flaky.began), flaky.began
    next_pause = START_BACKOFF_S * 2 ** (flaky.tries - 1)
    assert flaky.tries == START_TRIES or flaky.now + next_pause > START_LIMIT_S
    assert flaky.tries == {0.98: 1, 0.5: 2, 0.3: 3}[takes]


def test_another_failure_is_not_tried_again(shutdowns):
    flaky = FlakyStart(fails=1, error=ValueError("bad argument"))
    with pytest.raises(ValueError, match="bad argument"):
        _start(flaky)
    assert flaky.tries == 1 and flaky.sleeps == [] and shutdowns == []


@pytest.mark.parametrize("error, timeout", [
    (RAY_TIMEOUT, True),
    (TimeoutError("Timed out after 30 seconds while waiting for node to startup."), True),
    (ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"), False),
    (RuntimeError("Unknown keyword argument(s): foo"), False),
])
def test_what_counts_as_a_start_that_timed_out(error, timeout):
    assert is_start_timeout(error) is timeout


def test_run_whose_ray_never_starts_exits_1_in_one_line(tmp_path, tiny_lm_dir, monkeypatch,
                                                        shutdowns):
    """The whole run, Ray's start failing as under load: no traceback (it was 40 lines), one
    line naming the cause and a remedy, exit 1 (infrastructure), no folder left."""
    starts = []

    def times_out(**kwargs):
        starts.append(kwargs)
        raise RAY_TIMEOUT

    monkeypatch.setattr(cluster, "start_local_ray", times_out)
    monkeypatch.setattr(cluster, "START_BACKOFF_S", 0.0)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)  # this process's Ray
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    done = cli("run", write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir, prompts)))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("specrej-ray:")]
    assert line.startswith(f"specrej-ray: job failed: the local Ray did not start in "
                           f"{START_TRIES} tries over "), line
    assert "GCS has become overloaded" in line and "`ray start --head`" in line
    assert len(starts) == START_TRIES and len(shutdowns) == START_TRIES
    assert not (tmp_path / "out").exists()


# --- a stop while Ray starts -------------------------------------------------------------


@pytest.mark.slow  # the CLI's own process, signalled while its Ray starts
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_ray_starts_cuts_the_start_short(tmp_path, tiny_lm_dir, signum):
    """The signal lands as Ray starts (right after the line printed before it): the run
    stops without waiting for Ray to be up (it waited, 15-23 s on a loaded machine), exits
    143 / 130, leaves no folder and none of its processes."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    job_path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir, prompts))
    log = tmp_path / "run.log"
    proc = start_run(job_path, log)
    try:
        wait_for(lambda: "to generate in" in log.read_text(), proc, log,
                 "the line before Ray's start", limit_s=120)
        proc.send_signal(signum)
        code = proc.wait(timeout=60)  # a hang guard, not a timing
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    name = signal.Signals(signum).name
    assert code == 128 + signum, text
    assert f"specrej-ray: stopped by {name}; no prompt had finished" in text
    assert "Traceback" not in text
    assert "Started a local Ray instance" not in text, text  # cut short, not waited for
    assert not (tmp_path / "out").exists()
    deadline = time.monotonic() + 30  # Ray's processes end a moment after the driver
    while in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = in_group(proc.pid)
    assert not left, {p: command_line(p) for p in left}


@pytest.mark.slow  # the CLI's own process, its Ray start stuck
def test_a_stop_acts_while_ray_starts_in_a_call_no_signal_cuts_short(tmp_path, tiny_lm_dir):
    """Under load Ray's start waits seconds for its GCS inside C calls that a signal does
    not interrupt: on the main thread no handler ran until they returned (a stop took 5.7 s).
    Here the start blocks signals on its thread and sleeps 10 minutes: the stop still acts,
    exit 143, no folder left. On the main thread it would wait out the sleep."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    job_path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir, prompts))
    log = tmp_path / "run.log"
    with open(log, "wb") as f:
        proc = launch([sys.executable, "-m", "tests.helpers.stuck_start", str(job_path)],
                      env=cli_env(), stdout=f, stderr=subprocess.STDOUT,
                      start_new_session=True)
    try:
        wait_for(lambda: STUCK in log.read_text(), proc, log, "the stuck start", limit_s=120)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)  # a hang guard: stuck, the stop would take 10 minutes
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 143, text
    assert "specrej-ray: stopped by SIGTERM; no prompt had finished" in text
    assert "Traceback" not in text and "SIGTERM handler is not set" not in text, text
    assert not (tmp_path / "out").exists()
