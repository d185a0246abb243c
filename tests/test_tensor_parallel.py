"""Tensor-parallel generators (generator.tensor_parallel_size: k) on a local Ray cluster with
faked GPUs: the placement arithmetic (bundles, what fits on which node) and the placement
vLLM's Ray executor sees from inside the generator. vLLM itself needs real GPUs for this;
its side is the env the actor hands it (VLLM_RAY_BUNDLE_INDICES)."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from specrej_ray.distributed import placement
from specrej_ray.distributed.cluster import check_resources, needed_resources
from specrej_ray.distributed.generator import generator_options, tensor_parallel_env
from specrej_ray.distributed.placement import generator_bundles, group_bundles, group_shape
from specrej_ray.distributed.reward_pool import actor_runtime_env
from specrej_ray.errors import JobError
from specrej_ray.job.engines import pick_backend
from specrej_ray.spec import SpecError, validate_spec
from tests.conftest import tiny_job
from tests.helpers.shared_ray import fork_cluster_workers

pytestmark = pytest.mark.ray


def spec_of(tmp_path, k: int, generators: int = 1, **cluster):
    job = tiny_job(tmp_path, tmp_path / "m", tmp_path / "p.jsonl")
    job["generator"].update(engine="vllm", tensor_parallel_size=k)
    job["reward"] = {"type": "callable", "function": "tests.helpers.elastic:score",
                     "placement": "with_generator", "num_gpus": 0.25, "pool_size": 2}
    job["cluster"] = {"generators": generators, **cluster}
    return validate_spec(job)


def test_a_tp_generator_is_k_gpu_bundles_then_its_rewards(tmp_path):
    spec = spec_of(tmp_path, 4)
    assert generator_bundles(spec) == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert group_bundles(spec)[4:] == [{"CPU": 1.0, "GPU": 0.25}] * 2
    assert group_shape(spec) == {"CPU": 6.0, "GPU": 4.5}
    assert needed_resources(spec_of(tmp_path, 4, generators=2)) == (12.0, 9.0)
    assert tensor_parallel_env(4)["env_vars"] == {"VLLM_RAY_PER_WORKER_GPUS": "1",
                                                  "VLLM_RAY_BUNDLE_INDICES": "0,1,2,3"}
    assert pick_backend("auto", has_gpu=False, tensor_parallel=4) == "vllm"


@pytest.mark.parametrize(("gpus", "ok"), [(0, True), (4, True), (1, False), (0.5, False)])
def test_gpus_per_generator_must_agree_with_tp(tmp_path, gpus, ok):
    if ok:
        spec_of(tmp_path, 4, gpus_per_generator=gpus)
        return
    with pytest.raises(SpecError, match="with generator.tensor_parallel_size 4 a generator "
                                        "takes 4 GPUs"):
        spec_of(tmp_path, 4, gpus_per_generator=gpus)


def test_tp_needs_an_engine_that_does_it(tmp_path):
    job = tiny_job(tmp_path, tmp_path / "m", tmp_path / "p.jsonl")
    job["generator"].update(engine="hf", tensor_parallel_size=2)
    with pytest.raises(SpecError, match="tensor_parallel_size > 1 needs engine: vllm"):
        validate_spec(job)


@pytest.fixture(scope="module")
def gpu_cluster():
    """Two nodes of 4 faked GPUs and a head without any; one for the module (a cluster of
    three nodes is most of each test's time), whose tests leave nothing placed in it."""
    if ray.is_initialized():
        ray.shutdown()
    fork_cluster_workers()
    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False,
                                                             "num_cpus": 2})
    nodes = [cluster.add_node(num_cpus=8, num_gpus=4) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


@ray.remote(num_cpus=0)
def where() -> tuple[str, str | None]:
    ctx = ray.get_runtime_context()
    pg = ray.util.get_current_placement_group()
    return ctx.get_node_id(), pg.id.hex() if pg else None


@ray.remote
class Probe:
    """Stands in for the generator: what vLLM's Ray executor reads at start-up."""

    def look(self):
        import os

        pg = ray.util.get_current_placement_group()
        child = ray.get(where.remote(), timeout=60)
        return {"node": ray.get_runtime_context().get_node_id(),
                "pg": pg.id.hex() if pg else None,
                "bundles": pg.bundle_specs if pg else None,
                "child": child,
                "indices": os.environ.get("VLLM_RAY_BUNDLE_INDICES")}


def test_tp_groups_fill_nodes_one_each_and_vllm_finds_its_bundles(tmp_path, gpu_cluster,
                                                                   monkeypatch):
    """start_group as the driver calls it, with a probe in the generator's place (vLLM
    cannot start on faked GPUs): two groups of 3 GPUs and 2 x 0.25 go one per node, the
    generator sits on bundle 0 of its group, its child tasks land in the group, and vLLM is
    told bundles 0-2."""
    _, nodes = gpu_cluster
    spec = spec_of(tmp_path, 3, generators=2)  # 2 x (3 + 2 x 0.25) GPUs: 7 of 8
    check_resources(spec, echo=lambda *a: None)
    monkeypatch.setattr(placement, "start_generator", lambda spec, path, pools, strategy:
                        Probe.options(**generator_options(spec, strategy)).remote())
    monkeypatch.setattr(placement, "start_reward_actors", lambda r, path, strategies:
                        [Probe.options(num_cpus=0, scheduling_strategy=s).remote()
                         for s in strategies])
    groups = [placement.start_group(spec, "m", [None], [[]], f"g{i}") for i in range(2)]
    try:
        seen = ray.get([g.actor.look.remote() for g in groups], timeout=120)
        assert {s["node"] for s in seen} == {n.node_id for n in nodes}  # one per node
        for s, g in zip(seen, groups, strict=True):
            assert s["pg"] == g.pg.id.hex() and s["child"] == (s["node"], g.pg.id.hex())
            assert [b.get("GPU", 0) for b in s["bundles"]] == [1, 1, 1, 0.25, 0.25]
            assert s["indices"] == "0,1,2"
        third = placement_group(group_bundles(spec), strategy="STRICT_PACK")
        assert not third.wait(3)  # half a GPU left on each node: no room for a third
        remove_placement_group(third)
    finally:
        for g in groups:
            g.release()


@ray.remote(num_cpus=1, num_gpus=0)
class Sees:
    def gpus(self) -> str | None:
        import os

        return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_cpu_actor_on_a_gpu_node_of_a_joined_cluster_sees_no_gpu(gpu_cluster):
    """A reward or generator actor with no GPU of its own, on a node with GPUs, of a cluster
    this process joined: Ray would leave the node's GPUs visible to it (`device: auto` would
    take one), so its runtime env hides them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    _, nodes = gpu_cluster
    env = actor_runtime_env(0)
    assert env == {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    assert actor_runtime_env(1) == {}  # Ray sets a GPU actor's own
    on_gpu_node = NodeAffinitySchedulingStrategy(nodes[0].node_id, soft=False)
    actor = Sees.options(runtime_env=env, scheduling_strategy=on_gpu_node).remote()
    try:
        assert ray.get(actor.gpus.remote(), timeout=120) == ""
    finally:
        ray.kill(actor)


def test_a_tp_group_larger_than_any_node_is_refused_before_start(tmp_path, gpu_cluster):
    with pytest.raises(JobError, match="tensor_parallel_size is 8, but no node has 8 GPUs "
                                       r"\(the largest has 4\)"):
        check_resources(spec_of(tmp_path, 8), echo=lambda *a: None)
