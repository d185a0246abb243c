"""Faults on a local Ray cluster: the driver killed and resumed, a generator or reward actor
killed mid-shard, and a shard that fails every attempt. Every wait here is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray

from specrej_ray.distributed.driver import JobError, run_job
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.outputs import finished_shards

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
FAULTS = {"type": "callable", "function": "tests.helpers.faults:score"}
QUIET = {"echo": lambda *a, **k: None}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False)  # never a `ray start` one
    yield
    ray.shutdown()


def _rows(out: Path) -> tuple[list[dict], list[dict]]:
    """best.parquet without its wall-clock column, and candidates.parquet."""
    best = [{k: v for k, v in r.items() if k != "seconds"}
            for r in pq.read_table(out / "best.parquet").to_pylist()]
    return best, pq.read_table(out / "candidates.parquet").to_pylist()


def _finished_shards(out: Path) -> int:
    return len(finished_shards(out))


# --- the driver is SIGKILLed and run again ---------------------------------------------


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below root (a /proc walk)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            todo.append(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_tree(proc: subprocess.Popen, deadline_s: float = 20.0) -> dict[int, str]:
    """SIGKILL the driver's process group, then anything it started that left the group
    (by pid: only our own processes); wait until all of them are gone."""
    tree = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=deadline_s)
    end = time.monotonic() + deadline_s
    while any(_alive(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.1)
    left = {p: c for p, c in tree.items() if _alive(p)}
    assert not left, f"processes of the killed run are still alive: {left}"
    return tree


def test_driver_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_lm_dir,
                                                                   ray_cluster):
    ids = [f"q{i}" for i in range(6)]
    prompts = write_jsonl(tmp_path / "p.jsonl",
                          [{"id": i, "prompt": f"Tell me about {i}."} for i in ids])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, cluster={"shard_size": 1})
    job_path = write_job(tmp_path / "job.yaml", job)
    out = Path(job["output"]["path"])
    command = [sys.executable, "-m", "specrej_ray.cli", "run", str(job_path)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    log = tmp_path / "killed.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while _finished_shards(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before the kill:\n{log.read_text()}"
        assert _finished_shards(out) >= 2, f"no 2 shards within 60 s:\n{log.read_text()}"
    finally:
        tree = _kill_tree(proc)
    # The run had its own cluster: its raylet and GCS were ours to kill, and are gone.
    commands = " ".join(tree.values())
    assert "raylet" in commands and "gcs_server" in commands
    done_at_kill = _finished_shards(out)
    assert 2 <= done_at_kill < len(ids)

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{done_at_kill} already done" in again.stdout

    whole = dict(job, output={"path": str(tmp_path / "whole")})
    run_job(validate_spec(whole), **QUIET)
    best, cands = _rows(out)
    want_best, want_cands = _rows(tmp_path / "whole")
    got = [r["id"] for r in best]
    counts = {"prompts": len(got), "duplicates": len(got) - len(set(got)),
              "missing": len(set(ids) - set(got)), "resumed_from": done_at_kill}
    print(f"\nkill-and-resume: {counts}")
    assert counts == {"prompts": 6, "duplicates": 0, "missing": 0, "resumed_from": done_at_kill}
    assert got == ids == [r["id"] for r in want_best]
    assert best == want_best  # same responses, rewards and stats
    assert cands == want_cands  # every candidate's text, scores and status
    assert len(finished_shards(out)) == len(ids)


# --- an actor dies in the middle of a shard --------------------------------------------


@pytest.fixture(scope="module")
def faulty_prompts(tmp_path_factory, tiny_lm_dir, ray_cluster):
    """Four prompts whose reward kills the generator (once) or the reward actor (once), and
    the dataset of an undisturbed run of them: both marker files exist, so no fault fires."""
    tmp = tmp_path_factory.mktemp("faulty")
    marks = {"gen": tmp / "gen.flag", "rm": tmp / "rm.flag"}
    prompts = write_jsonl(tmp / "p.jsonl", [
        {"id": "a", "prompt": "Say hello."},
        {"id": "b", "prompt": f"Count to three. [kill-generator-once:{marks['gen']}]"},
        {"id": "c", "prompt": "Name a color."},
        {"id": "d", "prompt": f"Name a fruit. [exit-reward-once:{marks['rm']}]"},
    ])
    for m in marks.values():
        m.touch()
    job = tiny_job(tmp, tiny_lm_dir, prompts, reward=FAULTS,
                   cluster={"shard_size": 1, "call_timeout_s": 60})
    run_job(validate_spec(job), **QUIET)
    for m in marks.values():
        m.unlink()
    return job, marks, _rows(tmp / "out")


def test_generator_killed_mid_shard_is_retried(tmp_path, faulty_prompts):
    job, marks, (want_best, want_cands) = faulty_prompts
    marks["rm"].touch()  # only the generator fault
    info = run_job(validate_spec(dict(job, output={"path": str(tmp_path / "out")})), **QUIET)
    assert marks["gen"].read_text().strip(), "no generator was killed"
    assert info["failed_shards"] == [] and info["counts"]["prompts"] == 4
    assert _rows(tmp_path / "out") == (want_best, want_cands)
    records = json.loads((tmp_path / "out" / "run.json").read_text())["shards"]
    killed = records.pop(sorted(records)[1])  # prompt b's shard
    assert killed["attempts"] >= 2 and killed["status"] == "done"
    assert all("generator actor failed" in f["reason"] for f in killed["failures"])
    # A shard that shared the killed generator (cluster.shards_in_flight) was retried alone,
    # uncharged; the others ran once.
    for record in records.values():
        shared = [f for f in record["failures"] if "while sharing its generator" in f["reason"]]
        assert record["status"] == "done" and record["attempts"] == 1 + len(shared) <= 2
        assert shared == record["failures"]
    marks["rm"].unlink()


def test_reward_actor_death_resubmits_its_batch(tmp_path, faulty_prompts):
    job, marks, (want_best, want_cands) = faulty_prompts
    marks["gen"].touch()  # only the reward actor fault
    info = run_job(validate_spec(dict(job, output={"path": str(tmp_path / "out")})), **QUIET)
    assert marks["rm"].exists(), "the reward actor never exited"
    assert info["failed_shards"] == [] and info["counts"]["prompts"] == 4
    assert _rows(tmp_path / "out") == (want_best, want_cands)
    marks["gen"].unlink()


# --- a shard that fails every attempt ---------------------------------------------------


def test_shard_failing_every_retry_is_recorded_and_the_job_goes_on(tmp_path, tiny_lm_dir,
                                                                    ray_cluster):
    rows = [{"id": "poison1", "prompt": "Stop. [kill-generator-always]"},
            {"id": "poison2", "prompt": "Halt. [kill-generator-always]"},
            {"id": "a", "prompt": "Say hello."},
            {"id": "b", "prompt": "Name a color."}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, reward=FAULTS,
                   cluster={"shard_size": 1, "max_shard_retries": 0, "call_timeout_s": 60})
    # No retries, so each poison shard kills the generator once: two deaths in a row, and
    # the job still finishes the good shards after them on the restarted actor.
    t0 = time.monotonic()
    with pytest.raises(JobError, match=r"2 shard\(s\) failed"):
        run_job(validate_spec(job), **QUIET)
    assert time.monotonic() - t0 < 60
    out = tmp_path / "out"
    best, _ = _rows(out)
    assert [r["id"] for r in best] == ["a", "b"]  # the other shards are complete
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    failed = {tuple(e["prompt_ids"]): e for e in errors if e.get("shard")}
    assert set(failed) == {("poison1",), ("poison2",)}
    assert all("generator actor failed" in e["reason"] for e in failed.values())
    info = json.loads((out / "run.json").read_text())
    assert sorted(f["prompt_ids"] for f in info["failed_shards"]) == [["poison1"], ["poison2"]]
    records = [info["shards"][f["shard"]] for f in info["failed_shards"]]
    # The two poison shards first ran together (cluster.shards_in_flight 2) and were retried
    # alone, uncharged; alone, each failed its one attempt (max_shard_retries 0).
    assert [(r["status"], r["attempts"], len(r["failures"])) for r in records] == [
        ("failed", 2, 2), ("failed", 2, 2)]
    for r in records:
        assert "while sharing its generator" in r["failures"][0]["reason"]
        assert "while sharing" not in r["failures"][1]["reason"]
    assert info["counts"]["prompts"] == 2
    assert sorted(i for ids in finished_shards(out).values() for i in ids) == ["a", "b"]
