"""The scheduler: which rows enter the cache, which rows step, and the KV budget.

It decides and never runs the model: `schedule()` returns the step as a Batch (the prompts to
prefill first, the groups that feed a token, the groups that draw one), the engine's model
runner runs it, and `postprocess()` gives each prompt its tokens and moves it on.

Admission is first come, first served and row by row: the prompts in flight (arrival order)
get their evicted rows back and their remaining candidates in, then new prompts start, each
taking as many rows as fit, until a request does not fit (nothing overtakes it). A request
fits when every prompt's reservation (the peak it can still reach over its remaining phases,
placed in time: search.reservation) summed with it stays within the budget at every future
step. Before each step a guard checks what the step will really allocate: a prompt whose
growth would not fit waits a step (stall), and if nothing can move, rows are evicted
(rows parked at a decision first, then the youngest prompt), to come back by replaying
their tokens. So the cache never holds more than the budget, whatever answers are late.

A prompt admitted without its prefix in the cache takes the prefix's slots at once (the
budget counts them from then) and the batch prefills it before the step decodes. If that
prefill runs out of memory, admission rolls back to just before the prompt (`Prefill.before`),
so the back-off sees the state an admission that stopped there leaves.

The budget keeps a headroom for one tensor of one layer: the slot pool grows by copying one at
a time (see engine.hf.kv_cache), so rows and prefixes never hold more than the rest (`room`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from specrej_ray.engine.hf.kv_cache import KVCache
from specrej_ray.engine.hf.prompt_state import Admission, Group, PromptState
from specrej_ray.search.reservation import Term, ceil_div, peak


class EngineOOMError(Exception):
    """Out of memory with a single candidate in the batch: halving cannot help."""


@dataclass(frozen=True)
class Checkpoint:
    """The scheduler as it stood at one point of schedule(), to roll admission back to."""

    running: int  # prompts running then (the ones after them came from `waiting` since)
    prompts: list[tuple[PromptState, Admission]]  # each running prompt's admission then
    stalls: int
    evictions: int
    held: int  # the cache's slots then


@dataclass(frozen=True)
class Prefill:
    """A prompt to prefill before the step decodes: its prefix's slots are taken. `before` is
    the scheduler just before it was admitted."""

    prompt: PromptState
    before: Checkpoint


@dataclass
class Batch:
    """One step as the scheduler decided it; the runner runs it in this order: every prefill,
    then one decode of the `decode` groups, then a draw for every row of the `draw` groups
    (a group with no token yet draws from its prompt's logits, a replaying group draws
    nothing). No group at all: the step waits for scores."""

    prefills: list[Prefill]
    groups: list[Group]  # every group that steps, in step order
    decode: list[Group] = field(default_factory=list)
    draw: list[Group] = field(default_factory=list)
    prefilled: int = 0  # prefills run so far (the runner counts; an error stops it short)

    def __post_init__(self) -> None:
        self.decode = [g for g in self.groups if g.decodes]
        self.draw = [g for g in self.groups if g.draws_token]  # before decoding moves `cached`


class Drawn(NamedTuple):
    """A step's draws, rows in the order of Batch.draw's groups."""

    tokens: np.ndarray
    logprobs: np.ndarray | None  # the drawn tokens' own, when a reward is free (self-scored)


class Scheduler:
    def __init__(self, kv: KVCache, budget: int, refill: bool) -> None:
        self.kv, self.budget, self.refill = kv, budget, refill
        self.waiting: deque[PromptState] = deque()
        self.running: list[PromptState] = []  # in arrival order
        self.stalls = self.evictions = 0
        self._prefills: list[Prefill] = []  # of the step being scheduled
        kv.reserve(self.room)  # the pool never grows past what rows and prefixes may hold

    @property
    def headroom(self) -> int:
        return ceil_div(self.budget, 2 * self.kv.n_layers)

    def _budget_with_room(self, room: int) -> int:
        layers2 = 2 * self.kv.n_layers
        budget = ceil_div(room * layers2, layers2 - 1)
        while budget - ceil_div(budget, layers2) < room:
            budget += 1
        return budget

    @property
    def room(self) -> int:
        """What rows and prefixes may hold: the budget less the headroom."""
        return self.budget - self.headroom

    def add(self, state: PromptState) -> None:
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- a step ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        """Admit what fits (the prompts to prefill first), then the groups that step now."""
        self._prefills = []
        while True:
            self._admit()
            groups = self._guard([g for p in self.running for g in p.runnable()])
            if groups or any(p.open is not None for p in self.running) or not self._unstick():
                return Batch(self._prefills, groups)

    def postprocess(self, batch: Batch, drawn: Drawn | None) -> list[PromptState]:
        """Each drawing group takes its tokens, then every prompt moves on; the prompts that
        finished leave."""
        if drawn is not None:
            at = 0
            for g in batch.draw:
                end = at + len(g)
                g.prompt.take(g, drawn.tokens[at:end],
                              None if drawn.logprobs is None else drawn.logprobs[at:end])
                at = end
        for p in list(self.running):
            p.after_step()
        done = [p for p in self.running if p.done]
        self.running = [p for p in self.running if not p.done]
        return done

    def wait_for_scores(self) -> bool:
        """Nothing can step: block on the oldest open decision; False if there is none."""
        for p in self.running:
            if p.open is not None:
                p.close(wait=True)
                return True
        return False

    # -- admission ------------------------------------------------------------------------

    def _admit(self) -> None:
        # Only prompts with rows outside the cache can take more: a step where nothing waits
        # costs no reservations (they grow with the prompts in flight).
        wanting = [p for p in self.running if p.behind()]
        if not wanting and not (self.waiting and (self.refill or not self.running)):
            return
        held = {id(p): p.reservation() for p in self.running}
        for p in wanting:
            if not self._admit_rows(p, held):
                return
        while self.waiting and (self.refill or not self.running):
            p = self.waiting[0]
            complete = self._admit_rows(p, held)
            if p.groups:
                self.running.append(self.waiting.popleft())
            if not complete:
                return

    def _admit_rows(self, p: PromptState, held: dict[int, list[Term]]) -> bool:
        """Bring back p's evicted rows and start its remaining candidates, as many as fit;
        False when a request did not fit (admission stops there)."""
        others = [t for key, terms in held.items() if key != id(p) for t in terms]
        for rows in p.restores():
            k = self._most(lambda k, rows=rows: p.reservation(restore=[rows[:k]]), len(rows),
                           others)
            if k and not self._enter(p, p.admit_restore, rows[:k]):
                k = 0
            if k < len(rows):
                break
        else:
            if p.unstarted:
                k = self._most(lambda k: p.reservation(fresh=k), p.unstarted, others)
                if k:
                    self._enter(p, p.admit_fresh, k)
        held[id(p)] = p.reservation()
        if p.behind():
            if not p.groups and not others:
                raise EngineOOMError(
                    f"the KV budget of {self.budget} tokens cannot hold one candidate of "
                    f"prompt {p.prompt_id!r} ({p.prompt_tokens} prompt tokens, up to "
                    f"{p.cfg.max_new_tokens} new); raise search.kv_budget_gb (or "
                    "gpu_memory_utilization) or lower generator.sampling.max_new_tokens")
            return False
        return True

    def _most(self, terms_for: Callable[[int], list[Term]], most: int, others: list[Term]) -> int:
        """The largest k <= most whose reservation fits beside the others (0 if none)."""
        room, chunk = self.room, self.kv.chunk

        def fits(k: int) -> bool:
            return peak(others + terms_for(k), chunk) <= room

        if fits(most):
            return most
        lo, hi = 0, most  # fits(lo) or lo == 0; not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _enter(self, p: PromptState, admit, arg) -> bool:
        """Admit (taking the prefix's slots, for the batch to prefill, if it is not held);
        False when the prefix does not fit the cache now. Reservations look at the steps
        ahead, and rows about to leave still hold their slots: the prefix's slots are taken
        at once."""
        if not self.kv.has_prefix(p.prefix):
            if self.kv.tokens() + p.prompt_tokens > self.room:
                return False
            self._prefills.append(Prefill(p, self._checkpoint()))
            self.kv.add_prefix(p.prefix, p.prompt_tokens)
        admit(arg)
        return True

    def _checkpoint(self) -> Checkpoint:
        return Checkpoint(len(self.running), [(p, p.admission()) for p in self.running],
                          self.stalls, self.evictions, self.kv.tokens())

    def _roll_back(self, to: Checkpoint) -> None:
        """Admission as it stood at `to`: prompts admitted since wait again, untouched."""
        for p in reversed(self.running[to.running:]):
            p.roll_back(Admission.none())
            self.waiting.appendleft(p)
        del self.running[to.running:]
        for p, admission in to.prompts:
            p.roll_back(admission)
        self.stalls, self.evictions = to.stalls, to.evictions

    # -- the guard ------------------------------------------------------------------------

    def _guard(self, groups: list[Group]) -> list[Group]:
        """The groups whose step fits the budget: younger prompts wait first."""
        room = self.room - self.kv.tokens()
        need = sum(self.kv.growth(g.gid) for g in groups if g.decodes)
        for p in reversed(self.running):
            if need <= room:
                break
            mine = [g for g in groups if g.prompt is p]
            grow = sum(self.kv.growth(g.gid) for g in mine if g.decodes)
            if grow:
                groups = [g for g in groups if g.prompt is not p]
                need -= grow
                self.stalls += 1
        return groups if need <= room else []

    def _unstick(self) -> bool:
        """Nothing can step and no scores are out: evict something so rows can move.
        Rows parked at a decision while others of their prompt wait go first (they come
        back by replay), else the youngest prompt in the cache leaves entirely."""
        for p in reversed(self.running):
            if p.behind() and p.parked():
                self.evictions += p.evict(p.parked())
                return True
        cached = [p for p in self.running if p.groups]
        if len(cached) > 1 or (cached and cached[-1].behind()):
            victim = cached[-1]
            self.evictions += victim.evict(list(victim.groups))
            victim.drop_prefix()
            self._prefills = [f for f in self._prefills if f.prompt is not victim]
            return True
        return False

    # -- out of memory --------------------------------------------------------------------

    def back_off(self, error: Exception, batch: Batch) -> None:
        """The device ran out of memory running `batch`: empty the cache, halve the budget;
        every row comes back by replaying its tokens. If a prefill failed, admission first
        rolls back to just before its prompt."""
        held = self.kv.tokens()
        if batch.prefilled < len(batch.prefills):
            before = batch.prefills[batch.prefilled].before
            self._roll_back(before)
            held = before.held
        rows = sum(len(g) for p in self.running for g in p.groups)
        if rows <= 1:
            raise EngineOOMError(
                f"out of memory with one candidate in the batch ({error}); use a smaller "
                "model, dtype or generator.sampling.max_new_tokens") from error
        self.kv.clear()
        for p in self.running:
            p.lose_cache()
        # Half of what failed, but never less than one candidate needs: if even that runs
        # out of memory, the error above says so.
        one = max(p.layout.prompt(1, p.cfg.max_new_tokens - 1)
                  for p in self.running + list(self.waiting))
        self.budget = max(min(self.budget, held) // 2, self._budget_with_room(one))
        for p in self.running + list(self.waiting):
            p.resize(self.room)
        self.kv.reserve(self.room)
