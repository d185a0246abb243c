"""What run.json records about a run: per-shard records, failures, wall-clock, versions.

A resumed run carries the shard records and wall-clock of the earlier invocations on.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from specrej_ray.job.runtime import package_versions
from specrej_ray.spec import JobSpec

if TYPE_CHECKING:
    from specrej_ray.job.shards import Shard

class ShardCounters(Protocol):
    """What the run's metrics count as shards finish (distributed.metrics.Metrics)."""

    def shard_done(self, prompts: int, tokens: int, rejected: int) -> None: ...

    def shard_retried(self) -> None: ...


@dataclass
class RunState:
    """What run.json records, accumulated while the shards run."""

    failures: list[dict] = field(default_factory=list)
    shard_seconds: dict[str, float] = field(default_factory=dict)  # this invocation's shards
    shard_actors: dict[str, str] = field(default_factory=dict)  # shard id -> generator label
    generators: dict[str, dict] = field(default_factory=dict)  # label -> its info()
    shards: dict[str, dict] = field(default_factory=dict)  # shard id -> record, all invocations
    invocations: list[dict] = field(default_factory=list)  # the earlier invocations
    rewards: list[dict] = field(default_factory=list)  # driver.reward_counters at the end
    metrics: ShardCounters | None = None  # the run's Ray metrics (distributed.metrics)
    started: float = field(default_factory=time.monotonic)
    first_sent: float | None = None  # the shard loop: first shard sent .. last result in
    last_done: float | None = None
    interrupted: bool = False  # a stop signal ended this invocation
    error: str | None = None  # a write that failed ended it (a full disk), in one line

    @property
    def status(self) -> str:
        """How this invocation ended: completed, failed (a shard or a write failed) or
        interrupted."""
        if self.interrupted:
            return "interrupted"
        return "failed" if self.failures or self.error else "completed"

    @classmethod
    def resume(cls, prev: dict | None, spec: JobSpec,
               records: dict[str, dict] | None = None,
               metrics: ShardCounters | None = None) -> RunState:
        """A state that goes on from the run.json a resume finds (`prev`, of this spec only), and
        from the run records kept with the shards (`records`, OutputDir.records): an
        invocation killed before it wrote run.json (SIGKILL) left its shards' records
        there, and is counted as `killed`."""
        prev = prev or {}
        if prev.get("fingerprint") != spec.fingerprint():
            prev = {}
        invocations = [_ended(i) for i in prev.get("invocations") or []]
        if prev and not invocations:  # written before invocations were recorded
            invocations = [{"seconds": prev.get("seconds", {}).get("total", 0.0)}]
        shards = dict(prev.get("shards") or {})
        killed: dict[int, int] = {}  # invocation index -> shards it finished
        for sid, rec in (records or {}).items():
            run = rec.get("run")
            if run is None or rec.get("fingerprint") != spec.fingerprint():
                continue
            if run.get("invocation", 0) >= len(invocations):
                killed[run["invocation"]] = killed.get(run["invocation"], 0) + 1
            if sid not in shards or shards[sid].get("invocation", -1) < run.get("invocation", 0):
                shards[sid] = run
        invocations += [{"status": "killed", "shards_done": killed[i]} for i in sorted(killed)]
        return cls(shards=shards, invocations=invocations, metrics=metrics)

    def attempt_seen(self, started: float) -> None:
        now = time.monotonic()
        self.first_sent = started if self.first_sent is None else min(self.first_sent, started)
        self.last_done = now if self.last_done is None else max(self.last_done, now)

    def _record(self, shard: Shard, actor: str | None) -> dict:
        old = self.shards.get(shard.id)
        # A shard done before and run again (dropped from the manifest) starts a new record;
        # one that failed before keeps its failed attempts.
        rec = old if old and old.get("status") != "done" else {"attempts": 0, "failures": []}
        rec.update(prompts=len(shard), actor=actor, invocation=len(self.invocations))
        rec["attempts"] += 1
        self.shards[shard.id] = rec
        return rec

    def shard_done(self, shard: Shard, results: list, started: float,
                   actor: str | None) -> dict:
        """Record a finished shard; returns its record (written with the shard's files)."""
        seconds = time.monotonic() - started
        rec = self._record(shard, actor)
        rec.update(status="done", seconds=seconds)
        self.shard_seconds[shard.id] = seconds
        if self.metrics is not None:
            self.metrics.shard_done(len(results), sum(r.tokens_generated for r in results),
                                    sum(r.rejected for r in results))
        return rec

    def shard_failed(self, shard: Shard, why: str, actor: str | None, final: bool) -> None:
        rec = self._record(shard, actor)
        rec["failures"].append({"attempt": rec["attempts"], "reason": why, "actor": actor})
        rec["status"] = "failed" if final else "retrying"
        if not final and self.metrics is not None:
            self.metrics.shard_retried()


def _ended(invocation: dict) -> dict:
    """An earlier invocation as it ended: one whose record still says `publishing` died
    while its final files were moved into place (data/final_set.py)."""
    if invocation.get("status") == "publishing":
        return {**invocation, "status": "killed"}
    return invocation


def _wall_clock(state: RunState, t_start: float, t_gen: float) -> tuple[dict, list[dict]]:
    """This invocation's seconds, and every invocation's (the earlier ones first)."""
    seconds = {"total": time.time() - t_start, "generate": time.time() - t_gen}
    if state.first_sent is not None:  # startup: Ray and the actors' models; then the shards
        seconds["startup"] = state.first_sent - state.started
        seconds["shards"] = state.last_done - state.first_sent
    this = {"started": datetime.fromtimestamp(t_start, UTC).isoformat(timespec="seconds"),
            "status": state.status, "seconds": seconds["total"],
            "shards_done": len(state.shard_seconds),
            "shards_failed": len({f["shard"] for f in state.failures if f.get("shard")})}
    if state.error:
        this["reason"] = state.error
    return seconds, [*state.invocations, this]


def run_info(spec, counts, problems, state, t_start, t_gen) -> dict:
    seconds, invocations = _wall_clock(state, t_start, t_gen)
    shards = {sid: dict(rec) for sid, rec in state.shards.items()}
    for sid, label in state.shard_actors.items():
        shards[sid]["generator"] = label
    return {
        "name": spec.name,
        "fingerprint": spec.fingerprint(),
        "spec": spec.model_dump(mode="json"),
        "versions": package_versions(),
        "python": platform.python_version(),
        "counts": counts,
        "skipped": len(problems),
        "failed_shards": state.failures,
        "shard_seconds": state.shard_seconds,
        "shard_actors": state.shard_actors,
        "generators": state.generators,
        "rewards": state.rewards,
        "seconds": seconds,
        "shards": shards,
        "invocations": invocations,
        "seconds_all_invocations": sum(i.get("seconds", 0.0) for i in invocations),
    }
