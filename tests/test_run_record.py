"""run.json's invocation records: how each invocation ended and which shards failed (no Ray)."""

from __future__ import annotations

import pytest

from specrej_ray.data import dataset
from specrej_ray.data.prompts import Prompt
from specrej_ray.job.run_record import RunState, run_info
from specrej_ray.job.shards import Shard, failure_record
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_jsonl


@pytest.fixture
def spec(tmp_path, tiny_lm_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    return validate_spec(tiny_job(tmp_path, tiny_lm_dir, prompts))


def _shard(sid: str, *ids: str) -> Shard:
    return Shard.of(sid, [Prompt(i, f"prompt {i}", None, n) for n, i in enumerate(ids, 1)], [], {})


def _invocation(spec, state: RunState) -> dict:
    return run_info(spec, {}, [], state, 0.0, 0.0)["invocations"][-1]


def test_a_shard_that_fails_is_named_with_its_prompts_and_counted(spec):
    state = RunState()
    bad = _shard("s1", "a", "b")
    state.shard_failed(bad, "ValueError: boom", None, final=True)
    state.failures.append(failure_record(bad, "ValueError: boom"))
    # One shard failing twice in the records (retried, then final) is one failed shard.
    state.failures.append(failure_record(bad, "generator actor failed"))
    assert state.failures[0] == {"shard": "s1", "prompt_ids": ["a", "b"],
                                 "reason": "ValueError: boom"}
    rec = _invocation(spec, state)
    assert (rec["status"], rec["shards_failed"]) == ("failed", 1)


def test_a_failure_of_no_shard_fails_the_invocation_but_counts_no_shard(spec):
    state = RunState(failures=[failure_record(None, "2 actor(s) did not start")])
    assert state.failures[0]["prompt_ids"] == []
    rec = _invocation(spec, state)
    assert (rec["status"], rec["shards_failed"]) == ("failed", 0)


def test_status_completed_and_interrupted(spec):
    state = RunState()
    state.shard_done(_shard("s1", "a"), [], 0.0, None)
    assert (_invocation(spec, state)["status"], _invocation(spec, state)["shards_done"]) == (
        "completed", 1)
    state.interrupted = True
    state.failures.append(failure_record(_shard("s2", "b"), "generator actor failed"))
    rec = _invocation(spec, state)  # a stop signal ended it, whatever else happened
    assert (rec["status"], rec["shards_done"], rec["shards_failed"]) == ("interrupted", 1, 1)


def test_a_resume_keeps_the_interrupted_invocation(spec, tmp_path):
    (tmp_path / "out").mkdir()
    out = dataset.locate(spec.output.path)
    first = RunState(interrupted=True)
    dataset.write_run_info(out, run_info(spec, {}, [], first, 0.0, 0.0))
    second = RunState.resume(dataset.read_run_info(out), spec)
    statuses = [i["status"] for i in run_info(spec, {}, [], second, 0.0, 0.0)["invocations"]]
    assert statuses == ["interrupted", "completed"]
