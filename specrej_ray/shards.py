"""Shards: the unit of work and of resume, planned from the prompts (Ray-free)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass, field

from specrej_ray.engine.sequence import PromptResult
from specrej_ray.job import PromptTask
from specrej_ray.prompts import Prompt


@dataclass
class Shard:
    id: str
    prompts: list[Prompt]
    tasks: list[PromptTask]
    keys: dict[str, dict[str, str]]  # prompt id -> content key (output.content_key)
    attempts: int = 0  # failed attempts charged to this shard (cluster.max_shard_retries)
    shared: bool = False  # its current attempt shares a generator with another shard
    alone: bool = False  # failed while sharing one: runs alone from then on


@dataclass
class ShardOutput:
    """What a generator returns for a shard: its prompts' results (in shard order), and
    calibration data (prompt id -> calibrate.table_json) and audit records (audit.record) of
    the prompts that have them."""

    results: list[PromptResult]
    tables: dict[str, dict] = field(default_factory=dict)
    audits: list[dict] = field(default_factory=list)


def plan_shards(prompts: list[Prompt], tasks: list[PromptTask],
                keys: dict[str, dict[str, str]], size: int,
                done: Collection[str] = (), start: int = 0) -> list[Shard]:
    """Shards of up to `size` consecutive prompts that are not done. A shard is named by the
    position of its first prompt (the lists start at `start` in the job) and a hash of its
    prompts' ids and content: stable across resumes, and never the name of an edited
    prompt's old results."""
    todo = [i for i, p in enumerate(prompts) if p.id not in done]
    shards = []
    for at in range(0, len(todo), size):
        part = todo[at : at + size]
        ps = [prompts[i] for i in part]
        blob = json.dumps([[p.id, keys[p.id]] for p in ps], sort_keys=True)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:8]
        shards.append(Shard(f"shard-{start + part[0]:05d}-{digest}", ps, [tasks[i] for i in part],
                            {p.id: keys[p.id] for p in ps}))
    return shards


def failure_record(shard: Shard | None, why: str) -> dict:
    """A failure as errors.jsonl and run.json record it: the shard and its prompt ids."""
    return {"shard": shard.id if shard else None,
            "prompt_ids": [p.id for p in shard.prompts] if shard else [], "reason": why}
