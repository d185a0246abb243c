"""The shard loop's dispatch (no Ray): slots per generator, and shards retried alone."""

from __future__ import annotations

import itertools

from specrej_ray.distributed.shard_loop import Call, ShardLoop
from specrej_ray.job.shards import Shard

_refs = itertools.count()


class FakeActor:
    def __init__(self, name: str) -> None:
        self.name = name
        self.run_shard = self  # actor.run_shard.remote(tasks)

    def remote(self, tasks, choice=None, audit=(), grid=()):
        return f"ref-{next(_refs)}"

    def __repr__(self) -> str:
        return self.name


def shard(name: str, alone: bool = False) -> Shard:
    return Shard.of(name, [], [], {}, alone=alone)


def placed(running: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in running.values():
        out.setdefault(c.actor.name, []).append(c.shard.id)
    return out


def dispatch(queue: list, idle: list, running: dict) -> None:
    """The loop's dispatch on these lists (no Ray, no fleet)."""
    loop = ShardLoop.__new__(ShardLoop)
    loop.queue, loop.idle, loop.running = queue, idle, running
    loop.grid = loop.choice = loop.audit = None
    loop.audit_grid = ()
    loop._dispatch()


def test_two_slots_each_fill_generators_in_turn_and_mark_shared_shards():
    g0, g1 = FakeActor("g0"), FakeActor("g1")
    idle, running = [g0, g1, g0, g1], {}
    queue = [shard(f"s{i}") for i in range(5)]
    dispatch(queue, idle, running)
    assert placed(running) == {"g0": ["s0", "s2"], "g1": ["s1", "s3"]}
    assert [s.id for s in queue] == ["s4"] and idle == []
    assert all(c.shard.shared for c in running.values())


def test_a_shard_retried_alone_waits_for_an_empty_generator_and_is_not_overtaken():
    g0 = FakeActor("g0")
    busy = shard("busy")
    running = {"r": Call(g0, busy, 0.0)}
    idle = [g0]  # one free slot, but g0 still runs `busy`
    queue = [shard("retry", alone=True), shard("next")]
    dispatch(queue, idle, running)
    assert [s.id for s in queue] == ["retry", "next"] and idle == [g0]  # nothing sent
    running.clear()
    idle = [g0, g0]
    dispatch(queue, idle, running)
    assert placed(running) == {"g0": ["retry"]}  # alone: g0 takes nothing else meanwhile
    assert [s.id for s in queue] == ["next"] and idle == [g0]
    assert not any(c.shard.shared for c in running.values())
