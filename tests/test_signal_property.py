"""SIGTERM and SIGINT at seeded random points of a run's life, from process start to exit:
before Ray, while `ray.init` runs, while the actors load, mid-shard, while the dataset is
assembled. Each ends in the clean stop (exit 143 / 130, the stop line, an `interrupted`
record wherever something was kept) or, sent after the run finished, in exit 0; the same
command then resumes to the undisturbed run's dataset (issue 31).

Schedulers (Kubernetes, Slurm, `ray job stop`) send SIGTERM whenever they like: before this,
one in the seconds of `ray.init` met Ray's own handler and the driver exited 15, silently."""

from __future__ import annotations

import json
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import cli, dataset_rows, kill_tree, start_run

POINTS = {signal.SIGTERM: 20, signal.SIGINT: 4}
SEED = 31
AT_ONCE = 2  # runs side by side: each spends much of its life waiting (Ray's start, actors)
# Short: the cost of this test is one process per point, and a run's life is mostly its
# start (imports, Ray, actors), which no job size changes.
PROMPTS = [{"id": f"q{i}", "prompt": f"Tell me about {i}."} for i in range(4)]
REWARD = {"type": "callable", "function": "tests.helpers.rewards:slow_vowels"}
# What the run printed last before the signal, in the order a run prints them.
MILESTONES = {"already done": "prompts loaded", "Started a local Ray instance": "Ray up",
              "/4 prompts": "a shard written", "dataset: ": "finished"}


def _job(prompts: Path, model: Path, out: Path) -> Path:
    """The job, the same spec but for output.path (which its fingerprint leaves out)."""
    job = tiny_job(out.parent, model, prompts, reward=REWARD, cluster={"shard_size": 2},
                   output={"path": str(out)})
    return write_job(out.parent / f"{out.name}.yaml", job)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, tiny_lm_dir):
    """The prompts, and the run without a signal, AT_ONCE runs side by side as the points
    run: how long one lives there, and its dataset (the same from each)."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    prompts = write_jsonl(tmp / "p.jsonl", PROMPTS)

    def run(k: int) -> float:
        job, log = _job(prompts, tiny_lm_dir, tmp / f"out{k}"), tmp / f"run{k}.log"
        t0 = time.monotonic()
        assert start_run(job, log).wait(timeout=300) == 0, log.read_text()
        return time.monotonic() - t0

    with ThreadPoolExecutor(AT_ONCE) as pool:
        life_s = max(pool.map(run, range(AT_ONCE)))
    want = dataset_rows(tmp / "out0")
    assert all(dataset_rows(tmp / f"out{k}") == want for k in range(1, AT_ONCE))
    return prompts, life_s, want


def _signalled(job: Path, log: Path, signum: int, after_s: float) -> int:
    proc = start_run(job, log)
    try:
        time.sleep(after_s)
        if proc.poll() is None:
            proc.send_signal(signum)
        return proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def _milestone(text: str) -> str:
    """How far the run got: the last of its milestones in the log."""
    reached = [name for line, name in MILESTONES.items() if line in text]
    return reached[-1] if reached else "starting"


@pytest.mark.slow  # a CLI process per point
@pytest.mark.timeout(1800)  # 20 processes, each up to a whole run's life
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_at_any_point_stops_cleanly_and_the_resume_is_the_same_dataset(
        tmp_path, tiny_lm_dir, undisturbed, ray_cluster, signum):
    prompts, life_s, want = undisturbed
    name, stopped = signal.Signals(signum).name, 128 + signum
    rng = random.Random(SEED + signum)
    points = sorted(rng.uniform(0, life_s) for _ in range(POINTS[signum]))
    jobs = [_job(prompts, tiny_lm_dir, tmp_path / f"out{k}") for k in range(len(points))]
    logs = [tmp_path / f"run{k}.log" for k in range(len(points))]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        codes = list(pool.map(lambda k: _signalled(jobs[k], logs[k], signum, points[k]),
                              range(len(points))))
    seen = []
    for job, log, at, code in zip(jobs, logs, points, codes, strict=True):
        out = tmp_path / job.stem
        text = log.read_text()
        seen.append((round(at, 2), code, _milestone(text), out.exists()))
        where = f"{name} at {at:.2f} s of {life_s:.1f} s, exit {code}:\n{text}"
        assert "Traceback" not in text and "received at time" not in text, where
        if code == -signum:
            # Before the interpreter ran the command's first line: the OS's default stop
            # (a shell reports 128 + signum); nothing was started or written.
            assert not out.exists() and "specrej-ray" not in text, where
            continue
        assert code in (stopped, 0), where
        if code == stopped:
            assert f"specrej-ray: stopped by {name};" in text, where
            if out.exists():  # something was kept, and the record says why it stopped
                info = json.loads((out / "run.json").read_text())
                assert info["invocations"][-1]["status"] == "interrupted", where
                again = cli("run", job)  # the resume is not the subject: in this process
                assert again.returncode == 0, again.stdout + again.stderr
        assert not out.exists() or dataset_rows(out) == want, where
    print(f"\n{name} points (s, exit, last milestone, output kept): {seen}")
    assert len(seen) == POINTS[signum]
