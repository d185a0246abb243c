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


@pytest.mark.parametrize("reward", [{"type": "lm_likelihood", "model": "m"},
                                    [{"type": "instructions"}, {"type": "instructions",
                                                                "name": "b"}]])
def test_a_reward_without_a_ceiling_is_refused(reward):
    with pytest.raises(ValueError, match="search.draws .* ceiling"):
        JobSpec.model_validate({
            "prompts": {"path": "p.jsonl"}, "generator": {"model": "gen"}, "reward": reward,
            "search": {"n": 4, "draws": {"max_n": 16}}, "output": {"path": "out"}})
