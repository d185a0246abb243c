"""A short seeded chaos run (bench/chaos.py; docs/reliability.md has the long ones): a job on a
local Ray cluster of three nodes takes about ten faults in series (drivers killed and
stopped, actors killed, a node lost, a full disk, a stalled reward actor) and must end with
the dataset of an undisturbed run."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from bench import chaos
from specrej_ray.distributed.shard_loop import ShardLoop
from specrej_ray.job.interrupt import Interrupt
from tests.helpers import zygote


@pytest.mark.ray
def test_ten_faults_in_series_leave_the_clean_runs_dataset(tmp_path):
    report_path = tmp_path / "chaos.json"
    # 16 shards, 4 in flight: a fault can take 5-10 s, in which a round of shards finishes,
    # so all ten are due by 60% of the shards, leaving the job room to take the last one.
    # In a process of its own, as it is run: this one may hold the shared cluster, whose node
    # address a cluster started here would take. A fork of the test zygote (`python -m`), so
    # that its cluster's Ray workers are forks too (tests/helpers/ray_worker.py), and so are
    # its drivers (--fork-drivers: fresh, each one's imports were 8-10 CPU-seconds).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = zygote.run(
        [sys.executable, "-m", "bench.chaos", "--seed", "3", "--prompts", "80",
         "--faults", "10", "--gap", "0.5", "1.5", "--due-by", "0.6", "--limit-s", "300",
         "--root", str(tmp_path), "--json", str(report_path), "--fork-drivers"],
        env=env, timeout=540)
    assert report_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    code = proc.returncode
    report = json.loads(report_path.read_text())
    assert report["faults_injected"] == 10, report["faults"]
    assert code == 0 and report["identical"], report["first_difference"]
    assert report["missing"] == report["duplicated"] == 0 and report["leftovers"] == []
    assert report["faults_survived"] == 10, [f for f in report["faults"] if not f["survived"]]
    assert report["restarts"] >= 1  # the seed's draw includes a driver fault
    # every output file was compared, not just best.parquet
    assert {"best.parquet", "candidates.parquet"} <= set(report["files_compared"])


def test_the_harness_refuses_a_process_where_ray_runs(monkeypatch, tmp_path, capsys):
    """Its cluster's nodes would take that Ray's (loopback) node address while its drivers are
    sent to the routable one, and wait for ever to connect."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    with pytest.raises(SystemExit, match="not initialized"):
        chaos.main(["--seed", "1", "--root", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []  # refused before it wrote or started anything


class _Loop:
    """What _pace reads of a shard loop; its _dispatch (below) sends every queued shard."""

    def __init__(self, queued: int, in_flight: bool = False) -> None:
        self.queue, self.in_flight, self.stop = list(range(queued)), in_flight, Interrupt()
        self.sent: list[int] = []

    def _shards_in_flight(self) -> bool:
        return self.in_flight


def _send_all(loop: _Loop) -> None:
    loop.sent += loop.queue
    loop.in_flight = loop.in_flight or bool(loop.queue)
    loop.queue.clear()


@pytest.fixture
def paced(monkeypatch, tmp_path):
    """ShardLoop._dispatch behind the gate; returns (gate, that dispatch)."""
    monkeypatch.setattr(ShardLoop, "_dispatch", _send_all)
    gate = tmp_path / "gate"
    chaos._pace(str(gate))
    return gate, ShardLoop._dispatch


def test_the_gate_holds_back_only_the_last_shard(paced, capsys):
    gate, dispatch = paced
    gate.touch()
    loop = _Loop(3)
    dispatch(loop)  # all the shards a dispatch would send but the last
    assert loop.sent == [0, 1] and loop.queue == [2]
    dispatch(loop)  # those in flight are collected meanwhile: nothing waits
    assert loop.sent == [0, 1] and loop.queue == [2]
    gate.unlink()
    dispatch(loop)
    assert loop.sent == [0, 1, 2] and capsys.readouterr().out == ""
    loop = _Loop(3)
    dispatch(loop)  # no gate: every one
    assert loop.sent == [0, 1, 2]


def test_the_last_shard_waits_for_the_gate_to_go_or_a_stop(paced, capsys):
    gate, dispatch = paced
    gate.touch()
    threading.Timer(0.5, gate.unlink).start()
    loop, t0 = _Loop(1), time.monotonic()
    dispatch(loop)  # nothing else in flight: the driver waits here
    assert loop.sent == [0] and time.monotonic() - t0 >= 0.5
    assert capsys.readouterr().out == chaos.HELD + "\n"
    gate.touch()
    loop = _Loop(2)
    loop.stop.signum = 15  # a stop is obeyed at once (the loop then sends nothing more)
    dispatch(loop)
    assert loop.sent == [0, 1] and gate.exists()
