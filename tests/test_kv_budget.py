"""The KV cache never holds more than its budget, in any mode (issue: memory that holds).

Every decode step is watched: the bytes of the pool's K/V tensors (counted from the tensors,
not from the engine's own accounting), the slots in use, and the cache's high-water mark,
transients of the pool's growth included, must stay within budget x bytes per token.
"""

from __future__ import annotations

import random

import pytest

from specrej_ray.engine.hf.model_runner import ModelRunner
from specrej_ray.engine.task import EngineTask
from tests.conftest import text_score
from tests.helpers.engines import budget_for
from tests.test_refill import PROMPTS, OOMAbove, engine, late_tasks, outcome, tasks


class Watch:
    """Records the cache after every decode step of an engine."""

    def __init__(self, monkeypatch, e) -> None:
        self.e, self.held, self.pool, self.steps = e, [], [], 0
        decode = ModelRunner.decode

        def watched(runner, slots, tokens, pool_slots):
            out = decode(runner, slots, tokens, pool_slots)
            if runner is e.runner:
                blocks = e.scheduler.blocks
                self.steps += 1
                self.held.append(blocks.tokens() * runner.pool.slot_bytes())
                self.pool.append(runner.pool.capacity_bytes())
                # The engine's own count is the tables' and the tensors' (no hidden padding or
                # copies, no slot lost between the free list and the tables).
                assert blocks.tokens() == len(blocks.held_slots())
                assert runner.pool.slot_bytes() == runner.bytes_per_token
            return out

        monkeypatch.setattr(ModelRunner, "decode", watched)

    def check(self, budget_tokens: int) -> None:
        limit = budget_tokens * self.e.runner.bytes_per_token
        assert self.steps > 0
        assert max(self.held) <= limit
        assert max(self.pool) <= limit
        assert self.e.runner.pool.peak_bytes <= limit
        assert self.e.stats.peak_kv_bytes <= limit


def tight(lm, rows: int) -> int:
    """A budget for `rows` rows of the longest prompt to the end: every mode must queue."""
    longest = max(len(lm[1](p).input_ids) for p in PROMPTS.values())
    return budget_for(lm[0], longest + rows * 16)


MODES = {
    "sbon-tokens": dict(alpha=0.5, decisions=(4, 8)),
    "sbon-memory": dict(alpha=0.5, decisions=None),
    "n-auto": dict(alpha=0.5, decisions=None, n=None),
    "bon": dict(alpha=0.0),
    "alpha-0.9": dict(alpha=0.9, decisions=(3,)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [3, 9])
@pytest.mark.parametrize("refill", [True, False])
def test_every_mode_stays_within_the_budget(lm, monkeypatch, mode, rows, refill):
    budget = tight(lm, rows)
    e = engine(lm, budget=budget, **MODES[mode])
    watch = Watch(monkeypatch, e)
    results = e.run(tasks(lm), refill=refill)
    watch.check(budget)
    assert all(r.finished for r in results)
    # With scores at once, reservations are exact upper bounds: nothing ever has to wait.
    assert e.stats.stalls == 0


@pytest.mark.parametrize("mode", ["sbon-tokens", "bon", "alpha-0.9"])
def test_multi_wave_prompts_stay_within_the_budget_and_match_one_wave(lm, monkeypatch, mode):
    """Budgets too small for a prompt's N rows at its first decision: its rows run in
    waves, the early ones leave the cache and come back by replay, the result is the same."""
    budget = tight(lm, 2)
    e = engine(lm, budget=budget, n=8, **MODES[mode])
    watch = Watch(monkeypatch, e)
    results = e.run(tasks(lm))
    watch.check(budget)
    wide = engine(lm, n=8, **MODES[mode]).run(tasks(lm))
    assert [outcome(r) for r in results] == [outcome(r) for r in wide]
    assert max(r.waves for r in results) > 1


@pytest.mark.parametrize("mode", ["sbon-tokens", "sbon-memory"])
@pytest.mark.parametrize("polls", [2, 40])
def test_overlap_with_late_answers_stays_within_the_budget(lm, monkeypatch, mode, polls):
    budget = tight(lm, 6)
    e = engine(lm, budget=budget, overlap=3, **MODES[mode])
    watch = Watch(monkeypatch, e)
    e.run(late_tasks(lm, polls))
    watch.check(budget)


def test_out_of_memory_restart_stays_within_the_halved_budget(lm, monkeypatch):
    m, _ = lm
    flaky = OOMAbove(m, rows=4, after=5)
    e = engine(lm, alpha=0.5, decisions=(4, 8), budget=tight(lm, 12), model=flaky)
    flaky.armed = True
    watch = Watch(monkeypatch, e)
    e.run(tasks(lm))
    assert e.stats.oom_backoffs >= 1
    # Every step after the back-off fits the budget it then had.
    watch.check(tight(lm, 12))
    assert max(watch.held[-5:]) <= e.budget * e.runner.bytes_per_token


@pytest.mark.parametrize("seed", range(12))
def test_random_settings_stay_within_the_budget_and_keep_candidate_identity(lm, monkeypatch,
                                                                            seed):
    rng = random.Random(seed)
    alpha = rng.choice([0.0, 0.25, 0.5, 0.75, 0.9])
    decisions = rng.choice([(2,), (3, 7), (5, 6, 11), (1, 4, 9, 12)])
    settings = dict(alpha=alpha, decisions=decisions, n=rng.randint(1, 12),
                    max_new=rng.randint(6, 20))
    _, tok = lm
    texts = rng.sample(sorted(PROMPTS.values()), rng.randint(1, 4))
    work = [EngineTask(f"q{i}", tok(t).input_ids, text_score) for i, t in enumerate(texts)]
    longest = max(len(t.input_ids) for t in work)
    budget = budget_for(lm[0], longest + rng.randint(1, 10) * 16 + rng.randint(0, 15))
    e = engine(lm, budget=budget, **settings)
    watch = Watch(monkeypatch, e)
    results = e.run(work, refill=rng.random() < 0.8)
    watch.check(budget)
    # The same candidates as with memory to spare (tokens schedules and Best-of-N do not
    # depend on memory).
    wide = engine(lm, **settings).run(work)
    assert [outcome(r) for r in results] == [outcome(r) for r in wide]
