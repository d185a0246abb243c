"""What every generator backend must do (engine.protocol.GenerationEngine), whatever it runs
on: one suite, parametrized by backend; a new backend joins by adding its name to
tests/helpers/engines.py BUILDERS. The hf engine is the reference the others are held to.

Properties: alpha 0 is Best-of-N; pruning never changes a survivor and leaves every rejected
candidate a prefix of its Best-of-N self; a candidate is the same sample whatever shares its
batch; seeds and prompt ids give their own streams; a decision rejects the lowest partial
scores; a stop string cuts the response.
"""

from __future__ import annotations

import pytest

from specrej_ray.engine.protocol import GenerationEngine
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.task import EngineTask
from tests.conftest import text_score
from tests.helpers.engines import BUILDERS

PROMPT = "<|user|>Tell me something.<|assistant|>"
OTHER = "<|user|>Tell me about something else entirely.<|assistant|>"


@pytest.fixture(params=sorted(BUILDERS))
def backend(request, lm):
    """run(**settings) -> the result of PROMPT alone (or of several prompts, `prompts`)."""
    build = BUILDERS[request.param]

    def run(prompt_id: str = "p", prompts: tuple[tuple[str, str], ...] = (),
            **settings) -> PromptResult | list[PromptResult]:
        engine: GenerationEngine = build(lm, **settings)
        todo = prompts or ((prompt_id, PROMPT),)
        tasks = [EngineTask(pid, lm[1](text, add_special_tokens=False).input_ids, text_score)
                 for pid, text in todo]
        try:
            results = engine.run(tasks)
        finally:
            engine.close()
        return results if prompts else results[0]

    return run


def tokens(result: PromptResult) -> list[list[int]]:
    return [c.tokens for c in result.candidates]


def test_alpha_zero_is_best_of_n(backend):
    bon = backend(alpha=0.0)
    sbon0 = backend(alpha=0.0, decisions=(3, 7))
    assert tokens(sbon0) == tokens(bon)
    assert [c.final_score for c in sbon0.candidates] == [c.final_score for c in bon.candidates]
    assert bon.rejected == 0 and bon.rounds == 0 and bon.finished == 8
    finals = [c.final_score for c in bon.candidates]
    assert bon.best == finals.index(max(finals))


def test_pruning_never_changes_a_survivor_and_leaves_prefixes(backend):
    bon, sbon = backend(alpha=0.0), backend(alpha=0.5)
    assert sbon.rejected > 0
    for b, s in zip(bon.candidates, sbon.candidates, strict=True):
        if s.finished:
            assert s.tokens == b.tokens and s.text == b.text
        else:
            assert b.tokens[: len(s.tokens)] == s.tokens
    assert sbon.tokens_generated < bon.tokens_generated


def test_a_candidate_is_the_same_sample_whatever_shares_its_batch(backend):
    alone = backend(alpha=0.0, n=4)
    shared = backend(alpha=0.0, n=4, prompts=(("q", OTHER), ("p", PROMPT)))
    assert tokens(shared[1]) == tokens(alone)
    assert tokens(backend(alpha=0.0, n=6))[:4] == tokens(alone)  # a larger N: same first


def test_seed_and_prompt_change_the_streams(backend):
    base = tokens(backend(alpha=0.0, n=3))
    assert tokens(backend(alpha=0.0, n=3, seed=1)) != base
    assert tokens(backend(alpha=0.0, n=3, prompt_id="other")) != base
    assert len({tuple(t) for t in base}) == 3


def test_rejects_the_lowest_partial_scores(backend):
    result = backend(alpha=0.5, decisions=(6,), n=8)
    first_round = [c for c in result.candidates if c.partial_scores and c.partial_scores[0][0] == 6]
    assert len(first_round) == 8  # nothing finishes in 6 tokens with this model
    rejected = [c.partial_scores[0][1] for c in first_round if c.rejected_round == 1]
    kept = [c.partial_scores[0][1] for c in first_round if c.rejected_round is None]
    assert len(rejected) == 4 and len(kept) == 4
    assert min(kept) >= max(rejected)
    assert all(c.final_score is not None for c in result.candidates if c.finished)


def test_stop_string_cuts_the_response(backend):
    greedy = backend(alpha=0.0, n=1, temperature=0.0).candidates[0]
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 20
    stop = greedy.text[8:10]
    cut = backend(alpha=0.0, n=1, temperature=0.0, stop=[stop]).candidates[0]
    assert cut.finish_reason == "stop"
    assert cut.text == greedy.text[: greedy.text.index(stop)]
    assert stop not in cut.text
