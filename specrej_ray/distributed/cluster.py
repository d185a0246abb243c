"""The Ray side of a job's start: which cluster, and whether it can hold the actors."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import ray

from specrej_ray.distributed.local_ray import start_local_ray
from specrej_ray.distributed.placement import group_shape
from specrej_ray.distributed.ray_internals import sigterm_handlers_off
from specrej_ray.errors import JobError
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.spec import JobSpec

log = logging.getLogger(__name__)


def connect_ray(spec: JobSpec, stop: Interrupt) -> None:
    """Ray started or joined, with `stop`'s handlers in place all through: a signal while
    Ray starts is a clean stop (Interrupted, raised at once), not Ray's exit. A start that
    times out is tried again (start_with_retries)."""
    if ray.is_initialized():
        return
    # Cut short, a start leaves nothing behind: the process is ending, and the local Ray's
    # processes are started to die with it (Ray's fate sharing). Waiting for it to finish
    # made a stop take as long as Ray's start (docs/reliability.md); the start runs on a
    # thread of its own so that nothing in it holds the signal handlers off.
    with _ray_keeps_our_handlers(), stop.at_once():
        on_the_start_thread(lambda: _connect(spec))
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


def on_the_start_thread(start: Callable[[], None]) -> None:
    """start() run on this process's Ray-start thread, waited for here, where a signal's
    handler runs at once. On the main thread, Ray's start held the handlers off for seconds:
    its waits for the GCS it just started are C calls that a signal does not cut short (a
    stop took 5.7 s under load). Ray's local processes die with the thread that started
    them (PR_SET_PDEATHSIG, its fate sharing), so that thread lives as long as the process
    and runs every start of it. Raises what start() raised."""
    started: Future[None] = Future()
    _start_thread().put((start, started))
    while True:
        try:
            return started.result(timeout=0.1)  # 0.1 s: a signal the kernel gave that thread
        except TimeoutError:
            pass


_starts: queue.SimpleQueue | None = None


def _start_thread() -> queue.SimpleQueue:
    global _starts
    if _starts is None:
        _starts = queue.SimpleQueue()
        threading.Thread(target=_run_starts, args=(_starts,), name="specrej-ray-start",
                         daemon=True).start()
    return _starts


def _run_starts(starts: queue.SimpleQueue) -> None:
    while True:
        start, started = starts.get()
        try:
            started.set_result(start())
        except BaseException as e:  # noqa: BLE001 - the caller raises it
            started.set_exception(e)


def _connect(spec: JobSpec) -> None:
    address = spec.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        start_with_retries(lambda: ray.init(address=address, log_to_driver=True),
                           f"could not connect to the Ray cluster at {address}",
                           "check that it is up (`ray status` there) and reachable, then "
                           "run the same command again")
        return
    need_cpus, need_gpus = needed_resources(spec)
    # Logical CPUs only schedule actors; torch threads are set per actor. Never deadlock locally.
    # A new cluster listening on loopback only, even where a `ray start` one runs.
    start_with_retries(lambda: start_local_ray(
        num_cpus=max(os.cpu_count() or 1, int(need_cpus + 0.999)),
        num_gpus=int(need_gpus + 0.999) if need_gpus else None,
    ), "the local Ray did not start", "this machine is too busy for Ray's processes to start "
       "in time: run the same command again when it is less loaded, or start Ray once with "
       "`ray start --head` and set cluster.address (or RAY_ADDRESS) to it")


# A start that times out (an overloaded machine: Ray's GCS or raylet too slow to answer) is
# tried again after a pause, doubling; no new try begins once START_LIMIT_S have passed.
START_TRIES = 3
START_BACKOFF_S = 5.0
START_LIMIT_S = 180.0


def start_with_retries(start: Callable[[], None], failed: str, remedy: str,
                       sleep: Callable[[float], None] = time.sleep,
                       clock: Callable[[], float] = time.monotonic) -> None:
    """start(), tried again while it times out, at most START_TRIES times; then a JobError
    (exit 1: infrastructure) in one line: `failed`, the cause, and `remedy`. Any other
    error of start() is raised as it is."""
    t0, tries = clock(), 0
    while True:
        tries += 1
        try:
            start()
            return
        except Exception as e:  # Ray raises a bare Exception for its start-up timeout
            if not is_start_timeout(e):
                raise
            cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        ray.shutdown()  # what the failed start left: its processes, half a connection
        pause = START_BACKOFF_S * 2 ** (tries - 1)
        if tries >= START_TRIES or clock() - t0 + pause > START_LIMIT_S:
            raise JobError(f"{failed} in {tries} tries over {clock() - t0:.0f} s (the last "
                           f"said: {cause}); {remedy}")
        log.warning("Ray did not start (%s); trying again in %.0f s (try %d of %d)",
                    cause, pause, tries + 1, START_TRIES)
        sleep(pause)


def is_start_timeout(e: Exception) -> bool:
    """Whether a failed start timed out (worth another try), by what Ray raises: a
    TimeoutError, or a bare Exception saying so ("The current node timed out during
    startup ... the GCS has become overloaded")."""
    return isinstance(e, TimeoutError) or "timed out" in str(e).lower()


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
