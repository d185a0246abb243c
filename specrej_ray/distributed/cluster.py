"""The Ray side of a job's start: which cluster, and whether it can hold the actors."""

from __future__ import annotations

import contextlib
import faulthandler
import os
from collections.abc import Iterator

import ray

from specrej_ray.distributed.local_ray import start_local_ray
from specrej_ray.distributed.placement import group_shape
from specrej_ray.distributed.ray_internals import sigterm_handlers_off
from specrej_ray.errors import JobError
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.spec import JobSpec


def connect_ray(spec: JobSpec, stop: Interrupt) -> None:
    """Ray started or joined, with `stop`'s handlers in place all through: a signal while
    Ray starts is a clean stop (Interrupted, raised here once Ray is up), not Ray's exit."""
    if ray.is_initialized():
        return
    with _ray_keeps_our_handlers():
        _connect(spec)
    stop.reinstall()  # in case a Ray release sets its handlers some other way
    stop.check()


@contextlib.contextmanager
def _ray_keeps_our_handlers() -> Iterator[None]:
    # ray.init sets SIGTERM handlers of its own, through one function, twice (init's, which
    # calls sys.exit(15), and the local node's, which exits 1): a scheduler's SIGTERM in those
    # seconds ended the driver with exit 15 and no record. Ours only set a flag while Ray
    # starts, so Ray's start is never cut in half. The driver's core worker would also put
    # absl's failure handler in front of ours at the C level (a stack dump on SIGTERM until
    # our reinstall): it is not installed in the driver; Python's faulthandler prints a
    # crash's stack instead. Both are Ray's private parts (ray_internals).
    if not faulthandler.is_enabled():
        faulthandler.enable()
    with sigterm_handlers_off():
        yield


def _connect(spec: JobSpec) -> None:
    address = spec.cluster.address or os.environ.get("RAY_ADDRESS")
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
