"""A reward ensemble end to end on local Ray: every component is kept per candidate."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from specrej_ray.cli import main
from specrej_ray.distributed.driver import JobError, run_job
from specrej_ray.search.combine import zscores
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl

pytestmark = pytest.mark.ray



def test_two_rewards_combine_and_are_recorded(tmp_path, tiny_lm_dir, ray_cluster):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello there"},
                                                 {"id": "b", "prompt": "Say a word"}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, reward=[
        {"type": "lm_likelihood", "model": str(tiny_lm_dir), "threads": 1, "name": "lik"},
        {"type": "callable", "function": "tests.helpers.rewards:vowels", "weight": 2.0},
    ])
    spec = validate_spec(job)
    assert spec.reward_label.startswith("zscore(1*lik + 2*callable(")
    run_job(spec, echo=lambda *a, **k: None)
    cands = pq.read_table(tmp_path / "out" / "candidates.parquet").to_pylist()
    for pid in ("a", "b"):
        finished = [c for c in cands if c["prompt_id"] == pid and c["status"] == "finished"]
        comps = [{s["name"]: s["score"] for s in c["component_scores"]} for c in finished]
        assert all(set(c) == {"lik", "callable(tests.helpers.rewards:vowels)"} for c in comps)
        vowel = [c["callable(tests.helpers.rewards:vowels)"] for c in comps]
        assert vowel == [sum(ch in "aeiou" for ch in c["text"]) for c in finished]
        za, zb = zscores([c["lik"] for c in comps]), zscores(vowel)
        expected = [(a + 2 * b) / 3 for a, b in zip(za, zb, strict=True)]
        assert [c["final_score"] for c in finished] == pytest.approx(expected)


def test_actors_that_cannot_be_placed_fail_fast(tmp_path, tiny_lm_dir, ray_cluster):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello"}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, cluster={"generators": 4})
    with pytest.raises(JobError, match=r"need 5 CPUs \(the cluster has 4\)"):
        run_job(validate_spec(job), echo=lambda *a, **k: None)


def test_a_broken_reward_stops_the_job_and_keeps_finished_work(tmp_path, tiny_lm_dir,
                                                               ray_cluster):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "fine", "prompt": "Hello"},
                                                 {"id": "bad", "prompt": "poison"}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, cluster={"shard_size": 1},
                   reward={"type": "callable", "function": "tests.helpers.rewards:nan_on_poison"})
    with pytest.raises(JobError, match="gave nan for prompt 'bad' candidate 0"):
        run_job(validate_spec(job), echo=lambda *a, **k: None)
    best = pq.read_table(tmp_path / "out" / "best.parquet").to_pylist()
    assert [r["id"] for r in best] == ["fine"]
    errors = (tmp_path / "out" / "errors.jsonl").read_text()
    assert "gave nan" in errors


def test_a_reward_raising_at_run_time_is_a_user_error(tmp_path, tiny_lm_dir, ray_cluster,
                                                      capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "fine", "prompt": "Hello"},
                                                 {"id": "bad", "prompt": "poison"}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, cluster={"shard_size": 1},
                   reward={"type": "callable", "function": "tests.helpers.rewards:raises"})
    assert main(["run", str(write_job(tmp_path / "job.yaml", job))]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "specrej-ray: error: reward callable(tests.helpers.rewards:raises) raised ValueError: "
        "cannot score poison; fix the reward (finished shards are kept: run again to resume)")
    out = tmp_path / "out"
    [failure] = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert failure["shard"] and failure["prompt_ids"] == ["bad"]
    [invocation] = json.loads((out / "run.json").read_text())["invocations"]
    assert (invocation["status"], invocation["shards_done"], invocation["shards_failed"]) == (
        "failed", 1, 1)
