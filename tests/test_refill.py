"""Cross-prompt refill, overlapped scoring and out-of-memory back-off on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from specrej_ray.engine.hf.engine import EngineOOMError
from specrej_ray.engine.task import EngineTask
from tests.conftest import text_score
from tests.helpers import engines
from tests.helpers.answers import Late
from tests.helpers.engines import budget_for

# Different lengths, so rows of different prompts live in the cache side by side.
PROMPTS = {
    "short": "Hi.",
    "medium": "Tell me something about the sea.",
    "long": "Write three sentences about mountains, rivers and the people who live there.",
    "other": "Why?",
}


def engine(lm, *, n=6, decisions=(4, 8), max_new=14, min_decision=3, **settings):
    return engines.engine(lm, n=n, decisions=decisions, max_new=max_new, seed=7,
                          min_decision=min_decision, **settings)


def two_prompts(lm) -> int:
    """A budget that holds about two prompts' candidates at once."""
    _, tok = lm
    longest = max(len(tok(p).input_ids) for p in PROMPTS.values())
    return budget_for(lm[0], 2 * (longest + 6 * 16))


def tasks(lm, ids=tuple(PROMPTS)) -> list[EngineTask]:
    _, tok = lm
    return [EngineTask(i, tok(PROMPTS[i]).input_ids, text_score) for i in ids]


def outcome(result) -> list[tuple]:
    return [(c.tokens, c.finish_reason, c.rejected_round, c.final_score, c.partial_scores)
            for c in result.candidates] + [result.best, result.rounds]


@pytest.mark.parametrize(
    ("alpha", "decisions"), [(0.5, (4, 8)), (0.0, (4, 8)), (0.5, None)], ids=["sbon", "bon", "mem"]
)
def test_a_prompt_mixed_with_others_is_identical_to_it_alone(lm, alpha, decisions):
    budget = two_prompts(lm)
    mixed_engine = engine(lm, alpha=alpha, decisions=decisions, budget=budget)
    mixed = mixed_engine.run(tasks(lm), refill=True)
    steps_alone = 0
    for task, together in zip(tasks(lm), mixed, strict=True):
        single = engine(lm, alpha=alpha, decisions=decisions, budget=budget)
        alone = single.generate(task.prompt_id, task.input_ids, task.score)
        steps_alone += single.stats.decode_steps
        assert outcome(together) == outcome(alone), task.prompt_id
    # Prompts really shared the batch: their steps overlapped.
    assert mixed_engine.stats.decode_steps < steps_alone


def test_rows_of_one_prompt_enter_as_room_appears(lm):
    # Room for two rows to the end: each prompt's candidates enter in several groups, and
    # rows of the next prompt join as rows of the last one finish.
    _, tok = lm
    longest = max(len(tok(p).input_ids) for p in PROMPTS.values())
    budget = budget_for(lm[0], longest + 2 * 16)
    mixed = engine(lm, alpha=0.0, budget=budget).run(tasks(lm), refill=True)
    alone = engine(lm, alpha=0.0, budget=budget).run(tasks(lm), refill=False)
    assert max(r.waves for r in mixed) >= 3
    assert [outcome(r) for r in mixed] == [outcome(r) for r in alone]


def test_refill_keeps_the_batch_fuller(lm):
    budget = two_prompts(lm)
    on, off = (engine(lm, budget=budget) for _ in range(2))
    results_on = on.run(tasks(lm), refill=True)
    results_off = off.run(tasks(lm), refill=False)
    assert [outcome(r) for r in results_on] == [outcome(r) for r in results_off]
    assert on.stats.occupancy > off.stats.occupancy
    assert on.stats.decode_steps < off.stats.decode_steps
    assert on.stats.prompts == off.stats.prompts == len(PROMPTS)
    assert 0 < on.stats.slack < 1  # rows hold whole chunks


def test_results_come_back_in_task_order(lm):
    order = ("long", "short", "other", "medium")
    heard = []
    results = engine(lm, budget=two_prompts(lm)).run(tasks(lm, order), on_result=heard.append)
    assert [r.prompt_id for r in results] == list(order)
    # Each result is announced once, when its prompt finishes (not necessarily in order).
    assert sorted(r.prompt_id for r in heard) == sorted(order)
    assert all(any(h is r for h in heard) for r in results)


class OOMAbove:
    """A model that runs out of memory on any forward pass with more than `rows` rows,
    once armed (the engine's start-up check runs one row) and `after` passes went through."""

    def __init__(self, model, rows: int, after: int = 0) -> None:
        self.model, self.rows, self.after, self.failures, self.armed = model, rows, after, 0, False
        self.largest = 0  # rows of the largest pass that went through since

    def __call__(self, **kwargs):
        rows = kwargs["input_ids"].shape[0]
        if self.armed and self.after:
            self.after -= 1
        elif self.armed:
            if rows > self.rows:
                self.failures += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
            self.largest = max(self.largest, rows)
        return self.model(**kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize(("alpha", "decisions"), [(0.0, (4, 8)), (0.5, (4, 8)), (0.5, None)],
                         ids=["bon", "sbon", "mem"])
def test_out_of_memory_halves_the_budget_and_replays(lm, alpha, decisions):
    m, _ = lm
    flaky = OOMAbove(m, rows=5, after=6)  # the rows have a few tokens to replay
    e = engine(lm, alpha=alpha, decisions=decisions, n=8, model=flaky)
    flaky.armed = True
    results = e.run(tasks(lm))
    clean = engine(lm, alpha=alpha, decisions=decisions, n=8).run(tasks(lm))
    assert flaky.failures >= 1 and e.stats.oom_backoffs == flaky.failures
    assert e.budget < 10**6 and flaky.largest <= 5
    # The rows in the cache came back by replaying their tokens: nothing changes.
    assert e.stats.replayed_tokens > 0
    if decisions is not None:  # the memory schedule's share shrinks with the budget
        assert [outcome(r) for r in results] == [outcome(r) for r in clean]


def test_out_of_memory_with_one_row_is_an_error(lm):
    m, _ = lm
    flaky = OOMAbove(m, rows=0)
    e = engine(lm, alpha=0.0, n=2, model=flaky)
    flaky.armed = True
    with pytest.raises(EngineOOMError, match="one candidate"):
        e.run(tasks(lm, ("short",)))
    # Its prefill failed first: admission stops before the prompt, so no row was in the batch
    # and nothing was halved.
    assert e.stats.oom_backoffs == 0


class OOMOnPrefill:
    """A model that runs out of memory on the `at`-th prefill once armed."""

    def __init__(self, model, at: int) -> None:
        self.model, self.at, self.armed, self.prefills = model, at, False, 0

    def __call__(self, **kwargs):
        if self.armed and kwargs["input_ids"].shape[1] > 1:
            self.prefills += 1
            if self.prefills == self.at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
        return self.model(**kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_out_of_memory_in_a_prefill_rolls_admission_back_to_before_its_prompt(lm, monkeypatch):
    """A step's admission is decided before its prefills run: when one runs out of memory,
    the prompts from it on wait again untouched, as if admission had stopped before it."""
    from specrej_ray.engine.hf.scheduler import Scheduler

    flaky = OOMOnPrefill(lm[0], at=2)
    e = engine(lm, model=flaky)
    after = []
    back_off = Scheduler.back_off

    def watched(self, error, batch):
        back_off(self, error, batch)
        after.append(([(p.prompt_id, p.started, len(p.groups)) for p in self.running],
                      [(p.prompt_id, p.started, list(p.wave_sizes)) for p in self.waiting]))

    monkeypatch.setattr(Scheduler, "back_off", watched)
    flaky.armed = True
    results = e.run(tasks(lm))
    assert after == [([("short", 6, 0)], [("medium", 0, []), ("long", 0, []), ("other", 0, [])])]
    assert e.stats.oom_backoffs == 1
    clean = engine(lm).run(tasks(lm))
    assert [outcome(r) for r in results] == [outcome(r) for r in clean]


def test_a_budget_that_holds_no_candidate_is_a_clear_error(lm):
    with pytest.raises(EngineOOMError, match="cannot hold one candidate.*kv_budget_gb"):
        engine(lm, budget=budget_for(lm[0], 8)).run(tasks(lm, ("long",)))


def late_tasks(lm, polls: int) -> list[EngineTask]:
    return [EngineTask(t.prompt_id, t.input_ids, t.score,
                       submit=lambda texts: Late(text_score(texts), polls)) for t in tasks(lm)]


@pytest.mark.parametrize("decisions", [(4, 8), (4, 5), None], ids=["tokens", "close", "mem"])
@pytest.mark.parametrize("polls", [1, 3, 50])
def test_decoding_goes_on_while_scores_are_out(lm, decisions, polls):
    budget = two_prompts(lm)
    waited = engine(lm, decisions=decisions, budget=budget, overlap=4)
    at_once = engine(lm, decisions=decisions, budget=budget).run(tasks(lm))
    results = waited.run(late_tasks(lm, polls))
    # Rejected candidates are cut back to the decision, so the outcome is the same.
    assert [outcome(r) for r in results] == [outcome(r) for r in at_once]
    assert any(r.rejected for r in results)
    # Rows went on decoding past decisions that later rejected them, and it is counted.
    assert waited.stats.discarded_tokens == sum(r.discarded_tokens for r in results) > 0
    assert all(r.tokens_decoded == r.tokens_generated + r.discarded_tokens for r in results)


@pytest.mark.parametrize("cap", [0, 2, 5])
def test_decoding_past_an_open_decision_is_capped(lm, cap, monkeypatch):
    """No row decodes more than `cap` tokens past a decision whose scores are out."""
    from specrej_ray.engine.hf.prompt_state import PromptState

    worst = []
    take = PromptState.take

    def watch(self, group, tokens, logprobs=None):
        take(self, group, tokens, logprobs)
        if self.open is not None:
            worst.append(max(len(c.tokens) for c in group.rows) - self.open.at)

    monkeypatch.setattr(PromptState, "take", watch)
    e = engine(lm, decisions=(4, 9), budget=two_prompts(lm), overlap=cap)
    e.run(late_tasks(lm, polls=50))
    assert max(worst, default=0) == cap  # slow answers: rows go as far as allowed
    assert (e.stats.discarded_tokens > 0) == (cap > 0)


def test_each_task_may_bring_its_own_search_settings(lm):
    """A calibrated job runs prompts with the chosen alpha and decisions in an engine built
    otherwise: mixed in one batch, each prompt's result is that of an engine with its
    settings."""
    from specrej_ray.engine.task import Choice

    sbon, bon = Choice(0.5, (4, 8)), Choice(0.0, None)
    base = tasks(lm)
    mixed = [EngineTask(t.prompt_id, t.input_ids, t.score, choice=sbon if i % 2 else bon)
             for i, t in enumerate(base)]
    results = engine(lm, alpha=0.9, decisions=(2,), budget=two_prompts(lm)).run(mixed)
    for i, (task, got) in enumerate(zip(base, results, strict=True)):
        alone = engine(lm, alpha=0.5 if i % 2 else 0.0, decisions=(4, 8)).generate(
            task.prompt_id, task.input_ids, task.score)
        assert outcome(got) == outcome(alone), task.prompt_id
    assert results[0].rounds == 0 and results[1].rounds > 0
