"""The generator fleet: a fixed number of generator groups, or (cluster.generators: auto) as
many as the cluster has room for, up to cluster.max_generators, released when work runs out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray
from ray.autoscaler import sdk
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from specrej_ray.distributed.answers import answers
from specrej_ray.distributed.placement import GeneratorGroup, group_shape
from specrej_ray.distributed.ray_internals import free_per_node
from specrej_ray.spec import JobSpec

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often auto scaling looks for room; the shard loop never waits longer


class Fleet:
    """The shard loop's view of its generators: it asks for new ones (`grow`), gives back
    idle ones (`release`) and learns of dead ones from what it still holds (`in_play`)."""

    def __init__(self, spec: JobSpec, start: Callable[[str], GeneratorGroup]) -> None:
        c = spec.cluster
        self.auto = c.generators == "auto"
        self.limit = c.max_generators if self.auto else int(c.generators)
        self.startup_s = c.startup_timeout_s
        self.shape = group_shape(spec)
        self.infos: dict[str, dict] = {}  # label -> GeneratorActor.info() of every actor
        self._start = start
        self._count = 0
        self._groups: dict = {}  # actor -> its group, once it answered (or from start())
        self._starting: dict[GeneratorGroup, tuple[list, float]] = {}  # -> (refs, started)
        self._asked = False
        self._next_poll = 0.0

    def start(self) -> list:
        """The first actors: every one of a fixed count, or one for auto (the driver waits
        for them to load); auto also asks the autoscaler for room for all of them."""
        self._ask(True)
        groups = [self._new() for _ in range(1 if self.auto else self.limit)]
        self._groups.update((g.actor, g) for g in groups)
        return [g.actor for g in groups]

    def reward_actors(self) -> list:
        """The reward actors placed with generators (each group's own)."""
        return [a for g in self._groups.values() for a in g.rewards]

    def label(self, actor) -> str:
        return self._groups[actor].label

    def record(self, actor, info: dict) -> None:
        self.infos[self.label(actor)] = info

    @property
    def starting(self) -> bool:
        return bool(self._starting)

    def pending(self) -> list:
        """Unanswered refs of starting generators: the loop waits on them too, so a new one
        gets work as soon as it is ready (answered ones would make that wait return at once)."""
        out = []
        for refs, _ in self._starting.values():
            out += ray.wait(refs, num_returns=len(refs), timeout=0)[1]
        return out

    @property
    def wait_s(self) -> float:
        return POLL_S if self.auto else 10.0

    def grow(self, queued: int, in_play: list) -> list:
        """Generators that just became ready (the loop gives them work at once). Starts one
        more when shards wait, the cluster shows room for it and none is already starting."""
        self._forget_dead(in_play)
        if not self.auto:
            return []
        ready = self._collect_started()
        now = time.monotonic()
        if queued and now >= self._next_poll:
            self._next_poll = now + POLL_S
            self._ask(True)
            if not self._starting and len(self._groups) < self.limit and self._room():
                group = self._new()
                refs = [group.actor.info.remote()] + [r.ready.remote() for r in group.rewards]
                self._starting[group] = (refs, now)
                log.info("cluster has room: starting %s", group.label)
        return ready

    def release(self, queued: int, idle: list, busy: set = frozenset()) -> list:
        """With auto, once no shard waits, idle generators (and any still starting) go and the
        autoscaler request is dropped, so their nodes can scale down; returns the idle slots
        left (those of generators still running a shard: `busy`)."""
        if not self.auto or queued:
            return idle
        for actor in dict.fromkeys(a for a in idle if a not in busy):
            log.info("queue drained: releasing %s", self.label(actor))
            self._groups.pop(actor).release()
        idle = [a for a in idle if a in busy]
        for group in list(self._starting):
            self._drop_starting(group)
        self._ask(False)
        return idle

    def final_infos(self, timeout: float) -> dict[str, dict]:
        """Each live generator's info() now (its engine's counters included), as answered
        within `timeout` s; one that does not answer keeps the info it gave at start."""
        return answers({g.label: g.actor.info.remote() for g in self._groups.values()},
                       timeout)

    def shutdown(self) -> None:
        for group in [*self._groups.values(), *self._starting]:
            group.release()
        self._groups.clear()
        self._starting.clear()
        self._ask(False)

    def _new(self) -> GeneratorGroup:
        group = self._start(f"generator-{self._count}")
        self._count += 1
        return group

    def _ask(self, want: bool) -> None:
        """Ask the autoscaler for room for every generator, or withdraw the ask."""
        if self.auto and want != self._asked:
            sdk.request_resources(bundles=[self.shape] * self.limit if want else [])
            self._asked = want

    def _room(self) -> bool:
        """Some one node has room for a whole group (its bundles are packed on one node).
        Still a hint, not a promise: a group that cannot be placed is dropped after
        cluster.startup_timeout_s."""
        return any(all(free.get(k, 0.0) >= v for k, v in self.shape.items())
                   for free in free_per_node())

    def _forget_dead(self, in_play: list) -> None:
        """Actors the loop dropped (dead for good) free their group's slot and reservation."""
        for actor in [a for a in self._groups if a not in in_play]:
            log.info("%s is gone; freeing its slot", self.label(actor))
            self._groups.pop(actor).release()

    def _collect_started(self) -> list:
        ready = []
        for group, (refs, started) in list(self._starting.items()):
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(done) == len(refs):
                try:
                    info = ray.get(refs[0], timeout=60)
                    ray.get(refs[1:], timeout=60)
                except (RayActorError, RayTaskError, GetTimeoutError) as e:
                    log.warning("%s failed to start (%s); dropping it", group.label,
                                type(e).__name__)
                    self._drop_starting(group)
                    continue
                del self._starting[group]
                self._groups[group.actor] = group
                self.infos[group.label] = info
                ready.append(group.actor)
            elif time.monotonic() - started > self.startup_s:
                log.warning("%s did not start within %.0fs; dropping it", group.label,
                            self.startup_s)
                self._drop_starting(group)
        return ready

    def _drop_starting(self, group: GeneratorGroup) -> None:
        del self._starting[group]
        group.release()
