"""The driver: plan shards, start actors, feed shards to generators, write the dataset."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from specrej_ray import dataset, formats
from specrej_ray.distributed.local_ray import start_local_ray
from specrej_ray.distributed.placement import group_shape, start_group
from specrej_ray.distributed.progress import Progress
from specrej_ray.distributed.reward_pool import start_reward_actors
from specrej_ray.distributed.run_record import RunState, run_info
from specrej_ray.distributed.scaling import Fleet
from specrej_ray.engine.scoring import ScoreError
from specrej_ray.interrupt import Interrupt, Interrupted
from specrej_ray.job import PromptTask, prepare_prompts, resolve_generator, resolve_rewards
from specrej_ray.output import OutputDir, Resume, content_key
from specrej_ray.prompts import Prompt
from specrej_ray.reward.base import RewardError
from specrej_ray.spec import JobSpec
from specrej_ray.summary import estimate_bon_tokens

log = logging.getLogger(__name__)


STOP_POLL_S = 1.0  # how soon the shard loop notices a stop signal


class JobError(Exception):
    """The job could not finish; finished shards are kept for a resume. `shard`: the one
    whose failure stopped the job, if any (errors.jsonl names it and its prompts)."""

    def __init__(self, message: str, shard: Shard | None = None) -> None:
        super().__init__(message)
        self.shard = shard


class RewardFailed(JobError):
    """A reward raised, or returned scores that cannot be ranked: the user's to fix (exit 2),
    unlike a failure of the infrastructure."""


@dataclass
class Shard:
    id: str
    prompts: list[Prompt]
    tasks: list[PromptTask]
    keys: dict[str, dict[str, str]]  # prompt id -> content key (output.content_key)
    attempts: int = 0  # failed attempts charged to this shard (cluster.max_shard_retries)
    shared: bool = False  # its current attempt shares a generator with another shard
    alone: bool = False  # failed while sharing one: runs alone from then on


def plan_shards(prompts: list[Prompt], tasks: list[PromptTask],
                keys: dict[str, dict[str, str]], size: int,
                done: Collection[str] = ()) -> list[Shard]:
    """Shards of up to `size` consecutive prompts that are not done. A shard is named by the
    position of its first prompt and a hash of its prompts' ids and content: stable across
    resumes, and never the name of an edited prompt's old results."""
    todo = [i for i, p in enumerate(prompts) if p.id not in done]
    shards = []
    for start in range(0, len(todo), size):
        part = todo[start : start + size]
        ps = [prompts[i] for i in part]
        blob = json.dumps([[p.id, keys[p.id]] for p in ps], sort_keys=True)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:8]
        shards.append(Shard(f"shard-{part[0]:05d}-{digest}", ps, [tasks[i] for i in part],
                            {p.id: keys[p.id] for p in ps}))
    return shards


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
    if not short:
        return
    message = ("the generator and reward actors need " + " and ".join(short) +
               "; lower cluster.generators, reward pool_size or their cpus/gpus")
    if spec.cluster.address or os.environ.get("RAY_ADDRESS"):
        echo(f"[specrej] waiting for an autoscaler: {message}")  # a remote cluster may grow
    else:
        raise JobError(message)


def run_job(spec: JobSpec, echo=print, outdir: OutputDir | None = None,
            stop: Interrupt | None = None) -> dict:
    """Run the job on its output location, which this run holds alone until it returns (or
    on `outdir`, already taken by the caller, who releases it). With `stop`'s handlers
    installed, a signal ends it with Interrupted, raised after what is finished is written."""
    stop = stop or Interrupt()  # no handlers: nothing but KeyboardInterrupt stops it
    t_start = time.time()
    if outdir is not None:
        return _run_job(spec, outdir, t_start, echo, stop)
    # The output is taken first: a second run on it is refused before it loads anything.
    with OutputDir.for_spec(spec, echo) as taken:
        return _run_job(spec, taken, t_start, echo, stop)


def _run_job(spec: JobSpec, outdir: OutputDir, t_start: float, echo, stop: Interrupt) -> dict:
    gen_path = resolve_generator(spec)
    rm_paths = resolve_rewards(spec)
    prompts, tasks, problems, source = prepare_prompts(spec, gen_path)
    for p in problems:
        echo(f"[specrej] skipped: {p.line(source)}")
    out = outdir.out
    keys = {t.prompt_id: content_key(p.text, p.system, t.input_ids)
            for p, t in zip(prompts, tasks, strict=True)}
    found = outdir.resume(keys)
    _report_resume(found, out, echo)
    todo = plan_shards(prompts, tasks, keys, spec.cluster.shard_size, found.done)
    echo(f"[specrej] {len(prompts)} prompts, {len(found.done)} already done in {out}; "
         f"{len(prompts) - len(found.done)} to generate in {len(todo)} shards")
    state = RunState.resume(out, spec)
    t_gen = time.time()
    fatal: JobError | None = None
    if todo:
        # A signal whose Interrupted was swallowed on its way (raised inside a callback
        # that ignores exceptions, e.g. during an import) still stops the run before Ray.
        stop.check()
        connect_ray(spec)
        stop.reinstall()  # ray.init put its own handlers in place of ours
        check_resources(spec, echo)
        progress = Progress(len(prompts), len(found.done))
        try:
            _run_shards(spec, gen_path, rm_paths, todo, outdir, state, progress, stop)
        except JobError as e:  # still write out every shard that finished
            fatal = e
            state.failures.append(failure_record(e.shard, str(e)))
        except Interrupted:  # while the actors started: nothing is finished or abandoned
            pass
        finally:
            progress.close()
    stop.defer()  # a signal from now on must not cut the writing short
    state.interrupted = stop.requested
    made = outdir.assemble(keys, spec.output, formats.provenance(spec))
    outdir.write_errors(source, problems, state.failures)
    info = run_info(spec, made.counts, problems, state, t_start, t_gen)
    # The first ids only: a job whose every prompt was edited must not bloat run.json.
    info.update(files=made.files, filters=made.filters, shards_dropped=found.dropped,
                regenerated={"prompts": len(found.changed), "ids": found.changed[:100]})
    outdir.write_run_info(info)
    stop.check()
    if fatal is not None:
        raise fatal
    if state.failures:
        raise JobError(
            f"{len(state.failures)} shard(s) failed (see {out.url_of('errors.jsonl')}); "
            "run again to retry them"
        )
    return info


def _report_resume(found: Resume, out, echo) -> None:
    """Say what a resume will not reuse, and why: nothing is regenerated silently."""
    for why in found.dropped:
        echo(f"[specrej] regenerating shard {why}")
    if found.changed:
        shown = ", ".join(found.changed[:5]) + (" ..." if len(found.changed) > 5 else "")
        echo(f"[specrej] regenerating {len(found.changed)} prompt(s) whose text or chat input "
             f"changed since their results in {out} were made: {shown}")


def _run_shards(spec, gen_path, rm_paths, todo, outdir, state, progress,
                stop: Interrupt) -> None:
    # Rewards placed `own` are shared by every generator; the others start with each one.
    shared = [start_reward_actors(r, path) if r.placement == "own" else []
              for r, path in zip(spec.reward, rm_paths, strict=True)]
    fleet = Fleet(spec, lambda label: start_group(spec, gen_path, rm_paths, shared, label))
    timeout = spec.cluster.call_timeout_s
    try:
        gens = fleet.start()
        infos = _wait_ready(gens, [a for pool in shared for a in pool] + fleet.reward_actors(),
                            spec.cluster.startup_timeout_s)
        for actor, info in zip(gens, infos, strict=True):
            fleet.record(actor, info)
        queue = list(todo)
        # ref -> (actor, shard, started); shard None: a ping of an actor that failed, which
        # gets work again only once it answers (a restarting actor would fail the next shard).
        running: dict = {}
        # A slot per shard a generator may hold (cluster.shards_in_flight): with two, its
        # next shard joins the running batch before the current one drains.
        slots = spec.cluster.shards_in_flight
        idle = [a for _ in range(slots) for a in gens]
        fatal: JobError | None = None  # a shard failed for good: the others in flight finish
        # Pings alone do not keep the job open: with no shard left, nothing waits for them.
        # A stop signal only sets stop.requested here: shards in flight are abandoned (they
        # have no shard record, so a resume redoes them).
        stop.defer()
        while not stop.requested and (
                (queue and fatal is None)
                or any(s is not None for _, s, _ in running.values())):
            new = fleet.grow(len(queue), idle + [a for a, _, _ in running.values()])
            idle += [a for _ in range(slots) for a in new]
            if fatal is None:
                _dispatch(queue, idle, running)
            idle = fleet.release(len(queue), idle, busy={a for a, _, _ in running.values()})
            if not running and not fleet.starting:  # every generator is gone for good
                state.failures += [failure_record(s, "no generator actor left") for s in queue]
                break
            ready, _ = ray.wait(list(running) + fleet.pending(), num_returns=1,
                                timeout=min(fleet.wait_s, STOP_POLL_S))
            for ref in ready:
                if ref not in running:  # a new generator answered: fleet.grow hands it over
                    continue
                actor, shard, started = running.pop(ref)
                if shard is None:
                    _pinged(ref, actor, started, running, idle)
                    continue
                try:
                    collected = _collect(ref, shard, started, spec, outdir, state, progress,
                                         queue)
                except JobError as e:  # no new shard starts; those in flight are kept
                    fatal = fatal or e
                    idle.append(actor)
                    continue
                if collected:
                    state.shard_actors[shard.id] = fleet.label(actor)
                    idle.append(actor)
                else:
                    _sideline(actor, running, idle)
            _requeue_stuck(running, queue, idle, timeout, state, spec)
        if fatal is not None:
            raise fatal
    finally:
        state.generators.update(fleet.infos)
        _add_engine_counters(state.generators, fleet.final_infos())
        fleet.shutdown()
        for a in (a for pool in shared for a in pool):
            ray.kill(a, no_restart=True)


def _add_engine_counters(infos: dict[str, dict], final: dict[str, dict]) -> None:
    """Each generator's engine counters at the end, beside what it said when it started; a
    generator restarted meanwhile (a lost node) says where it runs now, and its counters
    are its new incarnation's."""
    for label, now in final.items():
        info = infos.setdefault(label, now)
        info["engine"] = now.get("engine")
        if now.get("node_id") != info.get("node_id"):
            info["restarted_on"] = now.get("node_id")


def _dispatch(queue: list[Shard], idle: list, running: dict) -> None:
    """Send queued shards to idle slots, generators in turn. A shard that failed while it
    shared its generator runs alone, so the next failure is surely its own: it waits for a
    generator with nothing in flight, and that generator takes nothing else meanwhile."""
    held: dict = {}  # actor -> its shards in flight
    for actor, shard, _ in running.values():
        if shard is not None:
            held.setdefault(actor, []).append(shard)
    for shard in list(queue):
        free = [a for a in idle if not any(s.alone for s in held.get(a, []))
                and not (shard.alone and held.get(a))]
        if not free:
            break  # first come, first served: a shard waiting to run alone is not overtaken
        actor = free[0]
        idle.remove(actor)
        queue.remove(shard)
        others = held.setdefault(actor, [])
        shard.shared = bool(others)
        for other in others:
            other.shared = True
        others.append(shard)
        running[actor.run_shard.remote(shard.tasks)] = (actor, shard, time.monotonic())


def _sideline(actor, running: dict, idle: list) -> None:
    """A failed generator gets work again only once it answers a ping (a restarting actor
    would fail its next shard): a ping per slot it held, the failed shard's and any idle
    one; each answer gives one slot back."""
    held = idle.count(actor) + 1
    idle[:] = [a for a in idle if a != actor]
    for _ in range(held):
        running[actor.info.remote()] = (actor, None, time.monotonic())


def _pinged(ref, actor, started, running, idle) -> None:
    """A failed generator answered (back to work), is still restarting (ping again), or is
    dead for good (dropped; the loop ends the job if none is left)."""
    try:
        ray.get(ref, timeout=60)
        idle.append(actor)
    except (ActorUnavailableError, GetTimeoutError):  # _requeue_stuck bounds the wait
        running[actor.info.remote()] = (actor, None, started)
    except RayActorError as e:
        log.warning("a generator actor died for good (%s); dropping it", type(e).__name__)


def _collect(ref, shard, started, spec, outdir, state, progress, queue) -> bool:
    """Record a finished shard; False if its actor failed (the shard is retried or failed)."""
    actor = _actor_hex(ref)
    state.attempt_seen(started)
    try:
        results = ray.get(ref, timeout=60)
    except RayTaskError as e:
        # An error raised by our own code (bad reward output, bad model) would fail every retry.
        why = _cause_line(e)
        state.shard_failed(shard, why, actor, final=True)
        if isinstance(e.cause, RewardError | ScoreError):
            raise RewardFailed(str(e.cause).strip().splitlines()[0], shard) from None
        raise JobError(why, shard) from None
    except (RayActorError, GetTimeoutError) as e:
        _retry_or_fail(shard, queue, state, spec, f"generator actor failed: {type(e).__name__}",
                       actor)
        return False
    best, cands = [], []
    for prompt, result in zip(shard.prompts, results, strict=True):
        b, c = dataset.result_rows(prompt, result)
        best.append(b)
        cands += c
    outdir.write_shard(shard.id, shard.keys, best, cands)
    state.shard_done(shard, results, started, actor)
    progress.count_from(state.first_sent)
    progress.update(len(shard.prompts), sum(r.tokens_generated for r in results), len(cands),
                    estimate_bon_tokens(cands))
    return True


def _actor_hex(ref) -> str | None:
    """The id of the actor whose task made `ref` (run.json names it; None if unknown)."""
    try:
        return ref.task_id().actor_id().hex()
    except Exception:  # not an actor task's ref (tests pass stand-ins)
        return None


def _cause_line(e: RayTaskError) -> str:
    cause = e.cause if getattr(e, "cause", None) is not None else e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}"


def _retry_or_fail(shard: Shard, queue: list, state: RunState, spec: JobSpec, why: str,
                   actor: str | None = None) -> None:
    if shard.shared and not shard.alone:
        # Its generator ran other shards too: any of them may have brought it down. Retried
        # alone, uncharged; from then on every failure is its own and counts.
        shard.alone = True
        state.shard_failed(shard, f"{why} (while sharing its generator)", actor, final=False)
        log.warning("%s on %s, which shared its generator; retrying it alone", why, shard.id)
        queue.append(shard)
        return
    shard.attempts += 1
    retry = shard.attempts <= spec.cluster.max_shard_retries
    state.shard_failed(shard, why, actor, final=not retry)
    if retry:
        log.warning("%s on %s; retrying (%d)", why, shard.id, shard.attempts)
        queue.append(shard)
    else:
        state.failures.append(failure_record(shard, why))


def failure_record(shard: Shard | None, why: str) -> dict:
    """A failure as errors.jsonl and run.json record it: the shard and its prompt ids."""
    return {"shard": shard.id if shard else None,
            "prompt_ids": [p.id for p in shard.prompts] if shard else [], "reason": why}


def _requeue_stuck(running: dict, queue, idle, timeout, state, spec) -> None:
    now = time.monotonic()
    for ref, (actor, shard, started) in list(running.items()):
        if shard is None and now - started > spec.cluster.startup_timeout_s:
            running.pop(ref)  # a failed generator that never came back: stop waiting for it
            log.warning("a generator actor did not come back; dropping it")
            ray.kill(actor, no_restart=True)
        elif shard is not None and now - started > timeout:
            running.pop(ref)
            ray.kill(actor, no_restart=False)  # restarts (max_restarts) with a fresh engine
            _sideline(actor, running, idle)
            _retry_or_fail(shard, queue, state, spec, f"shard exceeded {timeout:.0f}s")


def _wait_ready(gens: list, rewards: list, timeout: float) -> list[dict]:
    """Every actor has loaded its model, or the job stops with a reason (never a hang);
    returns the generators' info()."""
    refs = [g.info.remote() for g in gens] + [r.ready.remote() for r in rewards]
    ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if not_ready:
        raise JobError(
            f"{len(not_ready)} actor(s) did not start within {timeout:.0f}s "
            "(cluster.startup_timeout_s); check that the cluster has the CPUs/GPUs they ask for"
        )
    try:
        infos = ray.get(refs[: len(gens)], timeout=60)
        for info in infos:
            log.info("generator ready: %s", info)
        ray.get(ready, timeout=60)
    except RayTaskError as e:  # a model that fails to load: report the cause, one line
        raise JobError(_cause_line(e)) from None
    return infos
