"""The Ray side of a job's start: which cluster, and whether it can hold the actors."""

from __future__ import annotations

import os

import ray

from specrej_ray.distributed.local_ray import start_local_ray
from specrej_ray.distributed.placement import group_shape
from specrej_ray.errors import JobError
from specrej_ray.spec import JobSpec


def connect_ray(spec: JobSpec) -> None:
    address = spec.cluster.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    need_cpus, need_gpus = needed_resources(spec)
    # Logical CPUs only schedule actors; torch threads are set per actor. Never deadlock locally.
    # A new cluster listening on loopback only, even where a `ray start` one runs.
    start_local_ray(
        num_cpus=max(os.cpu_count() or 1, int(need_cpus + 0.999)),
        num_gpus=int(need_gpus + 0.999) if need_gpus else None,
    )


def needed_resources(spec: JobSpec) -> tuple[float, float]:
    """Ray CPUs and GPUs that the generator groups (with their own reward actors) and the
    shared reward actors ask for together; with `generators: auto`, for the first group."""
    n = 1 if spec.cluster.generators == "auto" else spec.cluster.generators
    group = group_shape(spec)
    shared = [r for r in spec.reward if r.placement == "own"]
    cpus = n * group.get("CPU", 0.0) + sum(r.pool_size * r.num_cpus for r in shared)
    gpus = n * group.get("GPU", 0.0) + sum(r.pool_size * r.num_gpus for r in shared)
    return cpus, gpus


def check_resources(spec: JobSpec, echo=print) -> None:
    """Actors that can never be placed would wait forever: say so before starting them."""
    have = ray.cluster_resources()
    need_cpus, need_gpus = needed_resources(spec)
    short = [f"{need:g} {name} (the cluster has {have.get(key, 0):g})"
             for need, name, key in ((need_cpus, "CPUs", "CPU"), (need_gpus, "GPUs", "GPU"))
             if need > have.get(key, 0)]
    message = ("the generator and reward actors need " + " and ".join(short) +
               "; lower cluster.generators, reward pool_size or their cpus/gpus")
    k = spec.generator.tensor_parallel_size
    largest = max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")),
                  default=0)
    if k > 1 and largest < k:  # a tensor-parallel group never spans nodes
        short.append("tp")
        message = (f"generator.tensor_parallel_size is {k}, but no node has {k} GPUs (the "
                   f"largest has {largest:g}); a tensor-parallel generator stays on one node: "
                   "lower it or add a node with more GPUs")
    if not short:
        return
    if spec.cluster.address or os.environ.get("RAY_ADDRESS"):
        echo(f"[specrej] waiting for an autoscaler: {message}")  # a remote cluster may grow
    else:
        raise JobError(message)
