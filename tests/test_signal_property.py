"""SIGTERM and SIGINT at seeded random points in each phase of a run's life, from process
start to exit: before Ray, while `ray.init` runs, while the actors load, mid-shard, while the
dataset is assembled, after. Each ends in the clean stop (exit 143 / 130, the stop line, an
`interrupted` record wherever something was kept) or, sent after the run finished, in exit 0;
the same command then resumes to the undisturbed run's dataset (issue 31).

Schedulers (Kubernetes, Slurm, `ray job stop`) send SIGTERM whenever they like: before this,
one in the seconds of `ray.init` met Ray's own handler and the driver exited 15, silently."""

from __future__ import annotations

import json
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import cli, dataset_rows, kill_tree, phase_lengths, start_run

# Points in each phase of a run's life (PHASES): a phase of a few seconds (the shards, the
# assembly) gets as many as the start's long ones, which uniform points over the whole life
# missed (20 of them, 9 after the run had finished; CI, 2026-11-26). Issue 31 asks for at
# least 20 SIGTERM points, and fewer SIGINT ones.
PER_PHASE = {signal.SIGTERM: 4, signal.SIGINT: 1}
SEED = 31
RAY_WORKER_LINE = re.compile(r"^(\x1b\[\d+m)?\([^)]*pid=\d+[^)]*\)")  # what Ray forwards
AT_ONCE = 2  # runs side by side: each spends much of its life waiting (Ray's start, actors)
# Short: the cost of this test is one process per point, and a run's life is mostly its
# start (imports, Ray, actors), which no job size changes.
PROMPTS = [{"id": f"q{i}", "prompt": f"Tell me about {i}."} for i in range(4)]
REWARD = {"type": "callable", "function": "tests.helpers.rewards:slow_vowels"}
# A run's phases, each from the log line that starts it (None: the process's start) to the
# next one's, in the order a run prints them.
PHASES = {"starting": None,  # imports, the spec, the model checks, the prompts
          "prompts loaded": "already done",  # ray.init
          "Ray up": "Started a local Ray instance",  # the actors load; the first shard
          "a shard written": "/4 prompts",  # the other shards; the dataset assembled
          "finished": "dataset: "}  # the summary printed, Ray shut down, the exit


def _job(prompts: Path, model: Path, out: Path) -> Path:
    """The job, the same spec but for output.path (which its fingerprint leaves out)."""
    job = tiny_job(out.parent, model, prompts, reward=REWARD, cluster={"shard_size": 2},
                   output={"path": str(out)})
    return write_job(out.parent / f"{out.name}.yaml", job)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, tiny_lm_dir):
    """The prompts, and the run without a signal, AT_ONCE runs side by side as the points
    run: how long each phase lasts there, and its dataset (the same from each)."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    prompts = write_jsonl(tmp / "p.jsonl", PROMPTS)

    def run(k: int) -> dict[str, float]:
        job, log = _job(prompts, tiny_lm_dir, tmp / f"out{k}"), tmp / f"run{k}.log"
        return phase_lengths(start_run(job, log, fork=k > 0), log, PHASES)

    with ThreadPoolExecutor(AT_ONCE) as pool:
        lives = list(pool.map(run, range(AT_ONCE)))
    want = dataset_rows(tmp / "out0")
    assert all(dataset_rows(tmp / f"out{k}") == want for k in range(1, AT_ONCE))
    # The start as a fresh interpreter has it (run 0), its imports included; the other
    # phases as the forks that are signalled in them have them.
    lengths = {phase: min(life[phase] for life in lives[1:]) for phase in PHASES}
    return prompts, {**lengths, "starting": lives[0]["starting"]}, want


def _signalled(job: Path, log: Path, signum: int, phase: str, after_s: float) -> int:
    """The run, signalled `after_s` into `phase`: after its first line shows in the log.
    A fork of the test zygote, but in the start: a fresh interpreter, whose seconds of
    imports (a signal may come in the middle of `import torch`) the fork has done."""
    proc = start_run(job, log, fork=phase != "starting")
    try:
        line = PHASES[phase]
        deadline = time.monotonic() + 240
        while (line is not None and line not in log.read_text() and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.02)
        time.sleep(after_s)
        if proc.poll() is None:
            proc.send_signal(signum)
        return proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def _milestone(text: str) -> str:
    """How far the run got: the last phase its log shows."""
    return [phase for phase, line in PHASES.items() if line is None or line in text][-1]


@pytest.mark.slow  # a CLI process per point
@pytest.mark.timeout(2400)  # 20 processes, each up to a whole run's life
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_at_any_point_stops_cleanly_and_the_resume_is_the_same_dataset(
        tmp_path, tiny_lm_dir, undisturbed, ray_cluster, signum):
    prompts, phases, want = undisturbed
    name, stopped = signal.Signals(signum).name, 128 + signum
    rng = random.Random(SEED + signum)
    points = [(phase, rng.uniform(0, lasts)) for phase, lasts in phases.items()
              for _ in range(PER_PHASE[signum])]
    jobs = [_job(prompts, tiny_lm_dir, tmp_path / f"out{k}") for k in range(len(points))]
    logs = [tmp_path / f"run{k}.log" for k in range(len(points))]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        codes = list(pool.map(lambda k: _signalled(jobs[k], logs[k], signum, *points[k]),
                              range(len(points))))
    seen = []
    for job, log, (phase, at), code in zip(jobs, logs, points, codes, strict=True):
        out = tmp_path / job.stem
        text = log.read_text()
        seen.append((phase, round(at, 2), code, _milestone(text), out.exists()))
        where = (f"{name} {at:.2f} s into '{phase}' (of {phases[phase]:.1f} s), exit {code}:"
                 f"\n{text}")
        # No abort dump of the driver's. A Ray worker torn down as it starts may abort in
        # Ray's own C++ ("UnlockSlow is confused", seen once in about 40 points, 2026-11-27):
        # Ray's bug, its lines forwarded with a "(pid=...)" prefix, and the stop still clean.
        driver = [ln for ln in text.splitlines() if not RAY_WORKER_LINE.match(ln)]
        assert "Traceback" not in text and "received at time" not in "\n".join(driver), where
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
    print(f"\n{name} points (phase aimed at, s into it, exit, last phase logged, output kept):"
          f" {seen}")
    assert len(seen) == len(PHASES) * PER_PHASE[signum]
