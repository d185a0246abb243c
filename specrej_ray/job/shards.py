"""Shards: the unit of work and of resume, planned from the prompts (Ray-free)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specrej_ray.data.prompts import Prompt, PromptTask
from specrej_ray.engine.sequence import PromptResult


class ShardSource(Protocol):
    """The job's prepared prompts, by position (prompt_store.PromptStore for a run; ListSource
    for prompts already in memory)."""

    def __len__(self) -> int: ...

    def ids(self, start: int, stop: int) -> list[str]: ...

    def prompts(self, positions: Sequence[int]) -> list[Prompt]: ...

    def tasks(self, positions: Sequence[int]) -> list[PromptTask]: ...

    def keys(self, positions: Sequence[int]) -> dict[str, dict[str, str]]: ...


@dataclass
class ListSource:
    """Prompts, their tasks and content keys held in lists."""

    prompt_list: list[Prompt]
    task_list: list[PromptTask]
    key_map: dict[str, dict[str, str]]

    def __len__(self) -> int:
        return len(self.prompt_list)

    def ids(self, start: int, stop: int) -> list[str]:
        return [p.id for p in self.prompt_list[start:stop]]

    def prompts(self, positions: Sequence[int]) -> list[Prompt]:
        return [self.prompt_list[i] for i in positions]

    def tasks(self, positions: Sequence[int]) -> list[PromptTask]:
        return [self.task_list[i] for i in positions]

    def keys(self, positions: Sequence[int]) -> dict[str, dict[str, str]]:
        return {self.prompt_list[i].id: self.key_map[self.prompt_list[i].id] for i in positions}


@dataclass
class Shard:
    """A shard names its prompts by position in the source; their text, tasks and keys are
    read when needed, so a queue of thousands of shards holds 4 bytes a prompt."""

    id: str
    source: ShardSource
    positions: np.ndarray
    attempts: int = 0  # failed attempts charged to this shard (cluster.max_shard_retries)
    shared: bool = False  # its current attempt shares a generator with another shard
    alone: bool = False  # failed while sharing one: runs alone from then on

    @classmethod
    def of(cls, shard_id: str, prompts: list[Prompt], tasks: list[PromptTask],
           keys: dict[str, dict[str, str]], **kw) -> Shard:
        return cls(shard_id, ListSource(prompts, tasks, keys), np.arange(len(prompts)), **kw)

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def prompts(self) -> list[Prompt]:
        return self.source.prompts(self.positions)

    @property
    def tasks(self) -> list[PromptTask]:
        return self.source.tasks(self.positions)

    @property
    def keys(self) -> dict[str, dict[str, str]]:
        return self.source.keys(self.positions)

    @property
    def prompt_ids(self) -> list[str]:
        return [p.id for p in self.prompts]


@dataclass
class ShardOutput:
    """What a generator returns for a shard: its prompts' results (in shard order), and
    calibration data (prompt id -> calibrate.table_json) and audit records (audit.record) of
    the prompts that have them."""

    results: list[PromptResult]
    tables: dict[str, dict] = field(default_factory=dict)
    audits: list[dict] = field(default_factory=list)


def plan_shards(source: ShardSource, size: int, done: Collection[str] = (), start: int = 0,
                stop: int | None = None) -> list[Shard]:
    """Shards of up to `size` consecutive prompts of source[start:stop] that are not done. A
    shard is named by the position of its first prompt and a hash of its prompts' ids and
    content: stable across resumes, and never the name of an edited prompt's old results."""
    stop = len(source) if stop is None else stop
    todo = np.flatnonzero(~_done_mask(source, done, start, stop)) + start
    shards = []
    for at in range(0, len(todo), size):
        part = todo[at : at + size]
        keys = source.keys(part)
        blob = json.dumps([[pid, key] for pid, key in keys.items()], sort_keys=True)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:8]
        shards.append(Shard(f"shard-{int(part[0]):05d}-{digest}", source, part))
    return shards


def _done_mask(source: ShardSource, done: Collection[str], start: int, stop: int) -> np.ndarray:
    """Which prompts of source[start:stop] are done. `done` that knows positions (output.
    Supplied, whose positions are the source's) answers at once, without a lookup per id."""
    mask = getattr(done, "mask", None)
    if mask is not None:
        return mask[start:stop]
    return np.array([pid in done for pid in source.ids(start, stop)], bool)


def failure_record(shard: Shard | None, why: str) -> dict:
    """A failure as errors.jsonl and run.json record it: the shard and its prompt ids."""
    return {"shard": shard.id if shard else None,
            "prompt_ids": shard.prompt_ids if shard else [], "reason": why}
