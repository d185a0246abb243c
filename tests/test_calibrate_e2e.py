"""schedule: auto on a local Ray cluster: the first prompts calibrate as Best-of-N, their data
chooses the setting the others run with, and a resume reuses the choice."""

from __future__ import annotations

import json

import pytest

from specrej_ray.distributed.driver import run_job
from specrej_ray.quality import auto_schedule
from specrej_ray.spec import SpecError, validate_spec
from tests.conftest import tiny_job, write_jsonl
from tests.helpers.runs import dataset_rows

pytestmark = pytest.mark.ray

QUIET = {"echo": lambda *a, **k: None}


def job(tmp_path, tiny_lm_dir, **search):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Tell me {i}."}
                                                 for i in range(5)])
    spec = tiny_job(tmp_path, tiny_lm_dir, prompts,
                    search={"n": 6, "schedule": "auto", "calibration_prompts": 2, **search})
    spec["generator"]["sampling"]["max_new_tokens"] = 20
    return spec


def statuses(cands, pid):
    return {c["status"] for c in cands if c["prompt_id"] == pid}


def test_calibration_prompts_run_best_of_n_and_choose_for_the_rest(tmp_path, tiny_lm_dir,
                                                                   ray_cluster):
    spec = job(tmp_path, tiny_lm_dir, target_score=1.0)  # any setting qualifies
    info = run_job(validate_spec(spec), **QUIET)
    cal = info["calibration"]
    assert cal["prompts"] == ["q0", "q1"] and cal["grid"] == [8, 16]
    assert cal["how"] == "chosen" and cal["run_with"]["alpha"] > 0
    assert len(cal["settings"]) > 4 and all(s["low"] <= s["mean_score"] <= s["high"]
                                            for s in cal["settings"])
    assert {c["tokens"] for c in cal["correlations"]} == {8, 16}
    out = tmp_path / "out"
    assert json.loads((out / "calibration.json").read_text())["run_with"] == cal["run_with"]
    best, cands = dataset_rows(out)
    assert [r["id"] for r in best] == [f"q{i}" for i in range(5)]
    # Calibration prompts are Best-of-N: every candidate ran to its end.
    assert statuses(cands, "q0") == statuses(cands, "q1") == {"finished"}
    assert any("rejected" in statuses(cands, f"q{i}") for i in range(2, 5))
    # Their data is kept with their shards, for a resume.
    records = [json.loads(p.read_text()) for p in (out / "shards").glob("*.json")]
    tables = {pid for r in records for pid in r.get("calibration", {})}
    assert tables == {"q0", "q1"}


def test_no_setting_reaching_the_target_runs_best_of_n_and_says_so(tmp_path, tiny_lm_dir,
                                                                   ray_cluster):
    info = run_job(validate_spec(job(tmp_path, tiny_lm_dir, target_score=100.0)), **QUIET)
    cal = info["calibration"]
    if cal["how"] == "chosen":  # every setting kept every best: then nothing can be said
        pytest.skip("the tiny model's rewards happened to rank perfectly")
    assert cal["run_with"] == {"alpha": 0.0, "schedule": None}
    assert cal["reason"].startswith("no setting's 95% lower bound reaches 100")
    _, cands = dataset_rows(tmp_path / "out")
    assert all(c["status"] == "finished" for c in cands)


def test_a_resume_reuses_the_choice(tmp_path, tiny_lm_dir, ray_cluster, monkeypatch):
    spec = job(tmp_path, tiny_lm_dir, target_score=1.0)
    first = run_job(validate_spec(spec), **QUIET)
    out = tmp_path / "out"
    want = dataset_rows(out)
    # Lose a shard of the other prompts (its record, so it counts as not done).
    other = sorted(p for p in (out / "shards").glob("*.json")
                   if "calibration" not in json.loads(p.read_text()))[0]
    other.unlink()

    def no_recalibration(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(auto_schedule, "decide_setting", no_recalibration)
    again = run_job(validate_spec(spec), **QUIET)
    assert again["calibration"] == first["calibration"]
    assert dataset_rows(out) == want  # the lost shard made again with the same setting
    assert len(again["shard_seconds"]) == 1  # the lost shard only


def test_auto_needs_sbon(tmp_path, tiny_lm_dir):
    spec = job(tmp_path, tiny_lm_dir)
    spec["search"]["mode"] = "bon"
    with pytest.raises(SpecError, match="schedule: auto"):
        validate_spec(spec)
