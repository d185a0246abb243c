"""Whole jobs with generator.engine: vllm on a local Ray cluster: the dataset equals the hf
engine's on the same model and seed (the backends draw the same candidates), a driver killed
mid-shard resumes to the same dataset, vLLM's counters reach run.json, and a model family the
hf engine refuses (Gemma 2: softcapping, a sliding window) runs through vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import signal

import pytest

from specrej_ray.distributed.driver import run_job
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import cli, dataset_rows, shard_records, start_run, wait_for
from tests.helpers.vllm_engines import tiny_vllm_dir
from tests.tiny import save_tiny_gemma2

pytestmark = [pytest.mark.ray, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (make setup installs it)")]

PROMPTS = [{"id": f"p{i}", "prompt": f"Question number {i}: what is {i} plus {i}?"}
           for i in range(6)]


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory):
    return tiny_vllm_dir(tmp_path_factory.mktemp("models") / "tiny-vllm-lm")


def job(tmp, model_dir, engine: str, shard_size: int = 2, max_new: int = 16) -> dict:
    prompts = write_jsonl(tmp / "prompts.jsonl", PROMPTS)
    return tiny_job(
        tmp, model_dir, prompts,
        generator={"model": str(model_dir), "threads": 1, "engine": engine,
                   "vllm": {"enforce_eager": True, "max_model_len": 256},
                   "sampling": {"max_new_tokens": max_new}},
        search={"n": 6, "alpha": 0.5, "schedule": {"tokens": [4, 8]},
                "kv_budget_gb": 0.0625},
        cluster={"shard_size": shard_size}, output={"path": str(tmp / "out")})


def same_rows(a: list[dict], b: list[dict]) -> None:
    """Rows equal but for the float noise of two implementations of one model."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert close(x, y), (x, y)


def close(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return x == pytest.approx(y, abs=1e-4)
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y, strict=True))
    return x == y


def comparable(rows: list[dict]) -> list[dict]:
    # the fingerprint names the spec, generator.engine included
    drop = {"seconds", "engine_seconds", "score_seconds", "partial_scores", "fingerprint"}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory, vllm_dir, ray_cluster):
    tmp = tmp_path_factory.mktemp("hf")
    run_job(validate_spec(job(tmp, vllm_dir, "hf")), echo=lambda *a, **k: None)
    return dataset_rows(tmp / "out")


def test_a_vllm_job_writes_the_hf_engines_dataset(tmp_path, vllm_dir, hf_reference,
                                                  ray_cluster):
    info = run_job(validate_spec(job(tmp_path, vllm_dir, "vllm")), echo=lambda *a, **k: None)
    best, candidates = dataset_rows(tmp_path / "out")
    same_rows(comparable(best), comparable(hf_reference[0]))
    same_rows(comparable(candidates), comparable(hf_reference[1]))
    assert info["counts"]["prompts"] == 6
    generators = list(info["generators"].values())
    assert {g["backend"] for g in generators} == {"vllm"}
    assert sum(g["vllm"]["requests"] for g in generators) >= 6 * 6
    assert all(g["vllm"]["preemptions"] == 0 for g in generators)


def test_a_killed_vllm_job_resumes_to_the_same_dataset(tmp_path, vllm_dir, hf_reference,
                                                       ray_cluster):
    spec = job(tmp_path, vllm_dir, "vllm", shard_size=1)
    path = write_job(tmp_path / "job.yaml", spec)
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    proc = start_run(path, log)
    try:
        wait_for(lambda: len(shard_records(out)) >= 2, proc, log, "two shards written",
                 limit_s=240)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = len(shard_records(out))
    assert done < 6, "the job finished before it was killed"
    rerun = cli("run", path)  # the resume is not the subject: on the shared cluster
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    info = json.loads((out / "run.json").read_text())
    assert len(info["invocations"]) == 2
    best, candidates = dataset_rows(out)
    same_rows(comparable(best), comparable(hf_reference[0]))
    same_rows(comparable(candidates), comparable(hf_reference[1]))


def test_a_model_the_hf_engine_refuses_runs_through_vllm(tmp_path, ray_cluster):
    from specrej_ray.engine.hf.attention import UnsupportedModel
    from specrej_ray.job.engines import make_engine

    gemma = save_tiny_gemma2(tmp_path / "gemma2")
    spec = validate_spec(job(tmp_path, gemma, "vllm", max_new=24))
    with pytest.raises(UnsupportedModel, match="softcap.*set generator.engine: vllm"):
        make_engine(spec, str(gemma), backend="hf")
    info = run_job(spec, echo=lambda *a, **k: None)
    best, candidates = dataset_rows(tmp_path / "out")
    assert [r["id"] for r in best] == [p["id"] for p in PROMPTS]
    assert all(r["response"] is not None for r in best)
    assert sum(c["status"] == "rejected" for c in candidates) > 0
    # candidates ran past the 8-token sliding window
    assert max(c["num_tokens"] for c in candidates) > 8
    assert {g["backend"] for g in info["generators"].values()} == {"vllm"}


def test_vllms_max_model_len_bounds_the_prompts_context(tmp_path, vllm_dir):
    from specrej_ray.job.prepare import context_length

    spec = job(tmp_path, vllm_dir, "vllm")
    assert context_length(str(vllm_dir), validate_spec(spec)) == 256  # under the model's 512
    spec["generator"]["engine"] = "hf"  # the hf engine does not plan by it
    assert context_length(str(vllm_dir), validate_spec(spec)) == 512


def test_schedule_auto_and_the_audit_run_on_vllm_as_on_hf(tmp_path, vllm_dir, ray_cluster):
    """Calibration (Best-of-N prompts scored at the grid's lengths), the chosen setting and
    the shadow Best-of-N audit: the vLLM job's dataset, choice and audit are the hf job's."""
    def auto(engine: str, where):
        spec = job(where, vllm_dir, engine)
        spec["search"].update(schedule="auto", calibration_prompts=2, target_score=1.0,
                              audit_fraction=0.5)
        spec["generator"]["sampling"]["max_new_tokens"] = 20
        info = run_job(validate_spec(spec), echo=lambda *a, **k: None)
        return info, dataset_rows(where / "out")

    (tmp_path / "hf").mkdir()
    (tmp_path / "vllm").mkdir()
    hf_info, hf_rows = auto("hf", tmp_path / "hf")
    v_info, v_rows = auto("vllm", tmp_path / "vllm")
    assert v_info["calibration"]["how"] == "chosen"
    assert v_info["calibration"]["run_with"] == hf_info["calibration"]["run_with"]
    assert v_info["audit"]["prompts"] == hf_info["audit"]["prompts"] > 0
    assert v_info["audit"]["score"] == pytest.approx(hf_info["audit"]["score"], abs=1e-3)
    assert v_info["audit"]["identity_mismatches"] == 0  # the shadow draws the real candidates
    same_rows(comparable(v_rows[0]), comparable(hf_rows[0]))
    same_rows(comparable(v_rows[1]), comparable(hf_rows[1]))


def test_a_vllm_engine_that_cannot_start_is_one_line(tmp_path, vllm_dir, ray_cluster,
                                                    monkeypatch):
    """vLLM refuses a setting: the run says so before Ray starts, in one line naming the key,
    exit 2; and where the driver cannot check (no vLLM there), the generator actor says the
    same in one line, exit 2, with no traceback."""
    from specrej_ray.job import preflight

    spec = job(tmp_path, vllm_dir, "vllm")
    spec["generator"]["vllm"]["engine_kwargs"] = {"max_num_seqs": -3}
    path = write_job(tmp_path / "job.yaml", spec)
    why = ("generator.vllm.engine_kwargs.max_num_seqs: vLLM refuses it: max_num_seqs: Input "
           "should be greater than or equal to 1 (got -3)")
    for checked_first in (True, False):
        if not checked_first:
            for check in ("check_vllm_quick", "check_vllm_config"):
                monkeypatch.setattr(preflight, check, lambda *a, **k: None)
        done = cli("run", path)
        err = [line for line in done.stderr.splitlines() if line.startswith("specrej-ray:")]
        assert done.returncode == 2, done.stderr[-3000:]
        assert len(err) == 1 and why in err[0], done.stderr[-3000:]
        assert "Traceback" not in done.stderr.split("specrej-ray:")[-1]
        assert not (tmp_path / "out").exists()
