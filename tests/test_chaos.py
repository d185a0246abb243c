"""A short seeded chaos run (bench/chaos.py; docs/reliability.md has the long ones): a job on a
local Ray cluster of three nodes takes about ten faults in series (drivers killed and
stopped, actors killed, a node lost, a full disk, a stalled reward actor) and must end with
the dataset of an undisturbed run."""

from __future__ import annotations

import json

import pytest

from bench import chaos

pytestmark = pytest.mark.ray


def test_ten_faults_in_series_leave_the_clean_runs_dataset(tmp_path):
    report_path = tmp_path / "chaos.json"
    # 16 shards, 4 in flight: a fault can take 5-10 s, in which a round of shards finishes,
    # so all ten are due by 60% of the shards, leaving the job room to take the last one
    code = chaos.main(["--seed", "3", "--prompts", "80", "--faults", "10", "--gap", "0.5", "1.5",
                       "--due-by", "0.6", "--root", str(tmp_path), "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert report["faults_injected"] == 10, report["faults"]
    assert code == 0 and report["identical"], report["first_difference"]
    assert report["missing"] == report["duplicated"] == 0 and report["leftovers"] == []
    assert report["faults_survived"] == 10, [f for f in report["faults"] if not f["survived"]]
    assert report["restarts"] >= 1  # the seed's draw includes a driver fault
    # every output file was compared, not just best.parquet
    assert {"best.parquet", "candidates.parquet"} <= set(report["files_compared"])
