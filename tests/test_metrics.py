"""Ray metrics: what the driver's collect path and the reward pool record (a fake sink), that
a broken sink never breaks a run, and RewardPool.done on a local Ray actor."""

from __future__ import annotations

import io
import logging
import threading
import time

import pytest
import ray
from ray.exceptions import GetTimeoutError

from specrej_ray.data.output import OutputDir, content_key
from specrej_ray.data.prompts import Prompt, PromptTask
from specrej_ray.distributed import shard_loop
from specrej_ray.distributed.metrics import (
    CANDIDATES_REJECTED,
    PROMPTS_DONE,
    SCORING_LATENCY,
    SHARD_RETRIES,
    TOKENS_GENERATED,
    Metrics,
)
from specrej_ray.distributed.reward_pool import RewardPool
from specrej_ray.distributed.shard_loop import Call, ShardLoop
from specrej_ray.engine.sequence import Candidate, PromptResult, Status
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.job.progress import Progress
from specrej_ray.job.run_record import RunState
from specrej_ray.job.shards import Shard, ShardOutput
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job


class FakeSink:
    def __init__(self) -> None:
        self.records: list[tuple[str, float, dict]] = []

    def record(self, name: str, value: float, tags: dict[str, str]) -> None:
        self.records.append((name, value, dict(tags)))

    def total(self, name: str) -> float:
        return sum(v for n, v, _ in self.records if n == name)


class BrokenSink:
    def record(self, name, value, tags):
        raise RuntimeError("no metrics agent")


def _result(pid: str, lengths: list[int], rejected: set[int]) -> PromptResult:
    cands = [Candidate(i, tokens=[7] * n, finish_reason=None if i in rejected else "eos",
                       status=Status.REJECTED if i in rejected else Status.FINISHED,
                       rejected_round=1 if i in rejected else None,
                       final_score=None if i in rejected else float(n), text="x" * n)
             for i, n in enumerate(lengths)]
    best = max((c for c in cands if c.finished), key=lambda c: c.final_score).index
    return PromptResult(pid, cands, best, n0=len(cands), waves=1, rounds=1, prompt_tokens=3,
                        seconds=0.1, score_seconds=0.01)


@pytest.fixture
def shard_run(tmp_path):
    """A two-prompt shard, its results, and a shard loop to collect them with."""
    spec = validate_spec(tiny_job(tmp_path, tmp_path / "model", tmp_path / "p.jsonl",
                                  cluster={"max_shard_retries": 1}))
    prompts = [Prompt("a", "Say hi.", None, 1), Prompt("b", "Say bye.", None, 2)]
    keys = {p.id: content_key(p.text, p.system, [1]) for p in prompts}
    shard = Shard.of("shard-00000-test", prompts, [PromptTask(p.id, p.text, [1]) for p in prompts],
                  keys)
    results = [_result("a", [4, 2, 6], {1}), _result("b", [5, 1, 1], {1, 2})]
    out = OutputDir.open(str(tmp_path / "out"), "resume", spec.fingerprint(), {})
    sink = FakeSink()
    state = RunState(metrics=Metrics("tiny", sink))
    progress = Progress(2, stream=io.StringIO())
    loop = ShardLoop(spec, None, out, state, progress, Interrupt())
    yield loop, shard, results, out, state, progress, sink
    out.close()


def test_a_finished_shard_counts_prompts_tokens_and_rejections(shard_run, monkeypatch):
    loop, shard, results, out, state, progress, sink = shard_run
    monkeypatch.setattr(shard_loop.ray, "get", lambda ref, timeout=None: ShardOutput(results))
    assert loop.collect("ref", Call(None, shard, time.monotonic()))
    assert sink.total(PROMPTS_DONE) == 2
    assert sink.total(TOKENS_GENERATED) == 4 + 2 + 6 + 5 + 1 + 1
    assert sink.total(CANDIDATES_REJECTED) == 3
    assert sink.total(SHARD_RETRIES) == 0
    assert {tags["job"] for _, _, tags in sink.records} == {"tiny"}
    record = state.shards[shard.id]
    assert record["status"] == "done" and record["attempts"] == 1 and record["prompts"] == 2
    assert record["failures"] == [] and record["seconds"] >= 0
    assert list(out.shard_keys[shard.id]) == ["a", "b"]
    # The run record is written with the shard: a killed driver does not lose it.
    assert out.records[shard.id]["run"] == record
    assert progress.done == 2 and progress.candidates == 6
    # Best-of-N would have run the rejected ones on: saved tokens are counted.
    assert progress.bon_tokens > progress.tokens


def test_a_failed_attempt_is_retried_once_then_recorded_as_failed(shard_run, monkeypatch):
    loop, shard, _, out, state, progress, sink = shard_run

    def timeout(ref, timeout=None):
        raise GetTimeoutError("no answer")

    monkeypatch.setattr(shard_loop.ray, "get", timeout)
    assert not loop.collect("ref", Call(None, shard, time.monotonic()))
    assert loop.queue == [shard] and sink.total(SHARD_RETRIES) == 1
    assert state.shards[shard.id]["status"] == "retrying" and state.failures == []
    loop.queue.clear()
    assert not loop.collect("ref", Call(None, shard, time.monotonic()))
    assert loop.queue == [] and sink.total(SHARD_RETRIES) == 1  # max_shard_retries: 1
    record = state.shards[shard.id]
    assert record["status"] == "failed" and record["attempts"] == 2
    assert [f["attempt"] for f in record["failures"]] == [1, 2]
    assert all("GetTimeoutError" in f["reason"] for f in record["failures"])
    assert [f["shard"] for f in state.failures] == [shard.id]
    assert sink.total(PROMPTS_DONE) == 0


def test_a_broken_metrics_sink_is_logged_once_and_never_raises(caplog):
    metrics = Metrics("tiny", BrokenSink())
    with caplog.at_level(logging.WARNING, logger="specrej_ray.distributed.metrics"):
        metrics.shard_done(2, 10, 1)
        metrics.shard_retried()
        metrics.scoring_latency(0.5)
    assert len(caplog.records) == 1 and "no metrics agent" in caplog.text


def test_zero_counts_are_not_sent_to_ray_counters():
    sink = FakeSink()
    Metrics("tiny", sink).shard_done(1, 0, 0)  # Ray's Counter.inc refuses 0
    assert [name for name, _, _ in sink.records] == [PROMPTS_DONE]


# --- the reward pool, on a local Ray actor ---------------------------------------------


@ray.remote(max_concurrency=4)  # the three batches wait, open() still runs
class GatedReward:
    """Scores once the gate opens."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def open(self) -> None:
        self.gate.set()

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        self.gate.wait(timeout=60)
        return [float(len(r)) for r in responses]



@pytest.mark.ray
def test_done_tells_without_waiting_and_collect_records_the_latency(ray_cluster):
    actor = GatedReward.remote()
    sink = FakeSink()
    pool = RewardPool([actor], batch_size=2, timeout_s=60, metrics=Metrics("tiny", sink))
    responses = ["a", "bb", "ccc", "dddd", "eeeee"]
    prompts = ["p"] * len(responses)
    assert pool.done({})
    pending = pool.submit(prompts, responses)
    assert len(pending) == 3  # batches of 2
    assert not pool.done(pending)  # the gate is shut: nothing is scored
    ray.get(actor.open.remote(), timeout=60)
    deadline = time.monotonic() + 60
    while not pool.done(pending):
        assert time.monotonic() < deadline, "scores never arrived"
        time.sleep(0.05)
    assert pool.collect(pending, prompts, responses) == [1.0, 2.0, 3.0, 4.0, 5.0]
    latencies = [(v, tags) for name, v, tags in sink.records if name == SCORING_LATENCY]
    assert len(latencies) == 1 and latencies[0][0] > 0 and latencies[0][1] == {"job": "tiny"}
