"""bench/ray_overhead.py on the tiny model: both runs happen, are timed, and agree."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers import zygote

pytestmark = pytest.mark.ray


def test_ray_overhead_times_both_runs_and_checks_identity(tmp_path, tiny_lm_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl",
                          [{"id": f"q{i}", "prompt": f"Tell me about {i}."} for i in range(4)])
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir, prompts))
    figures = tmp_path / "overhead.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    # A fork of the test zygote (`python -m`), so that its Ray's workers are forks too
    # (tests/helpers/ray_worker.py): as a fresh interpreter each actor imported torch anew.
    done = zygote.run([sys.executable, "-m", "bench.ray_overhead", str(job), "--prompts", "3",
                       "--json", str(figures)], env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(figures.read_text())
    assert result["prompts"] == 3 and result["shard_size"] == 2  # the first K only
    assert result["best_identical"] == result["best_compared"] == 3
    assert result["in_process_s"] > 0 and result["ray_shards_s"] > 0
    assert result["ray_startup_s"] > 0
    assert result["overhead"] == pytest.approx(result["ray_shards_s"] / result["in_process_s"])
    assert "overhead:" in done.stdout and "best responses identical: 3/3" in done.stdout


def test_a_bad_job_path_is_one_line_and_exit_2(tmp_path, capsys):
    from bench.ray_overhead import main

    assert main([str(tmp_path / "no.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "no.yaml" in err
