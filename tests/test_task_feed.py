"""TaskFeed: shards handed to one engine at once share its running batch (refill across
shards), each call gets its own results when its prompts are done, errors reach every call."""

from __future__ import annotations

import threading

import pytest

from specrej_ray.engine.task import EngineTask
from specrej_ray.engine.task_feed import TaskFeed
from tests.conftest import text_score
from tests.test_refill import engine, outcome, tasks, two_prompts

SHARD_A, SHARD_B = ("short", "medium"), ("long", "other")


def feed_for(eng, calls: list) -> TaskFeed:
    def run(first, on_result, more):
        calls.append([t.prompt_id for t in first])
        return eng.run(first, refill=True, on_result=on_result, more=more)

    return TaskFeed(run)


def gated(task: EngineTask, gate: threading.Event) -> EngineTask:
    """The task, whose first scoring waits for `gate`: its shard is still running then."""

    def score(responses):
        gate.wait(timeout=60)
        return text_score(responses)

    return EngineTask(task.prompt_id, task.input_ids, score)


def test_a_second_shard_joins_the_running_batch_and_results_match_running_alone(lm):
    budget = two_prompts(lm)
    eng, calls = engine(lm, budget=budget), []
    feed = feed_for(eng, calls)
    b_sent = threading.Event()
    first = [gated(t, b_sent) for t in tasks(lm, SHARD_A)]
    got: dict[str, list] = {}
    a = threading.Thread(target=lambda: got.__setitem__("a", feed.submit(first)))
    a.start()
    b = threading.Thread(target=lambda: got.__setitem__("b", feed.submit(tasks(lm, SHARD_B))))
    while not calls:  # shard A is in the engine, held at its first decision
        threading.Event().wait(0.01)
    b.start()
    while "long" not in feed._tickets:  # B is queued
        threading.Event().wait(0.01)
    b_sent.set()
    a.join(timeout=120)
    b.join(timeout=120)
    assert calls == [list(SHARD_A)]  # one engine run took both shards: B joined A's batch
    assert [r.prompt_id for r in got["a"]] == list(SHARD_A)
    assert [r.prompt_id for r in got["b"]] == list(SHARD_B)
    for shard in (SHARD_A, SHARD_B):
        alone = engine(lm, budget=budget).run(tasks(lm, shard), refill=True)
        fed = got["a"] if shard == SHARD_A else got["b"]
        assert [outcome(r) for r in fed] == [outcome(r) for r in alone]


def test_an_error_fails_only_the_call_whose_prompt_caused_it(lm):
    eng, calls = engine(lm), []
    feed = feed_for(eng, calls)
    release = threading.Event()

    scored = []

    def broken(responses):  # fine at its first decision, broken at its second
        release.wait(timeout=60)
        scored.append(len(responses))
        if len(scored) > 1:
            raise RuntimeError("reward exploded")
        return text_score(responses)

    bad = [EngineTask("short", tasks(lm, ("short",))[0].input_ids, broken)]
    outcomes: dict[str, object] = {}

    def submit(name, batch):
        try:
            outcomes[name] = feed.submit(batch)
        except RuntimeError as e:
            outcomes[name] = e

    threads = [threading.Thread(target=submit, args=("bad", bad)),
               threading.Thread(target=submit, args=("good", tasks(lm, ("other",))))]
    threads[0].start()
    while not calls:
        threading.Event().wait(0.01)
    threads[1].start()
    while "other" not in feed._tickets:
        threading.Event().wait(0.01)
    release.set()  # "other" joins after the first decision; the second one fails
    for t in threads:
        t.join(timeout=120)
    assert str(outcomes["bad"]) == "reward exploded"
    alone = engine(lm).run(tasks(lm, ("other",)))
    assert [outcome(r) for r in outcomes["good"]] == [outcome(r) for r in alone]
    assert calls == [["short"], ["short"], ["other"]]  # each call ran again alone
    assert [r.prompt_id for r in feed.submit(tasks(lm, ("medium",)))] == ["medium"]


def test_a_prompt_already_running_is_refused(lm):
    feed = TaskFeed(lambda first, on_result, more: None)
    with pytest.raises(ValueError, match="prompt short is already running"):
        feed.submit(tasks(lm, ("short", "short")))
    assert feed.submit([]) == []
