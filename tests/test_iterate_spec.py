"""The iterate section and each round's job spec (pure, no Ray): prompts by round, the policy
as generator (and as likelihood reward when asked), what a resumed loop must share."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from specrej_ray.data.prompts import load_prompts
from specrej_ray.distributed.submit import entrypoint, submission_id
from specrej_ray.iterate.rounds import loop_fingerprint, model_dir, round_spec, train_file
from specrej_ray.spec import PromptsSpec, SpecError, validate_spec
from tests.conftest import write_jsonl

ROWS = [{"id": f"q{i}", "prompt": f"Prompt {i}."} for i in range(10)]


def job(tmp_path: Path, **iterate) -> dict:
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    return {"name": "loop", "prompts": {"path": str(prompts), "id_field": "id"},
            "generator": {"model": "/models/base"},
            "reward": {"type": "lm_likelihood", "model": "/models/base"},
            "output": {"path": str(tmp_path / "out"), "formats": ["sft"]},
            "iterate": {"rounds": 3, **iterate}}


def spec_of(data: dict):
    return validate_spec(json.loads(json.dumps(data)))


def ids(spec) -> list[str]:
    return [p.id for p in load_prompts(spec.prompts).prompts]


def test_offset_and_limit_take_a_slice_of_the_valid_prompts(tmp_path):
    rows = [{"prompt": "a"}, {"prompt": ""}, {"prompt": "b"}, {"prompt": "c"}, {"prompt": None},
            {"prompt": "d"}, {"prompt": "e"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    got = load_prompts(PromptsSpec(path=str(path), offset=2, limit=2))
    assert [p.text for p in got.prompts] == ["c", "d"]
    # Row 2's problem (rows count from 1) lies in the first slice; row 5's, between c and
    # d, in this one.
    assert [pr.row for pr in got.problems] == [5]
    assert [p.text for p in load_prompts(PromptsSpec(path=str(path), offset=4)).prompts] == ["e"]


def test_round_0_generates_with_the_spec_round_r_with_the_policy(tmp_path):
    spec = spec_of(job(tmp_path))
    r0 = round_spec(spec, 0, None)
    assert r0.generator.model == "/models/base"
    assert r0.output.path == f"{tmp_path}/out/round-0" and r0.output.if_exists == "resume"
    assert r0.iterate is None
    r2 = round_spec(spec, 2, model_dir(spec.output.path, 1))
    assert r2.generator.model == f"{tmp_path}/out/round-1/model"
    assert r2.reward[0].model == "/models/base"  # fixed: the reward does not follow
    assert ids(r0) == ids(r2) == [r["id"] for r in ROWS]  # mode same
    assert train_file(spec, 2) == f"{tmp_path}/out/round-2/sft_prompt_completion.parquet"


def test_a_round_spec_fingerprints_as_the_same_plain_run(tmp_path):
    data = job(tmp_path)
    plain = {k: v for k, v in data.items() if k != "iterate"}
    assert round_spec(spec_of(data), 0, None).fingerprint() == spec_of(plain).fingerprint()


def test_slice_mode_gives_round_r_its_own_prompts(tmp_path):
    spec = spec_of(job(tmp_path, prompts={"mode": "slice", "per_round": 3}))
    assert [ids(round_spec(spec, r, None if r == 0 else "/m")) for r in range(3)] == [
        ["q0", "q1", "q2"], ["q3", "q4", "q5"], ["q6", "q7", "q8"]]
    data = job(tmp_path, prompts={"mode": "slice", "per_round": 3})
    data["prompts"]["offset"] = 1  # the spec's offset starts slice 0
    assert ids(round_spec(spec_of(data), 1, "/m")) == ["q4", "q5", "q6"]


def test_files_mode_reads_one_file_per_round(tmp_path):
    paths = [str(write_jsonl(tmp_path / f"r{r}.jsonl", [{"id": f"r{r}", "prompt": "x"}]))
             for r in range(3)]
    spec = spec_of(job(tmp_path, prompts={"mode": "files", "paths": paths}))
    assert [ids(round_spec(spec, r, "/m")) for r in range(3)] == [["r0"], ["r1"], ["r2"]]
    with pytest.raises(SpecError, match="lists 2 file"):
        spec_of(job(tmp_path, prompts={"mode": "files", "paths": paths[:2]}))


def test_reward_policy_scores_with_the_rounds_policy(tmp_path):
    data = job(tmp_path, reward="policy")
    data["reward"] = [{"type": "lm_likelihood", "model": "/models/base", "weight": 1},
                      {"type": "lm_likelihood", "model": "/models/judge", "weight": 1}]
    r1 = round_spec(spec_of(data), 1, "/loop/round-0/model")
    assert [r.model for r in r1.reward] == ["/loop/round-0/model", "/models/judge"]
    data["reward"] = {"type": "lm_likelihood", "model": "/models/judge"}
    with pytest.raises(SpecError, match="no lm_likelihood reward uses generator.model"):
        spec_of(data)


def test_a_resumed_loop_may_change_rounds_and_trainer_only(tmp_path):
    base = loop_fingerprint(spec_of(job(tmp_path)))
    assert loop_fingerprint(spec_of(job(tmp_path, rounds=5))) == base
    assert loop_fingerprint(spec_of(job(tmp_path, trainer={
        "type": "command", "command": "train {data} {output}", "num_gpus": 1}))) == base
    for changed in ({"train_from": "base"}, {"prompts": {"mode": "slice", "per_round": 2}},
                    {"reward": "policy"}):
        assert loop_fingerprint(spec_of(job(tmp_path, **changed))) != base, changed
    other = job(tmp_path)
    other["search"] = {"n": 32}
    assert loop_fingerprint(spec_of(other)) != base


def test_the_evaluation_may_be_added_or_changed_on_a_resumed_loop(tmp_path):
    """It reads the policies and changes none of them."""
    data = job(tmp_path)
    data["reward"] = {"type": "instructions"}
    base = loop_fingerprint(spec_of(data))
    for evaluate in ({"prompts": "held_out.jsonl"}, {"prompts": "other.jsonl", "limit": 5}):
        data["iterate"]["evaluate"] = evaluate
        assert loop_fingerprint(spec_of(data)) == base


@pytest.mark.parametrize(("iterate", "expected"), [
    ({"evaluate": {"prompts": "held_out.jsonl"}},
     "iterate.evaluate scores the instructions of its prompts with the spec's reward of type "
     "instructions, and there is none"),
    ({"evaluate": {"limit": 3}}, "iterate.evaluate.prompts"),
    ({"evaluate": {"prompts": "x.jsonl", "limit": 0}}, "iterate.evaluate.limit"),
    ({"train_on": "preference"}, "add preference to output.formats"),
    ({"trainer": {"type": "command", "command": "x {data}"}}, "must save the model to {output}"),
    ({"trainer": {"type": "command", "command": "x {output} {oops}"}}, "unknown field {oops}"),
    ({"trainer": {"type": "command", "command": "x {output", }}, "not a valid template"),
    ({"trainer": {"command": "x {output}"}}, "`command` is for type command"),
    ({"trainer": {"type": "command", "command": "x {output}", "args": {"a": 1}}},
     "put a command trainer's options in its command line"),
    ({"trainer": {"args": {"output_dir": "/x"}}}, "output_dir is chosen by specrej-ray"),
    ({"prompts": {"mode": "same", "per_round": 2}}, "per_round is for mode slice"),
    ({"prompts": {"mode": "files"}}, "mode files needs paths"),
    ({"rounds": 0}, "iterate.rounds"),
    ({"train_on": "dpo"}, "iterate.train_on"),
])
def test_a_bad_iterate_section_is_one_line(tmp_path, iterate, expected):
    with pytest.raises(SpecError) as e:
        spec_of(job(tmp_path, **iterate))
    assert expected in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


def test_submit_iterate_runs_iterate_under_its_own_id(tmp_path):
    spec = spec_of(job(tmp_path))
    assert shlex.split(entrypoint("jobs/a.yaml", ["seed=1"], "iterate")) == [
        "specrej-ray", "iterate", "jobs/a.yaml", "--set", "seed=1"]
    assert submission_id(spec, "iterate") != submission_id(spec)
    assert submission_id(spec, "iterate") == submission_id(spec_of(job(tmp_path)), "iterate")
    assert submission_id(spec, "iterate") != submission_id(spec_of(job(tmp_path, rounds=4)),
                                                           "iterate")
