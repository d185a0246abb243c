"""Faults on a local Ray cluster: the driver killed and resumed, a generator or reward actor
killed mid-shard, and a shard that fails every attempt. Every wait here is bounded."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from specrej_ray.distributed.driver import JobError, run_job
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import (
    cli,
    dataset_rows,
    finished_shards,
    kill_tree,
    shard_records,
    start_run,
    wait_for,
)

pytestmark = pytest.mark.ray

FAULTS = {"type": "callable", "function": "tests.helpers.faults:score"}
QUIET = {"echo": lambda *a, **k: None}



def test_driver_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_lm_dir,
                                                                   ray_cluster, capfd):
    ids = [f"q{i}" for i in range(6)]
    prompts = write_jsonl(tmp_path / "p.jsonl",
                          [{"id": i, "prompt": f"Tell me about {i}."} for i in ids])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, cluster={"shard_size": 1})
    job_path = write_job(tmp_path / "job.yaml", job)
    out = Path(job["output"]["path"])
    log = tmp_path / "killed.log"
    proc = start_run(job_path, log)
    try:
        wait_for(lambda: finished_shards(out) >= 2, proc, log, "2 shards finished")
    finally:
        tree = kill_tree(proc)
    # The run had its own cluster: its raylet and GCS were ours to kill, and are gone.
    commands = " ".join(tree.values())
    assert "raylet" in commands and "gcs_server" in commands
    done_at_kill = finished_shards(out)
    assert 2 <= done_at_kill < len(ids)

    again = cli("run", job_path)  # the resume is not the subject: on the shared cluster
    assert again.returncode == 0, again.stdout + again.stderr
    # Generators find their reward actors by name: no actor handles among their constructor
    # arguments, so Ray has no restart that could fail to warn about (ray-project/ray#53727).
    # (Ray's core worker writes that warning to file descriptor 2, which capfd holds.)
    assert "constructor arguments in the object store" not in again.stderr + capfd.readouterr().err
    assert f"{done_at_kill} already done" in again.stdout

    whole = dict(job, output={"path": str(tmp_path / "whole")})
    run_job(validate_spec(whole), **QUIET)
    best, cands = dataset_rows(out)
    want_best, want_cands = dataset_rows(tmp_path / "whole")
    got = [r["id"] for r in best]
    counts = {"prompts": len(got), "duplicates": len(got) - len(set(got)),
              "missing": len(set(ids) - set(got)), "resumed_from": done_at_kill}
    print(f"\nkill-and-resume: {counts}")
    assert counts == {"prompts": 6, "duplicates": 0, "missing": 0, "resumed_from": done_at_kill}
    assert got == ids == [r["id"] for r in want_best]
    assert best == want_best  # same responses, rewards and stats
    assert cands == want_cands  # every candidate's text, scores and status
    assert finished_shards(out) == len(ids)
    # The killed invocation wrote no run.json, but its shards kept their run records: the
    # resume counts it and keeps them.
    info = json.loads((out / "run.json").read_text())
    killed, resumed = info["invocations"]
    assert killed == {"status": "killed", "shards_done": done_at_kill}
    assert resumed["status"] == "completed" and resumed["shards_done"] == len(ids) - done_at_kill
    by_invocation = [rec["invocation"] for rec in info["shards"].values()]
    assert sorted(by_invocation) == [0] * done_at_kill + [1] * (len(ids) - done_at_kill)
    assert all(rec["status"] == "done" and rec["seconds"] > 0 for rec in info["shards"].values())


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
    return job, marks, dataset_rows(tmp / "out")


def test_generator_killed_mid_shard_is_retried(tmp_path, faulty_prompts):
    job, marks, (want_best, want_cands) = faulty_prompts
    marks["rm"].touch()  # only the generator fault
    info = run_job(validate_spec(dict(job, output={"path": str(tmp_path / "out")})), **QUIET)
    assert marks["gen"].read_text().strip(), "no generator was killed"
    assert info["failed_shards"] == [] and info["counts"]["prompts"] == 4
    assert dataset_rows(tmp_path / "out") == (want_best, want_cands)
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
    assert dataset_rows(tmp_path / "out") == (want_best, want_cands)
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
    best, _ = dataset_rows(out)
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
    assert sorted(i for ids in shard_records(out).values() for i in ids) == ["a", "b"]


def test_an_overwrite_whose_every_shard_fails_keeps_the_earlier_dataset(tmp_path, tiny_lm_dir,
                                                                       ray_cluster):
    """--overwrite removes the earlier results only at its first write: a run that writes
    none (every shard failed) stops with one line and leaves them whole (they were removed
    and an empty dataset assembled over them)."""
    from tests.test_output_guard import finished_output, snapshot

    out = finished_output(tmp_path / "out")
    before = snapshot(out)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "poison", "prompt": "Stop. "
                                                  "[kill-generator-always]"}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, reward=FAULTS,
                   cluster={"shard_size": 1, "max_shard_retries": 0, "call_timeout_s": 60},
                   output={"path": str(out), "if_exists": "overwrite"})
    with pytest.raises(JobError, match=r"1 shard\(s\) failed and none finished; the earlier "
                                       "results in .* are kept"):
        run_job(validate_spec(job), **QUIET)
    assert snapshot(out) == before
