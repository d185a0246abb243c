"""Elastic runs on a local multi-node Ray cluster (ray.cluster_utils.Cluster): a node lost
mid-run, a node added mid-run under `generators: auto`, and reward actors placed with their
generator. Nodes get fake GPUs so that each generator is pinned to a node of its own."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
from ray.cluster_utils import Cluster

from specrej_ray.distributed import scaling
from specrej_ray.distributed.cluster import needed_resources
from specrej_ray.distributed.driver import run_job
from specrej_ray.distributed.placement import group_bundles
from specrej_ray.spec import SpecError, validate_spec
from tests.conftest import tiny_job, write_jsonl
from tests.helpers.runs import finished_shards, shard_records
from tests.helpers.shared_ray import fork_cluster_workers

REWARD = {"type": "callable", "function": "tests.helpers.elastic:score", "threads": 1}
GPU_NODE = {"num_cpus": 2, "num_gpus": 1}  # room for one generator group, no more
QUIET = {"echo": lambda *a, **k: None}


@pytest.fixture
def make_cluster():
    """Start a head (and worker nodes) and connect the driver; always torn down."""
    made: list[Cluster] = []

    def make(head: dict, *workers: dict) -> Cluster:
        if ray.is_initialized():
            ray.shutdown()
        fork_cluster_workers()
        cluster = Cluster(initialize_head=True,
                          head_node_args={"include_dashboard": False, **head})
        made.append(cluster)
        for node in workers:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        return cluster

    yield make
    ray.shutdown()
    for cluster in made:
        cluster.shutdown()


class _JobThread:
    """run_job beside the test: the test itself must change the cluster (Ray starts nodes
    only from the main thread)."""

    def __init__(self, job: dict) -> None:
        self.info: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(job,), daemon=True)
        self.thread.start()

    def _run(self, job: dict) -> None:
        try:
            self.info = run_job(validate_spec(job), **QUIET)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self.error = e

    def until(self, check, what: str, limit_s: float = 120.0) -> None:
        """Wait for check() while the job runs; a job that ended first fails the test."""
        end = time.monotonic() + limit_s
        while not check():
            if not self.thread.is_alive():
                info = self.result()
                raise AssertionError(f"the job ended before {what}: {info['failed_shards']}")
            assert time.monotonic() < end, f"gave up waiting for {what}"
            time.sleep(0.05)

    def result(self, limit_s: float = 180.0) -> dict:
        self.thread.join(timeout=limit_s)
        assert not self.thread.is_alive(), f"the job did not end within {limit_s:.0f}s"
        if self.error is not None:
            raise self.error
        return self.info


def _check_dataset(out: Path, ids: list[str], shards: int) -> None:
    got = [r["id"] for r in pq.read_table(out / "best.parquet").to_pylist()]
    assert sorted(got) == sorted(ids), "every prompt exactly once"
    manifest = shard_records(out)
    assert len(manifest) == shards
    assert sorted(i for p in manifest.values() for i in p) == sorted(ids)


# --- spec and resource shapes (no Ray) ---------------------------------------------------


def _spec(cluster: dict | None = None, **reward) -> dict:
    return {"prompts": {"path": "p.jsonl"}, "generator": {"model": "m"},
            "reward": {"type": "lm_likelihood", "model": "m", **reward},
            "cluster": cluster or {}, "output": {"path": "out"}}


def test_generators_is_a_count_or_auto():
    assert validate_spec(_spec({"generators": "auto"})).cluster.generators == "auto"
    assert validate_spec(_spec({"generators": 3})).cluster.generators == 3
    for bad in (0, "many", True):
        with pytest.raises(SpecError, match=r"cluster\.generators: must be a positive integer "
                                            r"or auto") as e:
            validate_spec(_spec({"generators": bad}))
        assert len(str(e.value).splitlines()) == 1


def test_max_generators_with_a_fixed_count_is_refused():
    assert validate_spec(_spec({"generators": "auto", "max_generators": 8})).cluster \
        .max_generators == 8
    validate_spec(_spec({"generators": 2}))  # the default cap is not the user's: fine
    with pytest.raises(SpecError, match=r"cluster: max_generators applies only with "
                                        r"generators: auto") as e:
        validate_spec(_spec({"generators": 2, "max_generators": 8}))
    assert len(str(e.value).splitlines()) == 1


def test_room_means_one_node_can_hold_a_whole_group(monkeypatch):
    spec = validate_spec(_spec({"generators": "auto", "gpus_per_generator": 1}))
    fleet = scaling.Fleet(spec, start=lambda label: None)
    # Two nodes with one free GPU each: two GPUs free in all, but a group that needs
    # a GPU and a CPU fits only where both are.
    nodes = [{"CPU": 0.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 0.0}]
    monkeypatch.setattr(scaling, "free_per_node", lambda: nodes)
    assert not fleet._room()
    nodes[1]["GPU"] = 1.0
    assert fleet._room()


def test_fractions_shared_with_a_generator_must_fit_one_gpu():
    with pytest.raises(SpecError, match="fractions add up to 1.1") as e:
        validate_spec(_spec({"gpus_per_generator": 0.8}, num_gpus=0.3,
                            placement="with_generator"))
    assert len(str(e.value).splitlines()) == 1
    # Own actors do not share the generator's GPU; a whole GPU is not a fraction.
    validate_spec(_spec({"gpus_per_generator": 0.8}, num_gpus=0.3))
    validate_spec(_spec({"gpus_per_generator": 1}, num_gpus=0.5, placement="with_generator"))


def test_needed_resources_count_generator_groups_and_shared_rewards():
    spec = validate_spec(_spec({"generators": 2, "gpus_per_generator": 0.5,
                                "cpus_per_generator": 2}, num_gpus=0.25, pool_size=2,
                               placement="with_generator"))
    assert group_bundles(spec) == [{"CPU": 2, "GPU": 0.5}] + [{"CPU": 1, "GPU": 0.25}] * 2
    assert needed_resources(spec) == (8, 2)  # two groups of 4 CPUs and 1 GPU
    spec.cluster.generators = "auto"
    assert needed_resources(spec) == (4, 1)  # auto needs room for the first group only
    shared = validate_spec(_spec({"generators": 2, "gpus_per_generator": 0.5},
                                 num_gpus=0.25, pool_size=2))
    assert needed_resources(shared) == (4, 1.5)


# --- a node is lost mid-run ---------------------------------------------------------------


@pytest.mark.ray
def test_node_lost_mid_run_work_continues_on_the_other(tmp_path, tiny_lm_dir, make_cluster):
    cluster = make_cluster({"num_cpus": 1}, GPU_NODE, GPU_NODE)
    gate, where = tmp_path / "gate", tmp_path / "where"
    where.mkdir()
    ids = [f"q{i}" for i in range(6)]
    # Shards 2.. wait for the gate, so the node is surely removed while work is left. One
    # shard in flight per generator: a held shard scored in the same call as shard 0 or 1
    # would hold that one too, until the call timed out (60 s) and was retried alone.
    rows = [{"id": q, "prompt": f"Tell me about {q}. [report:{where}]"
             + (f" [hold:{gate}]" if i >= 2 else "")} for i, q in enumerate(ids)]
    job = tiny_job(tmp_path, tiny_lm_dir, write_jsonl(tmp_path / "p.jsonl", rows),
                   reward=REWARD, cluster={"generators": 2, "gpus_per_generator": 1,
                                           "shard_size": 1, "shards_in_flight": 1,
                                           "call_timeout_s": 60, "startup_timeout_s": 60})
    out = Path(job["output"]["path"])
    run = _JobThread(job)
    run.until(lambda: finished_shards(out) >= 1, "the first shard")
    reward_node = json.loads(next(where.glob("*.json")).read_text())["node_id"]
    victim = next(n for n in cluster.worker_nodes if n.node_id != reward_node)
    cluster.remove_node(victim)
    removed = {"node": victim.node_id, "done": finished_shards(out)}
    gate.touch()
    info = run.result()
    assert removed["done"] < len(ids), "the node was removed after the job"
    assert info["failed_shards"] == []
    _check_dataset(out, ids, shards=len(ids))
    # The lost node's generator finished nothing after the loss, unless Ray restarted it on a
    # live node (a slow machine can time its shards out first: the driver restarts it then).
    lost = [label for label, g in info["generators"].items() if g["node_id"] == removed["node"]]
    assert len(lost) == 1 and len(info["generators"]) == 2
    by_actor = Counter(info["shard_actors"].values())
    moved = info["generators"][lost[0]].get("restarted_on")
    assert by_actor[lost[0]] <= removed["done"] or moved not in (None, removed["node"])
    assert sum(by_actor.values()) == len(ids)


# --- generators: auto takes a node added mid-run, and lets go when the queue drains ------


@pytest.mark.ray
def test_auto_scaling_uses_an_added_node_and_releases_idle_actors(tmp_path, tiny_lm_dir,
                                                                  make_cluster, monkeypatch):
    cluster = make_cluster({"num_cpus": 1}, GPU_NODE)
    asks: list = []  # a local Cluster has no autoscaler: record what the driver asks of it
    monkeypatch.setattr(scaling.sdk, "request_resources", lambda **kw: asks.append(kw))
    gate = tmp_path / "gate"
    ids = [f"q{i}" for i in range(6)]
    # The first shard is held until the fleet gives resources back: meanwhile only a new
    # generator can finish the other shards, and the queue can drain only through it.
    rows = [{"id": q, "prompt": f"Tell me about {q}." + (f" [hold:{gate}]" if i == 0 else "")}
            for i, q in enumerate(ids)]
    reward = dict(REWARD, placement="with_generator")
    job = tiny_job(tmp_path, tiny_lm_dir, write_jsonl(tmp_path / "p.jsonl", rows),
                   reward=reward, cluster={"generators": "auto", "max_generators": 2,
                                           "gpus_per_generator": 1, "shard_size": 1,
                                           "call_timeout_s": 120, "startup_timeout_s": 60})
    run = _JobThread(job)
    run.until(Path(f"{gate}.held").exists, "the first shard to be held")
    added = cluster.add_node(**GPU_NODE).node_id
    run.until(lambda: {"bundles": []} in asks, "idle generators to be released")
    released_while_held = {"bundles": []} in asks and not gate.exists()
    gate.touch()
    info = run.result()
    assert info["failed_shards"] == []
    _check_dataset(Path(job["output"]["path"]), ids, shards=len(ids))
    group = {"CPU": 2.0, "GPU": 1.0}  # the generator and its own reward actor
    assert asks[0] == {"bundles": [group, group]}
    assert released_while_held
    assert asks[-1] == {"bundles": []}
    new = [label for label, g in info["generators"].items() if g["node_id"] == added]
    assert len(new) == 1
    first_shard = min(info["shard_actors"])
    assert info["shard_actors"][first_shard] != new[0]
    # The first generator held the held shard and the one it took in while that decoded
    # (cluster.shards_in_flight 2); the new generator did all the others.
    assert Counter(info["shard_actors"].values())[new[0]] == len(ids) - 2


# --- a reward actor shares its generator's GPU in one placement group ---------------------


@pytest.mark.ray
def test_reward_placed_with_generator_shares_its_placement_group(tmp_path, tiny_lm_dir,
                                                                 make_cluster):
    make_cluster({"num_cpus": 3, "num_gpus": 1})
    where = tmp_path / "where"
    where.mkdir()
    ids = ["a", "b", "c"]
    rows = [{"id": q, "prompt": f"Name a {q}. [report:{where}]"} for q in ids]
    rewards = [dict(REWARD, name="packed", num_gpus=0.5, placement="with_generator"),
               dict(REWARD, name="apart", weight=0.5)]
    job = tiny_job(tmp_path, tiny_lm_dir, write_jsonl(tmp_path / "p.jsonl", rows),
                   reward=rewards, cluster={"gpus_per_generator": 0.5, "shard_size": 2,
                                            "startup_timeout_s": 60})
    info = run_job(validate_spec(job), **QUIET)
    assert info["failed_shards"] == []
    _check_dataset(Path(job["output"]["path"]), ids, shards=2)
    (gen,) = info["generators"].values()
    assert gen["placement_group"] and gen["gpu_ids"] == ["0"]
    reports = [json.loads(p.read_text()) for p in where.glob("*.json")]
    packed = [r for r in reports if r["placement_group"] == gen["placement_group"]]
    apart = [r for r in reports if r["placement_group"] is None]
    assert len(packed) == 1 and len(apart) == 1 and len(reports) == 2
    assert packed[0]["gpu_ids"] == gen["gpu_ids"]  # the same GPU, by fractions
    assert packed[0]["node_id"] == gen["node_id"]
    assert apart[0]["cuda_visible_devices"] == ""  # a CPU-only actor sees no GPU
