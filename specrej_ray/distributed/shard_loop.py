"""The shard loop: feeds shards to generator actors until each is written or failed for good.

One object holds what the loop works on: the queue of shards to run, the calls in flight (a
shard on a generator, or a ping of a generator that failed), the idle generator slots, the
output (each finished shard is written at once, with its run record), the run state and the
progress line. Each turn: grow or shrink the fleet, send queued shards to idle slots, wait
for one answer, write or retry what it says, and requeue what ran too long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from specrej_ray.data import dataset
from specrej_ray.data.output import OutputDir
from specrej_ray.distributed.scaling import Fleet
from specrej_ray.engine.scoring import ScoreError
from specrej_ray.engine.task import Choice
from specrej_ray.errors import JobError, ModelError, ModelFailed, RewardFailed
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.job.progress import Progress
from specrej_ray.job.run_record import RunState
from specrej_ray.job.shards import Shard, ShardOutput, failure_record
from specrej_ray.quality.summary import estimate_bon_tokens
from specrej_ray.reward.base import RewardError
from specrej_ray.spec import JobSpec

log = logging.getLogger(__name__)

STOP_POLL_S = 1.0  # how soon the loop notices a stop signal
STARTUP_POLL_S = 0.25  # how soon the wait for the actors to load notices one


@dataclass
class Call:
    """A call in flight: a shard's run, or (shard None) a ping of a generator that failed,
    which gets work again only once it answers (a restarting actor would fail the next)."""

    actor: object
    shard: Shard | None
    started: float


class ShardLoop:
    """`grid`: the shards are schedule: auto's calibration prompts (Best-of-N, their rewards
    scored at these lengths; the data lands in `tables` and in each shard's record);
    `choice`: the alpha and schedule the other shards run with. `audit`: which of a shard's
    prompts also run a shadow Best-of-N (audit.py); their records land in each shard's
    record and go to `audited`, which may answer with a new choice for the shards not yet
    sent (schedule: auto recalibrating; with `audit_grid` the shadows bring calibration
    data too)."""

    def __init__(self, spec: JobSpec, fleet: Fleet, outdir: OutputDir, state: RunState,
                 progress: Progress, stop: Interrupt, grid: tuple[int, ...] | None = None,
                 choice: Choice | None = None,
                 audit: Callable[[Shard], list[str]] | None = None,
                 audited: Callable[[list[dict], dict[str, dict]], Choice | None] | None = None,
                 audit_grid: tuple[int, ...] = ()) -> None:
        self.spec, self.fleet, self.outdir = spec, fleet, outdir
        self.state, self.progress, self.stop = state, progress, stop
        self.grid, self.choice = grid, choice
        self.audit, self.audited, self.audit_grid = audit, audited, audit_grid
        self.tables: dict[str, dict] = {}  # prompt id -> calibration data (with `grid`)
        self.queue: list[Shard] = []
        self.running: dict[object, Call] = {}  # ref -> call
        # A slot per shard a generator may hold (cluster.shards_in_flight): with two, its
        # next shard joins the running batch before the current one drains.
        self.slots = spec.cluster.shards_in_flight
        self.idle: list = []
        self.fatal: JobError | None = None  # a shard failed for good: those in flight finish

    def run(self, shards: list[Shard], generators: list) -> list:
        """Until every shard is written or failed (JobError for the first fatal one); returns
        the generators still at work for a next loop. A stop signal only sets
        stop.requested here: shards in flight are abandoned (they have no shard record, so a
        resume redoes them)."""
        self.queue = list(shards)
        self.idle = self._slots(generators)
        self.stop.defer()
        while not self.stop.requested and (
                (self.queue and self.fatal is None) or self._shards_in_flight()):
            self.idle += self._slots(self.fleet.grow(len(self.queue), self._actors()))
            if self.fatal is None:
                self._dispatch()
            self.idle = self.fleet.release(len(self.queue), self.idle,
                                           busy={c.actor for c in self.running.values()})
            if not self.running and not self.fleet.starting:  # every generator is gone
                self.state.failures += [failure_record(s, "no generator actor left")
                                        for s in self.queue]
                break
            ready, _ = ray.wait(list(self.running) + self.fleet.pending(), num_returns=1,
                                timeout=min(self.fleet.wait_s, STOP_POLL_S))
            for ref in ready:
                if ref in self.running:  # else a new generator answered: fleet.grow has it
                    self._answered(ref, self.running.pop(ref))
            self._requeue_stuck()
        if self.fatal is not None:
            raise self.fatal
        return list(dict.fromkeys(self.idle))

    def _slots(self, generators: list) -> list:
        return [a for _ in range(self.slots) for a in generators]

    def _actors(self) -> list:
        return self.idle + [c.actor for c in self.running.values()]

    def _shards_in_flight(self) -> bool:
        # Pings alone do not keep the job open: with no shard left, nothing waits for them.
        return any(c.shard is not None for c in self.running.values())

    def _answered(self, ref, call: Call) -> None:
        if call.shard is None:
            self._pinged(ref, call)
            return
        try:
            written = self.collect(ref, call)
        except JobError as e:  # no new shard starts; those in flight are kept
            self.fatal = self.fatal or e
            self.idle.append(call.actor)
            return
        if written:
            self.state.shard_actors[call.shard.id] = self.fleet.label(call.actor)
            self.idle.append(call.actor)
        else:
            self._sideline(call.actor)

    # -- sending --------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Send queued shards to idle slots, generators in turn. A shard that failed while
        it shared its generator runs alone, so the next failure is surely its own: it waits
        for a generator with nothing in flight, which takes nothing else meanwhile."""
        held: dict = {}  # actor -> its shards in flight
        for c in self.running.values():
            if c.shard is not None:
                held.setdefault(c.actor, []).append(c.shard)
        for shard in list(self.queue):
            free = [a for a in self.idle if not any(s.alone for s in held.get(a, []))
                    and not (shard.alone and held.get(a))]
            if not free:
                break  # first come, first served: a shard waiting to run alone is not overtaken
            actor = free[0]
            self.idle.remove(actor)
            self.queue.remove(shard)
            others = held.setdefault(actor, [])
            shard.shared = bool(others)
            for other in others:
                other.shared = True
            others.append(shard)
            self.running[self._send(actor, shard)] = Call(actor, shard, time.monotonic())

    def _send(self, actor, shard: Shard):
        if self.grid:
            return actor.calibrate_shard.remote(shard.tasks, list(self.grid))
        best_of_n = self.choice is not None and self.choice.alpha == 0  # nothing to audit
        audit = self.audit(shard) if self.audit is not None and not best_of_n else []
        return actor.run_shard.remote(shard.tasks, self.choice, audit,
                                      list(self.audit_grid) if audit else [])

    # -- answers --------------------------------------------------------------------------

    def collect(self, ref, call: Call) -> bool:
        """Write a finished shard; False if its actor failed (the shard is retried or
        failed)."""
        shard, actor = call.shard, _actor_hex(ref)
        self.state.attempt_seen(call.started)
        try:
            out: ShardOutput = ray.get(ref, timeout=60)
        except RayTaskError as e:
            # An error raised by our own code (bad reward output, bad model) would fail every
            # retry.
            why = _cause_line(e)
            self.state.shard_failed(shard, why, actor, final=True)
            if isinstance(e.cause, RewardError | ScoreError):
                raise RewardFailed(str(e.cause).strip().splitlines()[0], shard) from None
            raise JobError(why, shard) from None
        except (RayActorError, GetTimeoutError) as e:
            self._retry_or_fail(shard, f"generator actor failed: {type(e).__name__}", actor)
            return False
        results = out.results
        best, cands = [], []
        for prompt, result in zip(shard.prompts, results, strict=True):
            b, c = dataset.result_rows(prompt, result)
            best.append(b)
            cands += c
        record = self.state.shard_done(shard, results, call.started, actor)
        self.outdir.write_shard(shard.id, shard.keys, best, cands, run=record,
                                calibration=out.tables or None, audit=out.audits or None)
        self.tables.update(out.tables)
        self.progress.count_from(self.state.first_sent)
        self.progress.update(len(shard), sum(r.tokens_generated for r in results),
                             len(cands), estimate_bon_tokens(cands))
        if out.audits and self.audited is not None:
            self.choice = self.audited(out.audits, out.tables) or self.choice
        return True

    def _retry_or_fail(self, shard: Shard, why: str, actor: str | None = None) -> None:
        state = self.state
        if shard.shared and not shard.alone:
            # Its generator ran other shards too: any of them may have brought it down.
            # Retried alone, uncharged; from then on every failure is its own and counts.
            shard.alone = True
            state.shard_failed(shard, f"{why} (while sharing its generator)", actor,
                               final=False)
            log.warning("%s on %s, which shared its generator; retrying it alone", why,
                        shard.id)
            self.queue.append(shard)
            return
        shard.attempts += 1
        retry = shard.attempts <= self.spec.cluster.max_shard_retries
        state.shard_failed(shard, why, actor, final=not retry)
        if retry:
            log.warning("%s on %s; retrying (%d)", why, shard.id, shard.attempts)
            self.queue.append(shard)
        else:
            state.failures.append(failure_record(shard, why))

    # -- generators that failed -----------------------------------------------------------

    def _sideline(self, actor) -> None:
        """A failed generator gets work again only once it answers a ping: a ping per slot it
        held, the failed shard's and any idle one; each answer gives one slot back."""
        held = self.idle.count(actor) + 1
        self.idle = [a for a in self.idle if a != actor]
        for _ in range(held):
            self.running[actor.info.remote()] = Call(actor, None, time.monotonic())

    def _pinged(self, ref, call: Call) -> None:
        """A failed generator answered (back to work), is still restarting (ping again), or
        is dead for good (dropped; the loop ends the job if none is left)."""
        try:
            ray.get(ref, timeout=60)
            self.idle.append(call.actor)
        except (ActorUnavailableError, GetTimeoutError):  # _requeue_stuck bounds the wait
            self.running[call.actor.info.remote()] = Call(call.actor, None, call.started)
        except RayActorError as e:
            log.warning("a generator actor died for good (%s); dropping it", type(e).__name__)

    def _requeue_stuck(self) -> None:
        now, c = time.monotonic(), self.spec.cluster
        for ref, call in list(self.running.items()):
            if call.shard is None and now - call.started > c.startup_timeout_s:
                self.running.pop(ref)  # a failed generator that never came back
                log.warning("a generator actor did not come back; dropping it")
                ray.kill(call.actor, no_restart=True)
            elif call.shard is not None and now - call.started > c.call_timeout_s:
                self.running.pop(ref)
                ray.kill(call.actor, no_restart=False)  # restarts with a fresh engine
                self._sideline(call.actor)
                self._retry_or_fail(call.shard, f"shard exceeded {c.call_timeout_s:.0f}s")


def _actor_hex(ref) -> str | None:
    """The id of the actor whose task made `ref` (run.json names it; None if unknown)."""
    try:
        return ref.task_id().actor_id().hex()
    except Exception:  # not an actor task's ref (tests pass stand-ins)
        return None


def _cause_line(e: RayTaskError) -> str:
    cause = e.cause if getattr(e, "cause", None) is not None else e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}"


def wait_ready(gens: list, rewards: list, timeout: float,
               stop: Interrupt | None = None) -> list[dict]:
    """Every actor has loaded its model, or the job stops with a reason (never a hang);
    returns the generators' info(). A stop signal ends the wait within STARTUP_POLL_S
    (Interrupted): loading models takes seconds to minutes."""
    refs = [g.info.remote() for g in gens] + [r.ready.remote() for r in rewards]
    deadline = time.monotonic() + timeout
    ready, not_ready = [], refs
    while not_ready and time.monotonic() < deadline:
        if stop is not None:
            stop.check()
        ready, not_ready = ray.wait(refs, num_returns=len(refs),
                                    timeout=min(STARTUP_POLL_S, deadline - time.monotonic()))
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
        failed = ModelFailed if isinstance(getattr(e, "cause", None), ModelError) else JobError
        raise failed(_cause_line(e)) from None
    return infos
