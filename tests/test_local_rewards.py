"""reward.type instructions in the job: the rows' instruction columns read and tied to the
results, bad rows named, the engine's LocalScores, the spec's refusals, what bounds keep."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specrej_ray.data.content_keys import content_key
from specrej_ray.data.formats import kept_by
from specrej_ray.data.prompt_store import PromptStore
from specrej_ray.data.prompts import Prompt, PromptError, PromptTask, load_prompts
from specrej_ray.job.local_rewards import local_scores, row_fields, row_problem
from specrej_ray.reward.instructions import follows, parse_row, share
from specrej_ray.search.bounds import Keep
from specrej_ray.spec import PromptsSpec, SpecError, validate_spec
from tests.conftest import write_jsonl

ROW = {"id": "a", "prompt": "Describe the sea.",
       "instruction_id_list": ["punctuation:no_comma", "detectable_content:postscript"],
       "kwargs": [{}, {"postscript_marker": "P.S."}]}
FIELDS = (("reward.instructions_field", "instruction_id_list"), ("reward.kwargs_field", "kwargs"))


def job(tmp_path, reward=None, **output) -> dict:
    return {"prompts": {"path": str(tmp_path / "p.jsonl"), "id_field": "id"},
            "generator": {"model": "smollm2-135m-instruct"},
            "reward": reward or {"type": "instructions"},
            "output": {"path": str(tmp_path / "out"), **output}}


def test_rows_carry_their_instruction_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [ROW, {"id": "b", "prompt": "Hi"}])
    a, b = load_prompts_with(path, FIELDS)
    assert json.loads(a.extra) == {"instruction_id_list": ROW["instruction_id_list"],
                                   "kwargs": ROW["kwargs"]}
    assert json.loads(b.extra) == {"instruction_id_list": None, "kwargs": None}
    assert load_prompts(PromptsSpec(path=str(path), id_field="id")).prompts[0].extra is None


def test_parquet_rows_as_ifeval_ships_them(tmp_path):
    """IFEval's Parquet: kwargs a list of structs holding every argument, unused ones null."""
    kwargs = [{"postscript_marker": None, "num_words": None},
              {"postscript_marker": "P.S.", "num_words": None}]
    table = pa.table({"key": [1], "prompt": ["Write."], "kwargs": [kwargs],
                      "instruction_id_list": [ROW["instruction_id_list"]]})
    pq.write_table(table, tmp_path / "p.parquet")
    [p] = load_prompts_with(tmp_path / "p.parquet", FIELDS)
    fields = json.loads(p.extra)
    parse_row(fields["instruction_id_list"], fields["kwargs"], p.text)  # does not raise


def test_a_missing_instruction_column_names_the_field(tmp_path):
    pq.write_table(pa.table({"prompt": ["Write."]}), tmp_path / "p.parquet")
    with pytest.raises(PromptError, match=r"^reward.instructions_field: no column "
                                          r"'instruction_id_list' in"):
        load_prompts_with(tmp_path / "p.parquet", FIELDS)


def load_prompts_with(path, extra):
    from specrej_ray.data.prompts import iter_prompts

    return [p for p in iter_prompts(PromptsSpec(path=str(path)), extra)
            if isinstance(p, Prompt)]


def test_results_are_tied_to_the_instructions():
    """Resume keeps a prompt's results only while its content is unchanged: its
    instructions are part of it."""
    plain = content_key("hi", None, [1, 2])
    assert content_key("hi", None, [1, 2], None) == plain
    with_ids = content_key("hi", None, [1, 2], '{"instruction_id_list": ["a"]}')
    assert with_ids["text"] != plain["text"]
    assert with_ids != content_key("hi", None, [1, 2], '{"instruction_id_list": ["b"]}')


def test_the_prompt_store_keeps_the_columns(tmp_path):
    p = Prompt("a", "hi", None, 1, '{"kwargs": null}')
    store = PromptStore.build([([p], [PromptTask("a", "hi", [1], False, p.extra)])], tmp_path)
    assert store.prompts([0])[0].extra == p.extra
    assert store.tasks([0])[0].extra == p.extra


def test_a_bad_row_is_named_in_one_line(tmp_path):
    spec = validate_spec(job(tmp_path))
    bad = Prompt("x", "Say hi.", None, 3, json.dumps({"instruction_id_list": ["foo:bar"],
                                                      "kwargs": [{}]}))
    why = row_problem(spec, bad)
    assert why.startswith("instruction_id_list: unknown instruction id 'foo:bar'")
    assert "\n" not in why
    good = Prompt("a", ROW["prompt"], None, 1, json.dumps({k: ROW[k] for k in
                                                           ("instruction_id_list", "kwargs")}))
    assert row_problem(spec, good) is None
    assert row_fields(spec) == FIELDS


@pytest.mark.parametrize("loose", [False, True])
def test_the_engine_scores_what_the_reward_defines(tmp_path, loose):
    spec = validate_spec(job(tmp_path, {"type": "instructions", "loose": loose}))
    task = PromptTask("a", ROW["prompt"], [1], False,
                      json.dumps({k: ROW[k] for k in ("instruction_id_list", "kwargs")}))
    scores = local_scores(spec, task)
    row = parse_row(ROW["instruction_id_list"], ROW["kwargs"], ROW["prompt"])
    texts = ["calm blue water", "calm, blue water\n\nP.S. swim", "*calm* water\nP.S. ok"]
    for text, [got] in zip(texts, scores.score(texts), strict=True):
        assert got == share(follows(row, text, loose))
    [(name, verdicts)] = scores.details(texts[1]).items()
    assert name == spec.reward[0].label
    # Loose: without its first line the response has no comma.
    assert verdicts == [{"id": "punctuation:no_comma", "followed": loose},
                        {"id": "detectable_content:postscript", "followed": True}]
    for key, text in enumerate(texts):  # the bounds of every prefix hold the final score
        [[final]] = scores.score([text])
        for cut in range(len(text) + 1):  # one candidate's text growing: verdicts carried
            [[(lo, hi)]] = scores.bounds([text[:cut]], [key])
            assert lo <= final <= hi


def test_a_job_without_local_rewards_has_no_local_scores(tmp_path):
    spec = validate_spec(job(tmp_path, {"type": "callable", "function": "m:f"}))
    assert local_scores(spec, PromptTask("a", "hi", [1])) is None
    assert row_fields(spec) == ()


@pytest.mark.parametrize(("reward", "match"), [
    ({"type": "instructions", "model": "x", "pool_size": 2},
     r"instructions is scored in the generator's process .*: model, pool_size do\(es\) not "
     "apply"),
    ({"type": "callable", "function": "m:f", "loose": True},
     "loose only apply to reward.type instructions"),
])
def test_knobs_that_would_do_nothing_are_refused(tmp_path, reward, match):
    with pytest.raises(SpecError, match=match):
        validate_spec(job(tmp_path, reward))


def test_what_bounds_keep_follows_the_output_section(tmp_path):
    spec = validate_spec(job(tmp_path))
    assert kept_by(spec.output) == Keep(top=4)  # top_k is written by default
    spec = validate_spec(job(tmp_path, formats=["sft", "preference"],
                             filters={"drop_truncated": True, "min_reward": 0.5,
                                      "dedupe": False}))
    assert kept_by(spec.output) == Keep(1, True, 0.5, False)
