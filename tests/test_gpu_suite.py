"""bench/gpu_suite.py, the suite for a bare GPU machine, run here on CPU with tiny shapes
(--quick): every step runs or says why not, and the JSON holds its figures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # the suite's own process, as on the GPU machine


def test_the_suite_writes_every_steps_figures(tmp_path):
    out = tmp_path / "suite.json"
    done = subprocess.run([sys.executable, "bench/gpu_suite.py", "--device", "cpu", "--quick",
                           "--out", str(out), "--only", "correctness", "kv_bytes",
                           "throughput_8b", "vllm"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
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
    done = subprocess.run([sys.executable, "bench/gpu_suite.py", "--device", "cuda:7",
                           "--quick", "--out", str(out), "--only", "kv_bytes",
                           "throughput_8b"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    report = json.loads(out.read_text())
    if report["gpu"] is None:  # no GPU here: both steps fail, each with its reason
        assert done.returncode == 1
        assert {report[s]["status"] for s in ("kv_bytes", "throughput_8b")} == {"failed"}
        assert all(report[s]["error"] for s in ("kv_bytes", "throughput_8b"))
