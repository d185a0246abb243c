"""The test process's shared local Ray cluster (conftest's ray_cluster fixture): started once a
process, or an xdist worker, and again only after a test that owns its cluster shut it down."""

from __future__ import annotations

import time

SHARED_CPUS = 4  # a generator and its rewards, with room for a trainer task


def fork_cluster_workers() -> None:
    """Every Ray node this process starts from now on runs its workers as forks of the test
    zygote (tests/helpers/ray_worker.py): for a test that starts a cluster of its own
    (ray.cluster_utils.Cluster), whose workers were otherwise fresh interpreters wherever no
    earlier test in the process had started the shared one."""
    from tests.helpers import zygote
    from tests.helpers.ray_worker import use_forked_workers

    if use_forked_workers() is None:  # else Ray starts its workers itself, as warned
        zygote.start_workers()


def ensure_shared_ray() -> None:
    import ray

    from specrej_ray.distributed.local_ray import start_local_ray

    if not ray.is_initialized():
        fork_cluster_workers()
        start_local_ray(num_cpus=SHARED_CPUS, num_gpus=None)


def assert_idle(test: str, limit_s: float = 30.0) -> None:
    """Every CPU of the shared cluster is free again: the test's runs left no actor or task
    behind (a run kills its actors as it ends; Ray frees their CPUs a moment later)."""
    import ray

    if not ray.is_initialized():  # the test shut it down itself
        return
    deadline = time.monotonic() + limit_s
    total = ray.cluster_resources().get("CPU", 0)
    while (free := ray.available_resources().get("CPU", 0)) < total:
        if time.monotonic() > deadline:
            raise AssertionError(f"{test} left {total - free:g} CPU(s) of the shared Ray "
                                 "cluster held: an actor or task is still running")
        time.sleep(0.05)
