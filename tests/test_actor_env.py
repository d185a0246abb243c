"""The runtime env of an actor with no GPU of its own (reward_pool.actor_runtime_env): it hides
the GPUs wherever a node may have one, and is empty on a Ray this process started with none,
which spares each actor Ray's runtime-env set-up. A CPU actor on a GPU node of a joined
cluster: tests/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import ray

from specrej_ray.distributed import reward_pool
from specrej_ray.distributed.ray_internals import started_here
from specrej_ray.distributed.reward_pool import actor_runtime_env

HIDDEN = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}


@pytest.mark.parametrize(("here", "gpus", "hidden"), [
    (True, 0, False),  # a local Ray with no GPU: nothing to hide, none to come
    (True, 2, True),  # a local Ray with GPUs
    (False, 0, True),  # a joined cluster: an autoscaler may add GPU nodes
    (False, 2, True),
])
def test_cpu_actors_hide_gpus_wherever_a_node_may_have_one(monkeypatch, here, gpus, hidden):
    monkeypatch.setattr(reward_pool, "started_here", lambda: here)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "GPU": float(gpus)}
                        if gpus else {"CPU": 4.0})
    assert actor_runtime_env(0) == (HIDDEN if hidden else {})
    assert actor_runtime_env(1) == {}  # Ray sets a GPU actor's own devices


@pytest.mark.ray
def test_on_the_ray_this_process_started_without_gpus_a_cpu_actor_needs_no_env(ray_cluster):
    assert started_here()
    assert "GPU" not in ray.cluster_resources()
    assert actor_runtime_env(0) == {}
