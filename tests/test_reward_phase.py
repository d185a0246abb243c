"""A step's reward work is its own phase (issue 57): a reward that answers late holds only the
prompt waiting on it; every other prompt decodes on, step for step."""

from __future__ import annotations

import threading

import pytest

from specrej_ray.engine.scoring import SCORING, Tracking, later
from specrej_ray.engine.task import Choice, EngineTask
from tests.conftest import text_score
from tests.helpers import engines

SLOW, FAST = "Tell me something about the sea.", "Why?"
HOLD_S = 60  # the most a held answer waits for its release (a hang, not a figure)


class Held:
    """An answer that is in only once the test releases it (a reward actor that is slow)."""

    def __init__(self, rows, released: threading.Event, late: list) -> None:
        self.rows, self.released, self.late = rows, released, late

    def done(self) -> bool:
        return self.released.is_set()

    def result(self):
        if not self.released.wait(HOLD_S):
            self.late.append("the engine waited on a held answer")
        return self.rows


def _run(lm, slow: EngineTask, fast_after: int, released: threading.Event):
    """`slow` from the start, FAST handed over before step `fast_after`: how many steps FAST
    took from its arrival to its result, whether the slow answer was still out when it came,
    and both results. The slow reward is released when FAST's result comes."""
    e = engines.engine(lm, n=4, alpha=0.5, decisions=(4,), max_new=12, seed=3)
    tok = lm[1]
    fast = EngineTask("fast", tok(FAST).input_ids, text_score)
    steps, seen = {"now": 0}, {}
    step = e.step

    def counted():
        steps["now"] += 1
        return step()

    def more():
        if steps["now"] == fast_after and "arrived" not in seen:
            seen["arrived"] = steps["now"]
            return [fast]
        return []

    def on_result(r):
        if r.prompt_id == "fast":
            seen["steps"] = steps["now"] - seen["arrived"]
            seen["slow_still_out"] = not released.is_set()
            released.set()

    e.step = counted
    results = e.run([slow], on_result=on_result, more=more)
    return seen, {r.prompt_id: r for r in results}


def _outcome(r):
    return [(c.tokens, c.finish_reason, c.rejected_round, c.final_score) for c in r.candidates]


def test_a_late_final_answer_does_not_hold_the_prompts_that_do_not_wait_on_it(lm):
    """The slow prompt (Best-of-N: its one request is its final scores) finishes decoding
    while the fast one is half way; its scores stay out until the fast one is done. The fast
    prompt takes the steps it takes beside a reward that answers at once."""
    tok = lm[1]
    released, late = threading.Event(), []

    def held(texts, **_):
        return Held(text_score(texts), released, late)

    slow = EngineTask("slow", tok(SLOW).input_ids, text_score, submit=held,
                      choice=Choice(0.0, None), overlap=False)
    seen, results = _run(lm, slow, fast_after=6, released=released)
    assert not late and seen["slow_still_out"]
    prompt = EngineTask("slow", tok(SLOW).input_ids, text_score, choice=Choice(0.0, None))
    at_once, baseline = _run(lm, prompt, fast_after=6, released=threading.Event())
    assert seen["steps"] == at_once["steps"]
    assert _outcome(results["fast"]) == _outcome(baseline["fast"])
    assert _outcome(results["slow"]) == _outcome(baseline["slow"])


def test_a_slow_reward_in_this_process_runs_beside_the_batch(lm):
    """A plain score function that blocks (a reward model busy elsewhere) given to the engine
    through `later`: it runs on the scoring thread, a decision waits on it, the other prompt
    decodes to its end meanwhile."""
    tok = lm[1]
    released = threading.Event()

    def blocking(texts):
        assert released.wait(HOLD_S), "the engine waited on the scoring thread"
        return text_score(texts)

    slow = EngineTask("slow", tok(SLOW).input_ids, text_score, submit=later(blocking),
                      overlap=False)
    seen, results = _run(lm, slow, fast_after=2, released=released)
    assert seen["slow_still_out"]
    alone = engines.engine(lm, n=4, alpha=0.5, decisions=(4,), max_new=12, seed=3).generate(
        "slow", tok(SLOW).input_ids, text_score)
    assert _outcome(results["slow"]) == _outcome(alone)  # the same cut, only later


def test_later_runs_on_the_scoring_thread_and_keeps_tracking_and_errors():
    calls = []

    def score(texts, rewards=None, tracking=None):
        calls.append((threading.current_thread().name, rewards, tracking))
        return [[1.0] for _ in texts]

    tracking = Tracking([0], [[5]])
    assert later(score)(["a"], rewards=(0,), tracking=tracking).result() == [[1.0]]
    assert calls == [("specrej-scoring", (0,), tracking)]

    def plain(texts):  # takes no tracking: none is passed
        raise ValueError("reward broke")

    answer = later(plain)(["a"], tracking=tracking)
    with pytest.raises(ValueError, match="reward broke"):
        answer.result()
    assert SCORING.call(len, "abc").result() == 3  # the thread outlives an error
