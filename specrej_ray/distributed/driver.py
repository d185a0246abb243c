"""The driver: plan shards, start actors, feed shards to generators, write the dataset."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from specrej_ray import dataset, formats
from specrej_ray.distributed.generator import PromptTask
from specrej_ray.distributed.placement import group_shape, start_group
from specrej_ray.distributed.progress import Progress
from specrej_ray.distributed.reward_pool import start_reward_actors
from specrej_ray.distributed.run_record import RunState, run_info
from specrej_ray.distributed.scaling import Fleet
from specrej_ray.engine.scoring import ScoreError
from specrej_ray.interrupt import Interrupt, Interrupted
from specrej_ray.models import load_tokenizer, resolve_model
from specrej_ray.prompts import Prompt, check_lengths, load_prompts, render_prompt
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
    attempts: int = 0


def plan_shards(prompts: list[Prompt], tasks: list[PromptTask], size: int) -> list[Shard]:
    """Shards are consecutive prompts; the id hashes their prompt ids, so it is stable."""
    shards = []
    for i in range(0, len(prompts), size):
        ids = "\x00".join(p.id for p in prompts[i : i + size])
        digest = hashlib.sha256(ids.encode()).hexdigest()[:8]
        shards.append(
            Shard(f"shard-{i // size:05d}-{digest}", prompts[i : i + size], tasks[i : i + size])
        )
    return shards


def prepare_prompts(spec: JobSpec, gen_path: str):
    """Load, render and tokenize prompts; problems are returned, never dropped silently."""
    prompt_set = load_prompts(spec.prompts)
    tokenizer = load_tokenizer(
        gen_path,
        trust_remote_code=spec.generator.trust_remote_code,
        revision=spec.generator.revision,
    )
    rendered = [
        render_prompt(tokenizer, p, spec.generator.chat_template) for p in prompt_set.prompts
    ]
    # Chat templates write their own special tokens; plain text gets the tokenizer's (BOS).
    specials = not spec.generator.chat_template
    ids = [tokenizer(r, add_special_tokens=specials).input_ids for r in rendered]
    context = _context_length(gen_path, spec)
    kept, too_long = check_lengths(
        prompt_set.prompts, [len(x) for x in ids], spec.generator.sampling.max_new_tokens, context
    )
    prompts = [prompt_set.prompts[i] for i in kept]
    tasks = [PromptTask(prompt_set.prompts[i].id, prompt_set.prompts[i].text, ids[i]) for i in kept]
    return prompts, tasks, prompt_set.problems + too_long, prompt_set.source


def _context_length(path: str, spec: JobSpec) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(
        path, trust_remote_code=spec.generator.trust_remote_code, revision=spec.generator.revision
    )
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(cfg, "max_position_embeddings", 1 << 30))


def connect_ray(spec: JobSpec) -> None:
    address = spec.cluster.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    need_cpus, need_gpus = needed_resources(spec)
    # Logical CPUs only schedule actors; torch threads are set per actor. Never deadlock locally.
    # address="local": a new cluster, even where a `ray start` one runs (ray.init would join
    # it). No dashboard or job server; see docs/security.md for what Ray itself binds.
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(need_cpus + 0.999)),
        num_gpus=int(need_gpus + 0.999) if need_gpus else None,
        include_dashboard=False,
        dashboard_host="127.0.0.1",
        log_to_driver=True,
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


def reward_keys(spec: JobSpec) -> list[str]:
    """How errors name each reward's model field: reward.model, or reward.1.model."""
    if len(spec.reward) == 1:
        return ["reward.model"]
    return [f"reward.{i}.model" for i in range(len(spec.reward))]


def run_job(spec: JobSpec, echo=print, stop: Interrupt | None = None) -> dict:
    """With `stop`'s handlers installed, a signal ends it with Interrupted, raised after what
    is finished is written out."""
    stop = stop or Interrupt()  # no handlers: nothing but KeyboardInterrupt stops it
    t_start = time.time()
    gen_path = resolve_model(spec.generator.model, "generator.model")
    rm_paths = [
        resolve_model(r.model, key) if r.model else None
        for r, key in zip(spec.reward, reward_keys(spec), strict=True)
    ]
    prompts, tasks, problems, source = prepare_prompts(spec, gen_path)
    for p in problems:
        echo(f"[specrej] skipped: {p.line(source)}")
    out = dataset.locate(spec.output.path)
    manifest = dataset.prepare_output(
        out, spec.output.if_exists, spec.fingerprint(), spec.model_dump(mode="json")
    )
    shards = plan_shards(prompts, tasks, spec.cluster.shard_size)
    todo = [s for s in shards if s.id not in manifest.shards]
    echo(
        f"[specrej] {len(prompts)} prompts in {len(shards)} shards; "
        f"{len(shards) - len(todo)} already done in {out}"
    )
    state = RunState.resume(out, spec)
    t_gen = time.time()
    fatal: JobError | None = None
    if todo:
        connect_ray(spec)
        stop.reinstall()  # ray.init put its own handlers in place of ours
        check_resources(spec, echo)
        done_before = sum(len(s.prompts) for s in shards) - sum(len(s.prompts) for s in todo)
        progress = Progress(len(prompts), done_before)
        try:
            _run_shards(spec, gen_path, rm_paths, todo, out, manifest, state, progress, stop)
        except JobError as e:  # still write out every shard that finished
            fatal = e
            state.failures.append(failure_record(e.shard, str(e)))
        except Interrupted:  # while the actors started: nothing is finished or abandoned
            pass
        finally:
            progress.close()
    stop.defer()  # a signal from now on must not cut the writing short
    state.interrupted = stop.requested
    order = [s.id for s in shards]
    made = dataset.assemble(out, manifest, order, spec.output, formats.provenance(spec))
    dataset.write_errors(out, source, problems, state.failures)
    info = run_info(spec, made.counts, problems, state, t_start, t_gen)
    info.update(files=made.files, filters=made.filters)
    dataset.write_run_info(out, info)
    stop.check()
    if fatal is not None:
        raise fatal
    if state.failures:
        raise JobError(
            f"{len(state.failures)} shard(s) failed (see {out.url_of('errors.jsonl')}); "
            "run again to retry them"
        )
    return info


def _run_shards(spec, gen_path, rm_paths, todo, out, manifest, state, progress,
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
        idle = list(gens)
        # Pings alone do not keep the job open: with no shard left, nothing waits for them.
        # A stop signal only sets stop.requested here: shards in flight are abandoned (they
        # are not in the manifest, so a resume redoes them).
        stop.defer()
        while not stop.requested and (
                queue or any(shard is not None for _, shard, _ in running.values())):
            idle += fleet.grow(len(queue), idle + [a for a, _, _ in running.values()])
            while queue and idle:
                actor, shard = idle.pop(), queue.pop(0)
                running[actor.run_shard.remote(shard.tasks)] = (actor, shard, time.monotonic())
            idle = fleet.release(len(queue), idle)
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
                elif _collect(ref, shard, started, spec, out, manifest, state, progress, queue):
                    state.shard_actors[shard.id] = fleet.label(actor)
                    idle.append(actor)
                else:
                    running[actor.info.remote()] = (actor, None, time.monotonic())
            _requeue_stuck(running, queue, idle, timeout, state, spec)
    finally:
        state.generators.update(fleet.infos)
        fleet.shutdown()
        for a in (a for pool in shared for a in pool):
            ray.kill(a, no_restart=True)


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


def _collect(ref, shard, started, spec, out, manifest, state, progress, queue) -> bool:
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
    dataset.write_shard(out, shard.id, best, cands)
    manifest.shards[shard.id] = [p.id for p in shard.prompts]
    manifest.save(out)
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
            running[actor.info.remote()] = (actor, None, now)
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
