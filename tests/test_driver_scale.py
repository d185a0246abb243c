"""The driver against a fake generator pool (bench/driver_scale.py; issue 12, point 5) at a size
a test can afford: 10,000 prompts in 100 shards, the driver SIGKILLed at 60% and run again.
The 1M-prompt figures are the same script's, in BENCHMARKS.md."""

from __future__ import annotations

import pytest

from bench import driver_scale
from tests.helpers.zygote import launch
from tests.tiny import save_tiny_lm

pytestmark = pytest.mark.ray


def test_a_driver_killed_at_60_percent_resumes_without_remaking_a_written_shard(tmp_path):
    model = tmp_path / "model"
    save_tiny_lm(model)
    # The drivers are forks of the test zygote, with forked Ray workers: what is measured is
    # the driver's work and its resume, not two interpreters' imports.
    row = driver_scale.measure(10_000, 100, tmp_path / "job", model, kill_at=0.6, start=launch)
    assert row["shards"] == 100
    assert 60 <= row["written_at_kill"] < 100, row
    # Only the shards without a record are made again; a written shard is never remade.
    assert row["rewritten_by_resume"] == 0
    assert row["made_by_resume"] == 100 - row["written_at_kill"]
    # What is rewritten whole stays small: the manifest is a header, run.json grows by a
    # record per shard, not per prompt (about 30 KB here; 10,000 prompts would be 100s of KB).
    assert row["manifest_kb"] < 16
    assert row["run_json_kb"] < 64
