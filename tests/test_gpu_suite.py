"""bench/gpu_suite.py, the suite for a bare GPU machine, run here on CPU with tiny shapes
(--quick): every step runs or says why not, and the JSON holds its figures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import zygote

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # the suite's own process, as on the GPU machine


def _run_suite(*args: str) -> subprocess.CompletedProcess:
    """The suite in a process of its own: a fork of the test zygote (tests/helpers/zygote.py),
    which has its imports done, without the test process's Ray to connect to."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return zygote.run([sys.executable, "-m", "bench.gpu_suite", *args], env=env, timeout=600)


def test_the_suite_writes_every_steps_figures(tmp_path):
    out = tmp_path / "suite.json"
    done = _run_suite("--device", "cpu", "--quick", "--out", str(out), "--only", "correctness",
                      "kv_bytes", "throughput_8b", "vllm")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["quick"] is True
    assert report["correctness"]["passed"] and "passed" in report["correctness"]["summary"]
    kv = report["kv_bytes"]
    assert kv["within_budget"] and 0 < kv["peak_share_of_budget"] <= 1
    assert [r["batch"] for r in report["throughput_8b"]["rows"]] == [4, 8]
    assert all(r["tokens_per_s"] > 0 for r in report["throughput_8b"]["rows"])
    vllm = report["vllm"]
    if importlib.util.find_spec("vllm") is None:
        assert vllm["status"] == "skipped" and "not importable" in vllm["why"]
    else:
        assert vllm["status"] == "ok"
        assert [a["name"] for a in vllm["arms"]] == ["vllm:sbon", "vllm:bon-8", "vllm-n8"]
        assert all(a["vllm"]["requests"] > 0 for a in vllm["arms"])
    assert "engine_bench" not in report  # --only


def test_a_failing_step_is_recorded_and_the_others_still_run(tmp_path):
    out = tmp_path / "suite.json"
    done = _run_suite("--device", "cuda:7", "--quick", "--out", str(out), "--only", "kv_bytes",
                      "throughput_8b")
    report = json.loads(out.read_text())
    if report["gpu"] is None:  # no GPU here: both steps fail, each with its reason
        assert done.returncode == 1
        assert {report[s]["status"] for s in ("kv_bytes", "throughput_8b")} == {"failed"}
        assert all(report[s]["error"] for s in ("kv_bytes", "throughput_8b"))


def test_issue30_steps_run_quick_on_cpu(tmp_path):
    """The four steps issue 30 needs from a GPU run, tiny on CPU: each ends ok with its
    figures, and the JSON was written as they went."""
    out = tmp_path / "suite.json"
    done = _run_suite("--device", "cpu", "--quick", "--out", str(out), "--only", "issue30")
    report = json.loads(out.read_text())
    steps = ["self_check_8b", "reward_rate", "gpu_busy", "sbon_vs_bon_8b"]
    assert {s: report[s]["status"] for s in steps} == dict.fromkeys(steps, "ok"), \
        done.stderr[-3000:]
    assert done.returncode == 0
    assert "correctness" not in report and "kv_bytes" not in report  # the group only

    check = report["self_check_8b"]
    for dtype in ("float16", "bfloat16"):
        assert isinstance(check[dtype]["passes"], bool) and "runner" in check[dtype]
        assert check["passes"][dtype] == check[dtype]["passes"]
    assert check["float16"]["passes"]  # a tiny model: the engine matches the model

    rate = report["reward_rate"]
    assert rate["responses"] == 8 and rate["batch_size"] == 4
    assert rate["tokens"] == 8 * 64 and rate["tokens_per_s"] > 0 and rate["finite_scores"] == 8

    busy = report["gpu_busy"]
    assert busy["rows"] == 16 and busy["mean_rows"] == 16
    assert busy["ms_per_step"] > 0 and busy["profiled_ms_per_step"] > 0
    assert busy["profiled_steps"] == 3 and busy["cpu_ops_per_step"] > 0
    assert busy["gpu_busy_fraction"] is None and "not applicable" in busy["gpu_busy_note"]

    race = report["sbon_vs_bon_8b"]
    assert race["check_bypassed"] is False and race["decision_tokens"] == [8]
    for arm in ("sbon", "bon"):
        a = race["arms"][arm]
        assert a["seconds"] > 0 and a["decode_steps"] > 0 and a["rows_per_step"] > 0
        assert a["ms_per_step"] > 0 and a["tokens_decoded"] > 0
    assert race["arms"]["bon"]["tokens_generated"] == 2 * 4 * 16  # EOS off: every row runs
    assert race["arms"]["sbon"]["rejected"] > 0
    assert race["arms"]["sbon"]["tokens_decoded"] < race["arms"]["bon"]["tokens_decoded"]
    assert race["speedup"] == pytest.approx(
        race["arms"]["bon"]["seconds"] / race["arms"]["sbon"]["seconds"])


def _suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", REPO / "bench/gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_refused_self_check_is_recorded_then_bypassed(monkeypatch):
    """Where the runner refuses the model, runner_for records the refusal and builds the
    runner with the check bypassed, so that the speed is still measured."""
    import torch

    from specrej_ray.engine.hf import model_runner
    from specrej_ray.engine.hf.attention import UnsupportedModel

    suite = _suite()
    model, tok = suite.random_llama(suite.TINY, "cpu", torch.float32)
    real_init, calls = model_runner.ModelRunner.__init__, []

    def refuse_once(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise UnsupportedModel("the engine's logits differ by too much")
        real_init(self, *a, **k)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", refuse_once)
    runner, info = suite.runner_for(model)
    assert info["check_bypassed"] is True and "differ by too much" in info["check_refusal"]
    assert info["bypass"] in ("bound", "_check")
    monkeypatch.setattr(model_runner.ModelRunner, "__init__", real_init)
    result = suite.engine_on(model, tok, 2, 0.0, None, 4, 10**4,
                             runner=runner).run(suite.tasks_of(tok, 1))[0]
    assert result.tokens_generated == 2 * 4


def test_a_step_cut_short_keeps_the_figures_it_had(tmp_path):
    """The JSON is written as a step goes (progress) and after it: a step that fails after
    its first arm keeps that arm's figures, marked failed."""
    suite = _suite()
    path = tmp_path / "r.json"
    report: dict = {}
    suite.RECORD = record = suite.Record(report, path)
    seen = []

    def two_arms():
        suite.progress("race", arms={"sbon": {"seconds": 1.5}})
        seen.append(json.loads(path.read_text())["race"])
        raise RuntimeError("out of time")

    suite.step("race", two_arms, report, record)
    assert seen == [{"status": "running", "arms": {"sbon": {"seconds": 1.5}}}]
    saved = json.loads(path.read_text())["race"]
    assert saved["status"] == "failed" and "out of time" in saved["error"]
    assert saved["arms"] == {"sbon": {"seconds": 1.5}} and saved["seconds"] >= 0
