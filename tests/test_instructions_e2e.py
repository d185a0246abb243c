"""reward.type instructions end to end on local Ray: each row's own instructions score its
candidates in the generator's process, each instruction's verdict is kept, a row the
checkers cannot score is named and skipped, bounds stop candidates, and the reward joins an
ensemble with a model reward."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from specrej_ray.cli import main
from specrej_ray.distributed.driver import run_job
from specrej_ray.reward.instructions import follows, parse_row, share
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl

pytestmark = pytest.mark.ray

ROWS = [
    {"id": "a", "prompt": "Write anything.",
     "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],
     "kwargs": [{}, {}]},
    {"id": "b", "prompt": "Write more.",
     "instruction_id_list": ["keywords:letter_frequency", "punctuation:no_comma"],
     "kwargs": [{"letter": "e", "let_frequency": 1, "let_relation": "at least"}, {}]},
    {"id": "bad", "prompt": "Write.", "instruction_id_list": ["foo:bar"], "kwargs": [{}]},
    {"id": "c", "prompt": "Write less.",
     "instruction_id_list": ["length_constraints:number_words"],
     "kwargs": [{"num_words": 3, "relation": "less than"}]},
]


def _job(tmp_path, tiny_lm_dir, out: str, **sections) -> dict:
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    sections = {"reward": {"type": "instructions"},
                "search": {"mode": "bon", "n": 8, "bounds_every": 2},
                "generator": {"model": str(tiny_lm_dir), "threads": 1,
                              "sampling": {"max_new_tokens": 16}}, **sections}
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, **sections)
    job["output"] = {"path": str(tmp_path / out), "formats": ["sft", "preference"]}
    return job


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory, tiny_lm_dir, ray_cluster):
    tmp_path = tmp_path_factory.mktemp("instructions")
    job = _job(tmp_path, tiny_lm_dir, "out")
    assert main(["validate", str(write_job(tmp_path / "job.yaml", job))]) == 2  # row "bad"
    run_job(validate_spec(job), echo=lambda *a, **k: None)
    return tmp_path / "out"


def test_each_candidate_is_scored_on_its_rows_instructions(pruned_run):
    cands = pq.read_table(pruned_run / "candidates.parquet").to_pylist()
    rows = {r["id"]: parse_row(r["instruction_id_list"], r["kwargs"], r["prompt"])
            for r in ROWS if r["id"] != "bad"}
    finished = [c for c in cands if c["status"] == "finished"]
    assert finished
    for c in finished:
        strict = follows(rows[c["prompt_id"]], c["text"])
        assert c["final_score"] == share(strict)
        assert [(v["id"], v["followed"]) for v in c["instructions"]] == list(
            zip(rows[c["prompt_id"]].ids, strict, strict=True))
    best = pq.read_table(pruned_run / "best.parquet").to_pylist()
    for b in best:
        scores = [c["final_score"] for c in finished if c["prompt_id"] == b["id"]]
        assert b["reward"] == max(scores)


def test_bounds_stop_candidates_and_the_run_says_so(pruned_run):
    cands = pq.read_table(pruned_run / "candidates.parquet").to_pylist()
    pruned = [c for c in cands if c["status"] == "pruned"]
    assert pruned and all(c["instructions"] == [] for c in pruned)
    [gen] = json.loads((pruned_run / "run.json").read_text())["generators"].values()
    assert gen["engine"]["pruned"] == len(pruned) and gen["engine"]["bounds_checks"] > 0


def test_a_row_the_checkers_cannot_score_is_skipped_and_named(pruned_run):
    errors = [json.loads(x) for x in (pruned_run / "errors.jsonl").read_text().splitlines()]
    [bad] = [e for e in errors if e.get("id") == "bad"]
    assert "unknown instruction id 'foo:bar'" in bad["reason"]


def test_with_a_model_reward_in_an_ensemble(tmp_path, tiny_lm_dir, ray_cluster):
    job = _job(tmp_path, tiny_lm_dir, "ens", reward=[
        {"type": "instructions", "name": "checks"},
        {"type": "lm_likelihood", "model": str(tiny_lm_dir), "threads": 1, "name": "lik"}])
    job["search"] = {"mode": "sbon", "n": 4, "alpha": 0.5, "schedule": {"tokens": [4]}}
    run_job(validate_spec(job), echo=lambda *a, **k: None)
    cands = pq.read_table(tmp_path / "ens" / "candidates.parquet").to_pylist()
    finished = [c for c in cands if c["status"] == "finished"]
    assert finished and all({s["name"] for s in c["component_scores"]} == {"checks", "lik"}
                            for c in finished)
    assert all({v["reward"] for v in c["instructions"]} == {"checks"} for c in finished)


def test_draws_and_branching_stop_each_prompt_where_it_has_what_it_keeps(tmp_path,
                                                                        tiny_lm_dir):
    """search.draws and search.branch through a run (issue 56): every prompt says why it
    stopped; one that kept has a response following every instruction; and the dataset is
    the same when its prompts share the batch differently (another shard size)."""
    from tests.helpers.runs import dataset_rows

    rows = [r for r in ROWS if r["id"] != "bad"]
    search = {"mode": "sbon", "n": 4, "alpha": 0.5, "schedule": {"tokens": [4, 8]},
              "bounds": False, "draws": {"max_n": 12}, "branch": True}
    runs = []
    for shard_size in (1, 3):
        job = _job(tmp_path, tiny_lm_dir, f"out{shard_size}", search=search)
        job["prompts"]["path"] = str(write_jsonl(tmp_path / "rows.jsonl", rows))
        job["output"]["formats"] = ["sft"]
        job["cluster"] = {**job.get("cluster", {}), "shard_size": shard_size}
        run_job(validate_spec(job), echo=lambda *a, **k: None)
        runs.append(dataset_rows(tmp_path / f"out{shard_size}"))
    best, cands = runs[0]
    assert {b["stop_reason"] for b in best} <= {"kept", "cap"}
    for b in best:
        assert (b["reward"] == 1.0) == (b["stop_reason"] == "kept")
        assert b["stop_reason"] == "kept" or b["n"] - sum(
            c["parent"] is not None for c in cands if c["prompt_id"] == b["id"]) == 12
    assert all(c["stop_reason"] for c in cands)
    assert any(c["parent"] is not None for c in cands)  # survivors branched
    assert runs[0] == runs[1]
