"""When a prompt has what its outputs keep (job.draws): the stop of search.draws and the
training files' own selection agree."""

from __future__ import annotations

import pytest

from specrej_ray.engine.sequence import Candidate, Status
from specrej_ray.job.draws import draw_plan
from specrej_ray.spec import JobSpec


def spec(formats=("sft",), **output) -> JobSpec:
    return JobSpec.model_validate({
        "prompts": {"path": "p.jsonl"}, "generator": {"model": "gen"},
        "reward": {"type": "instructions"},
        "search": {"n": 4, "draws": {"max_n": 16}},
        "output": {"path": "out", "formats": list(formats), **output}})


def done(index: int, score: float, text: str | None = None, reason: str = "eos") -> Candidate:
    c = Candidate(index, tokens=[1], status=Status.FINISHED, finish_reason=reason,
                  text=text or f"t{index}")
    c.components = {"instructions(strict)": score}  # the reward's label
    return c


def test_the_sft_files_need_a_response_at_the_ceiling_that_the_filters_keep():
    met = draw_plan(spec()).met
    assert not met([done(0, 0.5), done(1, 2 / 3)])
    assert met([done(0, 0.5), done(1, 1.0)])
    truncated = draw_plan(spec(filters={"drop_truncated": True})).met
    assert not truncated([done(0, 1.0, reason="length")])
    assert truncated([done(0, 1.0, reason="length"), done(1, 1.0)])


def test_preference_and_top_k_need_their_rows_too():
    pref = draw_plan(spec(("sft", "preference"), filters={"min_margin": 0.4})).met
    assert not pref([done(0, 1.0)])  # no rejected side
    assert not pref([done(0, 1.0), done(1, 0.75)])  # a margin the filter drops
    assert pref([done(0, 1.0), done(1, 0.75), done(2, 0.5)])
    top = draw_plan(spec(("sft", "top_k"), top_k=3)).met
    assert not top([done(0, 1.0), done(1, 0.2), done(2, 0.1, text="t1")])  # a duplicate
    assert top([done(0, 1.0), done(1, 0.2), done(2, 0.1)])


def _spec(reward, **output) -> JobSpec:
    return JobSpec.model_validate({
        "prompts": {"path": "p.jsonl"}, "generator": {"model": "gen"}, "reward": reward,
        "search": {"n": 4, "draws": {"max_n": 16}},
        "output": {"path": "out", "formats": ["sft"], **output}})


@pytest.mark.parametrize("reward", [
    {"type": "lm_likelihood", "model": "m"},
    {"type": "callable", "function": "m:f"},  # declares no ceiling
    [{"type": "instructions"}, {"type": "classifier", "model": "rm", "weight": 1.0}]])
def test_a_reward_without_a_ceiling_is_refused(reward):
    with pytest.raises(ValueError, match="search.draws .* ceiling"):
        _spec(reward)


@pytest.mark.parametrize(("reward", "why"), [
    ({"type": "classifier", "model": "rm", "ceiling": 5.0}, "no highest score"),
    ({"type": "instructions", "ceiling": 0.9}, "whose highest is 1"),
])
def test_a_ceiling_a_reward_cannot_honour_is_refused(reward, why):
    with pytest.raises(ValueError, match=f"reward.ceiling: .*{why}"):
        JobSpec.model_validate({"prompts": {"path": "p.jsonl"}, "generator": {"model": "g"},
                                "reward": reward, "output": {"path": "out"}})


def test_an_ensemble_is_at_its_ceiling_when_every_reward_is():
    both = [{"type": "instructions"},
            {"type": "callable", "function": "m:f", "ceiling": 3.0, "name": "checks"}]
    met = draw_plan(_spec(both)).met

    def cand(index, share, checks):
        c = done(index, share)
        c.components["checks"] = checks
        return c

    assert not met([cand(0, 1.0, 2.0), cand(1, 0.5, 3.0)])  # neither at both
    assert met([cand(0, 1.0, 2.0), cand(1, 1.0, 3.0)])
    with pytest.raises(ValueError, match="several rewards cannot judge"):
        _spec(both, filters={"min_margin": 0.1})
