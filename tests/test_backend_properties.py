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


# -- per-prompt budgets (search.draws, engine.draws) ------------------------------------------

def _score(c) -> float:
    return c.components["reward"]


def _threshold_met(t: float):
    """The need of a job whose ceiling is `t`: one finished candidate at or above it."""
    return lambda finished: any(_score(c) >= t for c in finished)


def test_draws_stop_at_the_shortest_length_with_what_the_job_keeps(backend):
    """Best-of-N drawn 4 at a time until one chosen candidate of a later draw has finished (a
    need met early in its draw): the prompt stops at L*, its length; the candidates that
    finished by then are Best-of-N's own, every other of that draw is Best-of-N's cut back
    to L* and stopped, earlier draws are whole, and no draw starts after it."""
    from specrej_ray.engine.draws import KEPT
    from specrej_ray.engine.task import DrawPlan

    bon = backend(alpha=0.0, n=16, max_new=40)
    target = min((c for c in bon.candidates[4:] if c.finish_reason == "eos"),
                 key=lambda c: len(c.tokens))
    at, draws = len(target.tokens), target.index // 4 + 1
    plan = DrawPlan(max_n=16, wave=4,
                    met=lambda finished: any(c.index == target.index for c in finished))
    got = backend(alpha=0.0, n=4, max_new=40, draws=plan)
    assert got.stop_reason == KEPT and got.draws == draws and len(got.candidates) == 4 * draws
    for mine, ref in zip(got.candidates, bon.candidates, strict=False):
        if mine.index < 4 * (draws - 1) or (ref.finished and len(ref.tokens) <= at):
            assert mine.finished and mine.tokens == ref.tokens, mine.index
        else:
            assert mine.stopped and mine.tokens == ref.tokens[:at], mine.index
    assert got.stopped  # some stop mid-way: the need is met before the longest's end


def test_draws_stop_at_the_cap_and_a_draw_is_best_of_n_continued(backend):
    """A need nothing meets: every draw runs, the prompt stops at max_n, and its candidates are
    Best-of-max_n's (candidate k of the third draw is candidate k)."""
    from specrej_ray.engine.draws import CAP
    from specrej_ray.engine.task import DrawPlan

    plan = DrawPlan(max_n=12, wave=4, met=lambda finished: False)
    got = backend(alpha=0.0, n=4, max_new=16, draws=plan)
    bon = backend(alpha=0.0, n=12, max_new=16)
    assert got.stop_reason == CAP and got.draws == 3
    assert tokens(got) == tokens(bon)
    assert [c.final_score for c in got.candidates] == [c.final_score for c in bon.candidates]


def test_a_drawing_prompt_is_the_same_whatever_shares_its_batch(backend):
    """SBoN draws (decisions within each draw) beside another prompt and alone: the same
    candidates, statuses and stop, though the other prompt changes every step's batch."""
    from specrej_ray.engine.task import DrawPlan

    alone = backend(alpha=0.5, n=4, decisions=(3, 7), max_new=20)
    t = sorted(c.final_score for c in alone.candidates if c.finished)[-1]
    plan = DrawPlan(max_n=16, wave=4, met=_threshold_met(t + 1e-9))  # needs a later draw
    solo = backend(alpha=0.5, n=4, decisions=(3, 7), max_new=20, draws=plan)
    mixed = backend(alpha=0.5, n=4, decisions=(3, 7), max_new=20, draws=plan,
                    prompts=(("p", PROMPT), ("q", OTHER)))[0]
    assert solo.draws > 1
    for x, y in zip(solo.candidates, mixed.candidates, strict=True):
        assert (x.tokens, x.status, x.rejected_round, x.final_score, x.partial_scores) == \
            (y.tokens, y.status, y.rejected_round, y.final_score, y.partial_scores)
    assert (solo.stop_reason, solo.draws, solo.rounds) == (mixed.stop_reason, mixed.draws,
                                                           mixed.rounds)


# -- survivors that branch (search.branch) ------------------------------------------------------

def test_branching_gives_each_freed_row_to_a_child_of_a_survivor(backend):
    """A decision that rejects r live candidates adds r children, each its parent's text up
    to the decision and then its own; the survivors and everything before are SBoN's."""
    sbon = backend(alpha=0.5, decisions=(4, 9), max_new=16)
    branched = backend(alpha=0.5, decisions=(4, 9), max_new=16, branch=True)
    n = len(sbon.candidates)
    assert all(c.parent is None for c in branched.candidates[:n])
    # Up to the first decision nothing differs: the same candidates are cut there.
    assert [c.rejected_round == 1 for c in branched.candidates[:n]] == \
        [c.rejected_round == 1 for c in sbon.candidates]
    first = [c for c in branched.candidates[n:] if c.forked_at == 4]
    assert len(first) == sum(1 for c in sbon.candidates if c.rejected_round == 1)
    by_index = {c.index: c for c in branched.candidates}
    children = branched.candidates[n:]
    assert children and [c.index for c in children] == list(range(n, len(branched.candidates)))
    for c in children:
        parent = by_index[c.parent]
        assert c.tokens[: c.forked_at] == parent.tokens[: c.forked_at]
        assert parent.rejected_round is None or parent.rejected_round > 1  # a survivor
    # A child's own tokens are its own stream's, not its parent's.
    assert any(c.tokens[c.forked_at:] != by_index[c.parent].tokens[c.forked_at:len(c.tokens)]
               for c in children)


def test_a_branching_prompt_is_the_same_whatever_shares_its_batch(backend):
    solo = backend(alpha=0.5, decisions=(4, 9), max_new=16, branch=True)
    mixed = backend(alpha=0.5, decisions=(4, 9), max_new=16, branch=True,
                    prompts=(("p", PROMPT), ("q", OTHER)))[0]
    assert [(c.tokens, c.status, c.parent, c.forked_at, c.final_score) for c in
            solo.candidates] == [(c.tokens, c.status, c.parent, c.forked_at, c.final_score)
                                 for c in mixed.candidates]


def test_a_stopping_rule_stops_between_draws(backend):
    """until: rule is asked only when a draw has ended: the prompt keeps whole draws, and the
    rule's verdict is its stop."""
    from specrej_ray.engine.draws import RULE
    from specrej_ray.engine.task import DrawPlan

    plan = DrawPlan(max_n=16, wave=4, enough=lambda finished: len(finished) >= 6)
    got = backend(alpha=0.0, n=4, max_new=12, draws=plan)
    bon = backend(alpha=0.0, n=len(got.candidates), max_new=12)
    assert got.stop_reason == RULE and len(got.candidates) % 4 == 0 and not got.stopped
    assert sum(c.finished for c in got.candidates[:-4]) < 6 <= got.finished
    assert tokens(got) == tokens(bon)
