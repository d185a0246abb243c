"""The driver: `specrej-ray run` from a spec to a written dataset.

The way through: the checks before Ray (job/preflight.py, as `validate` makes them), the
output is taken (one writer), prompts are streamed, prepared and keyed by content into a
file on local disk (prompt_store.py), a resume keeps what is done, the rest is planned in
shards (shards.py); Ray starts with the generator and reward actors, and the shard loop
(shard_loop.py) feeds them shards, writing each as it finishes (output.py); then the final
files are assembled and run.json written.
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import ray

from specrej_ray.data.output import OutputDir, Resume
from specrej_ray.data.prompt_store import PromptStore
from specrej_ray.distributed.answers import AT_END_S, ON_STOP_S, answers
from specrej_ray.distributed.cluster import check_resources, connect_ray
from specrej_ray.distributed.metrics import Metrics
from specrej_ray.distributed.placement import start_group
from specrej_ray.distributed.reward_pool import start_reward_actors
from specrej_ray.distributed.scaling import Fleet
from specrej_ray.distributed.shard_loop import ShardLoop, wait_ready
from specrej_ray.errors import JobError, OutputError, RewardFailed
from specrej_ray.job.finish import record_failure, write_final_set
from specrej_ray.job.interrupt import Interrupt, Interrupted
from specrej_ray.job.preflight import Checked, preflight
from specrej_ray.job.prepare import Prepared, describe_models
from specrej_ray.job.progress import Progress
from specrej_ray.job.run_record import RunState
from specrej_ray.job.shards import failure_record, plan_shards
from specrej_ray.quality.audit import audit_picker
from specrej_ray.quality.auto_schedule import Calibration
from specrej_ray.spec import JobSpec

__all__ = ["JobError", "RewardFailed", "run_job"]


def run_job(spec: JobSpec, echo=print, outdir: OutputDir | None = None,
            stop: Interrupt | None = None, about: dict | None = None,
            checked: Checked | None = None) -> dict:
    """Run the job on its output location, which this run holds alone until it returns (or
    on `outdir`, already taken by the caller, who releases it). With `stop`'s handlers
    installed, a signal ends it with Interrupted, raised after what is finished is written.
    `about`: facts the caller adds to run.json and the card (`command`, an iteration's
    `policy`). `checked`: what the checks before Ray found (job/preflight.py), where the
    caller made them; else they are made here, `validate`'s own."""
    stop = stop or Interrupt()  # no handlers: nothing but KeyboardInterrupt stops it
    t_start = time.time()
    if checked is None:  # the output's checks too, unless the caller holds it already
        with stop.at_once():  # models resolved, a .gguf converted: minutes, safe to cut
            checked = preflight(spec, output=outdir is None, here=not ray.is_initialized(),
                                between=stop.check)
    if outdir is not None:
        return _run_job(spec, outdir, t_start, echo, stop, about or {}, checked)
    with OutputDir.for_spec(spec, echo) as taken:
        return _run_job(spec, taken, t_start, echo, stop, about or {}, checked)


def _run_job(spec: JobSpec, outdir: OutputDir, t_start: float, echo, stop: Interrupt,
             about: dict, checked: Checked) -> dict:
    # Prepared prompts wait on local disk, not in memory: the driver's memory stays flat.
    with tempfile.TemporaryDirectory(prefix="specrej-prompts-") as tmp:
        return _run_job_in(spec, outdir, t_start, echo, stop, Path(tmp), about, checked)


def _run_job_in(spec: JobSpec, outdir: OutputDir, t_start: float, echo, stop: Interrupt,
                tmp: Path, about: dict, checked: Checked) -> dict:
    gen_path, rm_paths = checked.gen_path, checked.rm_paths
    models, prepared, store = _start_up(spec, checked, tmp, stop)
    problems, source = prepared.problems, prepared.source
    for p in problems:
        echo(f"[specrej] skipped: {p.line(source)}")
    out = outdir.out
    keys = store.content_keys
    found = outdir.resume(keys)
    _report_resume(found, out, echo)
    # schedule: auto: the first prompts calibrate (shards of their own), the rest follow.
    k = min(spec.search.calibration_prompts if spec.search.calibrates else 0, len(store))
    size = spec.cluster.shard_size
    first = plan_shards(store, size, found.done, 0, k)
    todo = first + plan_shards(store, size, found.done, k)
    echo(f"[specrej] {len(store)} prompts, {len(found.done)} already done in {out}; "
         f"{len(store) - len(found.done)} to generate in {len(todo)} shards")
    state = RunState.resume(outdir.previous_run_info(), spec, outdir.records,
                            Metrics(spec.name))
    t_gen = time.time()
    fatal: JobError | None = None
    if todo:
        # A signal whose Interrupted was swallowed on its way (raised inside a callback
        # that ignores exceptions, e.g. during an import) still stops the run before Ray.
        stop.check()
        connect_ray(spec, stop)
        check_resources(spec, echo)
        progress = Progress(len(store), len(found.done))
        try:
            _run_shards(spec, gen_path, rm_paths, todo, outdir, state, progress, stop,
                        Calibration(spec, outdir, store.ids(0, k), len(first), echo))
        except JobError as e:  # still write out every shard that finished
            fatal = e
            state.failures.append(failure_record(e.shard, str(e)))
        except Interrupted:  # while the actors started: nothing is finished or abandoned
            pass
        except OutputError as e:  # a shard could not be written (a full disk)
            record_failure(spec, outdir, state, problems, (t_start, t_gen), e)
            raise
        finally:
            progress.close()
    stop.defer()  # a signal from now on must not cut the writing short
    if outdir.holds_nothing:
        # No prompt finished on a location that held no results: no empty dataset, card or
        # run record; what this run wrote goes when the output is released.
        stop.check()
        raise fatal or JobError(f"{len(state.failures)} shard(s) failed and none finished; "
                                f"nothing was written to {out}: fix the cause (see the "
                                "lines above) and run again")
    if outdir.replacing:
        # An --overwrite that wrote nothing (stopped, or every shard failed): the earlier
        # dataset stays whole, and nothing is assembled over it.
        stop.check()
        raise fatal or JobError(f"{len(state.failures)} shard(s) failed and none finished; "
                                f"the earlier results in {out} are kept: fix the cause (see "
                                "the lines above) and run again")
    try:
        info = write_final_set(spec, outdir, keys, found, (source, problems), state, stop,
                               {"models": models, **about}, (t_start, t_gen), echo)
    except OutputError as e:
        record_failure(spec, outdir, state, problems, (t_start, t_gen), e)
        raise
    # run.json decides: a signal after it was written as completed finds the work done.
    if state.interrupted:
        stop.check()
    elif stop.requested:
        echo(f"[specrej] {signal.Signals(stop.signum).name} came once the run was complete "
             "and recorded: nothing was stopped")
    if fatal is not None:
        raise fatal
    if state.failures:
        raise JobError(
            f"{len(state.failures)} shard(s) failed (see {out.url_of('errors.jsonl')}); "
            "run again to retry them"
        )
    return info


def _start_up(spec: JobSpec, checked: Checked, tmp: Path, stop: Interrupt
              ) -> tuple[dict, Prepared, PromptStore]:
    """The models described (their weights hashed) and the prompts prepared into `tmp`.
    Each step may take minutes on a large model or prompt file, and writes nothing a stop
    would leave half done (`tmp` goes with the run), so a signal stops it at once."""
    with stop.at_once():
        models = describe_models(spec, checked.gen_path, checked.rm_paths)
        prepared = Prepared(spec, checked.gen_path, checked.context)
        store = PromptStore.build(prepared.chunks(), tmp)
        prepared.check(len(store), allow_empty=False)
    stop.check()  # a signal whose Interrupted the code above swallowed
    return models, prepared, store


def _report_resume(found: Resume, out, echo) -> None:
    """Say what a resume will not reuse, and why: nothing is regenerated silently."""
    for why in found.dropped:
        echo(f"[specrej] regenerating shard {why}")
    if found.changed:
        shown = ", ".join(found.changed[:5]) + (" ..." if len(found.changed) > 5 else "")
        echo(f"[specrej] regenerating {len(found.changed)} prompt(s) whose text or chat input "
             f"changed since their results in {out} were made: {shown}")


def _run_shards(spec, gen_path, rm_paths, todo, outdir, state, progress,
                stop: Interrupt, calibration: Calibration) -> None:
    """Start the actors, run the shard loop (calibration shards first), and stop the actors
    whatever happens."""
    # Rewards placed `own` are shared by every generator; the others start with each one.
    shared = [start_reward_actors(r, path) if r.placement == "own" else []
              for r, path in zip(spec.reward, rm_paths, strict=True)]
    fleet = Fleet(spec, lambda label: start_group(spec, gen_path, rm_paths, shared, label))
    ready = False  # every actor loaded: only then are their counters worth asking for
    try:
        gens = fleet.start()
        infos = wait_ready(gens, [a for pool in shared for a in pool] + fleet.reward_actors(),
                           spec.cluster.startup_timeout_s, stop)
        for actor, info in zip(gens, infos, strict=True):
            fleet.record(actor, info)
        ready = True
        first, rest = todo[: calibration.count], todo[calibration.count :]
        tables: dict[str, dict] = {}
        if first:
            loop = ShardLoop(spec, fleet, outdir, state, progress, stop, grid=calibration.grid)
            gens = loop.run(first, gens)
            tables = loop.tables
        if rest and not stop.requested:
            auto = spec.search.calibrates
            ShardLoop(spec, fleet, outdir, state, progress, stop,
                      choice=calibration.choice(tables), audit=audit_picker(spec),
                      audited=calibration.audited if auto else None,
                      audit_grid=calibration.grid if auto else ()).run(rest, gens)
    finally:
        state.generators.update(fleet.infos)
        # An actor still loading its model would answer only once it has; a stop before
        # this run finished a shard keeps nothing those counters would describe, and the
        # first shard's actors answer only once their batch is done: not waited for.
        if ready and (state.shard_seconds or not stop.requested):
            wait_s = ON_STOP_S if stop.requested else AT_END_S
            _add_engine_counters(state.generators, fleet.final_infos(wait_s))
            state.rewards = reward_counters([a for pool in shared for a in pool]
                                            + fleet.reward_actors(), wait_s)
        fleet.shutdown()
        for a in (a for pool in shared for a in pool):
            ray.kill(a, no_restart=True)


def reward_counters(actors: list, timeout: float) -> list[dict]:
    """Per reward (summed over its actors): requests, reward-model tokens processed and what
    full re-scoring would have processed (reward.tracked). An actor that does not answer
    within `timeout` s is left out; actors restarted during the run count from their
    restart."""
    totals: dict[str, dict] = {}
    for got in answers({i: a.stats.remote() for i, a in enumerate(actors)}, timeout).values():
        t = totals.setdefault(got["name"], {"name": got["name"],
                                            "incremental": got["incremental"], "actors": 0})
        t["actors"] += 1
        for k, v in got.items():
            if k not in ("name", "incremental"):
                t[k] = t.get(k, 0) + v
    return list(totals.values())


def _add_engine_counters(infos: dict[str, dict], final: dict[str, dict]) -> None:
    """Each generator's engine counters at the end, beside what it said when it started; a
    generator restarted meanwhile (a lost node) says where it runs now, and its counters
    are its new incarnation's."""
    for label, now in final.items():
        info = infos.setdefault(label, now)
        info["engine"] = now.get("engine")
        info["vllm"] = now.get("vllm")
        if now.get("node_id") != info.get("node_id"):
            info["restarted_on"] = now.get("node_id")
