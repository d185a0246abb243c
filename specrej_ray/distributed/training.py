"""A round's training as a Ray task with the resources the spec asks for (a GPU node on a
cluster, a CPU here), watched without blocking: a stop signal cancels it (its checkpoints
stay), a dead worker or node starts it again from its last checkpoint."""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from specrej_ray.errors import JobError, TrainError
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.spec.iterate import TrainerSpec
from specrej_ray.train import TrainJob, train

POLL_S = 1.0  # how often the driver looks at the task (and at a stop signal)
RESULT_TIMEOUT_S = 120.0  # fetching a finished task's small result


def _train_task(job: TrainJob) -> dict:
    return train(job)


def train_on_ray(job: TrainJob, trainer: TrainerSpec, stop: Interrupt, echo=print) -> dict:
    """The published model's stamp. TrainError (the user's to fix) passes through; a task
    that keeps dying is a JobError; Interrupted on a stop signal. The caller has checked
    that the cluster can place it (check_fits)."""
    # A CPU-only task must not see the node's GPUs (Ray shows them all at num_gpus=0).
    env = {} if trainer.num_gpus else {"CUDA_VISIBLE_DEVICES": ""}
    task = ray.remote(_train_task).options(
        num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus, max_retries=0,
        runtime_env={"env_vars": env}, name=f"specrej-train-round-{job.round}")
    for attempt in range(trainer.max_restarts + 1):
        ref = task.remote(job)
        try:
            return _wait(ref, stop)
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, TrainError):
                raise cause from None
            if not _lost_worker(e):
                raise JobError(f"round {job.round}: training failed: {_line(cause or e)} "
                               "(the finished rounds are kept; run again to retry)") from None
            why = _line(e)
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as e:
            why = _line(e)
        if attempt < trainer.max_restarts:
            echo(f"[specrej] round {job.round}: the training task died ({why}); starting it "
                 "again from its last checkpoint")
    raise JobError(f"round {job.round}: the training task died {trainer.max_restarts + 1} "
                   f"time(s), last: {why}; run again to resume from its checkpoints")


def _wait(ref, stop: Interrupt) -> dict:
    while True:
        done, _ = ray.wait([ref], timeout=POLL_S)
        if done:
            try:
                return ray.get(ref, timeout=RESULT_TIMEOUT_S)
            except GetTimeoutError:
                raise JobError("the finished training task's result did not arrive within "
                               f"{RESULT_TIMEOUT_S:.0f} s; run again to resume") from None
        if stop.requested:
            ray.cancel(ref, force=True)  # kills the worker: its checkpoints are kept
            stop.check()


def check_fits(trainer: TrainerSpec, may_grow: bool, echo) -> None:
    """A task that can never be placed would wait forever: say so (or, on a cluster that may
    grow, that it waits for the autoscaler)."""
    have = ray.cluster_resources()
    for key, need in (("CPU", trainer.num_cpus), ("GPU", trainer.num_gpus)):
        if need and have.get(key, 0.0) < need:
            message = (f"iterate.trainer.num_{key.lower()}s: {need:g} asked, the cluster has "
                       f"{have.get(key, 0.0):g}")
            if not may_grow:
                raise TrainError(f"{message}; lower it or add nodes")
            echo(f"[specrej] waiting for an autoscaler: {message}")


def _lost_worker(e: RayTaskError) -> bool:
    cause = getattr(e, "cause", None)
    return isinstance(cause, ray.exceptions.WorkerCrashedError | ray.exceptions.NodeDiedError
                      | ray.exceptions.TaskCancelledError)


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
