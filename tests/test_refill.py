"""Cross-prompt refill and out-of-memory back-off on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from specrej_ray.engine.generate import Engine, EngineOOMError, EngineTask, SearchParams
from specrej_ray.engine.sampling import SamplingParams
from tests.conftest import text_score

# Different lengths, so rows of different prompts are left-padded against each other.
PROMPTS = {
    "short": "Hi.",
    "medium": "Tell me something about the sea.",
    "long": "Write three sentences about mountains, rivers and the people who live there.",
    "other": "Why?",
}




def engine(lm, *, n=6, alpha=0.5, decisions=(4, 8), budget=10**6, max_new=14, model=None):
    m, tok = lm
    sampling = SamplingParams(1.0, 1.0, 0, max_new, ())
    search = SearchParams(n, alpha, decisions, 3, budget, seed=7)
    return Engine(model or m, tok, sampling, search)


def tasks(lm, ids=tuple(PROMPTS)) -> list[EngineTask]:
    _, tok = lm
    return [EngineTask(i, tok(PROMPTS[i]).input_ids, text_score) for i in ids]


def outcome(result) -> list[tuple]:
    return [(c.tokens, c.finish_reason, c.rejected_round, c.final_score, c.partial_scores)
            for c in result.candidates] + [result.best, result.n0, result.waves, result.rounds]


@pytest.mark.parametrize(
    ("alpha", "decisions"), [(0.5, (4, 8)), (0.0, (4, 8)), (0.5, None)], ids=["sbon", "bon", "mem"]
)
def test_a_prompt_mixed_with_others_is_identical_to_it_alone(lm, alpha, decisions):
    # Room for about two prompts' waves at once: the batch mixes prompts, rows of the next
    # prompt enter while the last one's survivors finish.
    budget = 2 * 6 * (20 + 14)
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


def test_waves_of_one_prompt_refill_too(lm):
    # The longest prompt needs three waves of two rows; refill overlaps the waves of
    # different prompts without changing any prompt's candidates.
    _, tok = lm
    budget = 2 * (max(len(tok(p).input_ids) for p in PROMPTS.values()) + 14)
    mixed = engine(lm, alpha=0.0, budget=budget).run(tasks(lm), refill=True)
    alone = engine(lm, alpha=0.0, budget=budget).run(tasks(lm), refill=False)
    assert [r.waves for r in mixed] == [r.waves for r in alone]
    assert max(r.waves for r in mixed) == 3
    assert [outcome(r) for r in mixed] == [outcome(r) for r in alone]


def test_refill_keeps_the_batch_fuller(lm):
    budget = 2 * 6 * (20 + 14)
    on, off = (engine(lm, budget=budget) for _ in range(2))
    results_on = on.run(tasks(lm), refill=True)
    results_off = off.run(tasks(lm), refill=False)
    assert [outcome(r) for r in results_on] == [outcome(r) for r in results_off]
    assert on.stats.occupancy > off.stats.occupancy
    assert on.stats.decode_steps < off.stats.decode_steps
    assert on.stats.prompts == off.stats.prompts == len(PROMPTS)
    assert 0 < on.stats.padding < 1  # prompts of different lengths are padded


def test_results_come_back_in_task_order(lm):
    order = ("long", "short", "other", "medium")
    heard = []
    results = engine(lm, budget=3 * 6 * 40).run(tasks(lm, order), on_result=heard.append)
    assert [r.prompt_id for r in results] == list(order)
    # Each result is announced once, when its prompt finishes (not necessarily in order).
    assert sorted(r.prompt_id for r in heard) == sorted(order)
    assert all(any(h is r for h in heard) for r in results)


class OOMAbove:
    """A model that runs out of memory on any forward pass with more than `rows` rows."""

    def __init__(self, model, rows: int) -> None:
        self.model, self.rows, self.failures = model, rows, 0

    def __call__(self, **kwargs):
        if kwargs["input_ids"].shape[0] > self.rows:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
        return self.model(**kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_out_of_memory_halves_the_batch_and_retries(lm):
    m, _ = lm
    flaky = OOMAbove(m, rows=5)
    e = engine(lm, alpha=0.0, n=8, model=flaky)
    results = e.run(tasks(lm))
    clean = engine(lm, alpha=0.0, n=8).run(tasks(lm))
    assert flaky.failures >= 1 and e.stats.oom_backoffs == flaky.failures
    assert e.budget < 10**6
    # Best-of-N candidates do not depend on how they are batched: same texts, same best.
    assert [[c.tokens for c in r.candidates] for r in results] == [
        [c.tokens for c in r.candidates] for r in clean]
    assert [r.best for r in results] == [r.best for r in clean]
    assert all(r.n0 <= 5 for r in results)


def test_out_of_memory_with_one_row_is_an_error(lm):
    m, _ = lm
    with pytest.raises(EngineOOMError, match="one candidate"):
        engine(lm, alpha=0.0, n=2, model=OOMAbove(m, rows=0)).run(tasks(lm, ("short",)))


class Late:
    """An answer from a slow reward: in only after `polls` looks."""

    def __init__(self, rows, polls: int) -> None:
        self.rows, self.polls = rows, polls

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def result(self):
        return self.rows


@pytest.mark.parametrize("decisions", [(4, 8), (4, 5), None], ids=["tokens", "close", "mem"])
@pytest.mark.parametrize("polls", [1, 3, 50])
def test_decoding_goes_on_while_scores_are_out(lm, decisions, polls):
    budget = 2 * 6 * (20 + 14)
    base = tasks(lm)
    late = [EngineTask(t.prompt_id, t.input_ids, t.score,
                       submit=lambda texts: Late(text_score(texts), polls)) for t in base]
    waited = engine(lm, decisions=decisions, budget=budget)
    at_once = engine(lm, decisions=decisions, budget=budget).run(base)
    results = waited.run(late)
    # Rejected candidates are cut back to the decision, so the outcome is the same.
    assert [outcome(r) for r in results] == [outcome(r) for r in at_once]
    assert any(r.rejected for r in results)
    # Rows went on decoding past decisions that later rejected them.
    assert waited.stats.discarded_tokens > 0
