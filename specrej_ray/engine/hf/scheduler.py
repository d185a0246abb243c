"""The scheduler: which rows enter the cache, which rows step, and the KV budget.

It decides and never runs the model: `schedule()` returns the step as a Batch (the prompts to
prefill first, the groups that feed a token, the groups that draw one, and every slot the step
takes), the engine's model runner runs it, `postprocess()` gives each prompt its tokens, the
engine's reward phase moves each prompt on (never waiting), and `release()` makes the cache
follow: rows no longer live leave it, prompts that need it no more give up their prefix. The
scheduler owns the block manager (engine.hf.block_manager) and is the only one to change it.

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
a time (see engine.hf.kv_pool), so rows and prefixes never hold more than the rest (`room`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from specrej_ray.engine.hf.batch import Batch, Checkpoint, Drawn, Prefill, Streams
from specrej_ray.engine.hf.block_manager import BlockManager
from specrej_ray.engine.hf.prompt_state import Admission, Group, PromptState
from specrej_ray.engine.sequence import Candidate
from specrej_ray.search.reservation import Term, ceil_div, peak


class EngineOOMError(Exception):
    """Out of memory with a single candidate in the batch: halving cannot help."""


class Scheduler:
    def __init__(self, layers: int, budget: int, refill: bool, chunk: int) -> None:
        self.layers, self.budget, self.refill = layers, budget, refill
        self.blocks = BlockManager(chunk)
        self.waiting: deque[PromptState] = deque()
        self.running: list[PromptState] = []  # in arrival order
        self.stalls = self.evictions = 0
        self._prefills: list[Prefill] = []  # of the step being scheduled
        self.blocks.set_limit(self.room)  # the pool never grows past what rows, prefixes hold

    @property
    def headroom(self) -> int:
        return ceil_div(self.budget, 2 * self.layers)

    def _budget_with_room(self, room: int) -> int:
        layers2 = 2 * self.layers
        budget = ceil_div(room * layers2, layers2 - 1)
        while budget - ceil_div(budget, layers2) < room:
            budget += 1
        return budget

    @property
    def room(self) -> int:
        """What rows and prefixes may hold: the budget less the headroom."""
        return self.budget - self.headroom

    def real_tokens(self) -> int:
        """Tokens the cache really holds (prefixes and generated tokens, no page slack)."""
        return sum(p.prompt_tokens + sum(len(g) * g.cached for g in p.groups)
                   for p in self.running if self.blocks.has_prefix(p.prefix))

    def add(self, state: PromptState) -> None:
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- a step ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        """Admit what fits (the prompts to prefill first), then the groups that step now,
        with every slot the step takes."""
        self._prefills = []
        while True:
            self._admit()
            groups = self._guard([g for p in self.running for g in p.runnable()])
            if groups or any(p.waiting for p in self.running) or not self._unstick():
                return self._batch(groups)

    def _batch(self, groups: list[Group]) -> Batch:
        batch = Batch(self._prefills, groups)
        if batch.decode:
            batch.slots = self.blocks.step([(g.gid, g.cached) for g in batch.decode])
            batch.feed = np.concatenate([np.asarray(g.feed(), np.int64) for g in batch.decode])
        if batch.draw:
            sizes = [len(g) for g in batch.draw]
            # One step and one prompt key a group: O(groups) scalars, spread over rows at once.
            batch.streams = Streams(
                np.repeat(np.array([g.pkey for g in batch.draw], np.int64), sizes),
                np.concatenate([g.index for g in batch.draw]),
                np.repeat(np.array([g.generated for g in batch.draw], np.int64), sizes))
        batch.growth, batch.pool = self.blocks.take_growth(), self.blocks.capacity
        return batch

    def postprocess(self, batch: Batch, drawn: Drawn | None) -> None:
        """The step ran: the decoded groups hold one token more in the cache, and each
        drawing group takes its tokens."""
        for g in batch.decode:
            g.cached += 1
        if drawn is None:
            return
        at = 0
        for g in batch.draw:
            end = at + len(g)
            g.prompt.take(g, drawn.tokens[at:end],
                          None if drawn.logprobs is None else drawn.logprobs[at:end])
            at = end

    def release(self) -> list[PromptState]:
        """After the reward phase: rows no longer live leave the cache, prompts whose rows
        have all ended give up their prefix; the prompts that finished leave."""
        for p in self.running:
            for gid, keep in p.release():
                self.blocks.keep_rows(gid, keep)
            if p.rows_ended and self.blocks.has_prefix(p.prefix):
                self._drop_prefix(p)
        done = [p for p in self.running if p.done]
        self.running = [p for p in self.running if not p.done]
        return done

    def waiting_on_rewards(self) -> PromptState | None:
        """The oldest prompt whose scores are out (what to wait for when nothing can step)."""
        return next((p for p in self.running if p.waiting), None)

    # -- admission ------------------------------------------------------------------------

    def _admit(self) -> None:
        # Only prompts with rows outside the cache can take more: a step where nothing waits
        # costs no reservations (they grow with the prompts in flight).
        wanting = [p for p in self.running if p.behind()]
        if not wanting and not (self.waiting and (self.refill or not self.running)):
            return
        held = {id(p): self._reservation(p) for p in self.running}
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
            k = self._most(lambda k, rows=rows: self._reservation(p, restore=[rows[:k]]),
                           len(rows), others)
            if k and not self._enter(p, p.admit_restore, rows[:k]):
                k = 0
            if k < len(rows):
                break
        else:
            if p.unstarted:
                k = self._most(lambda k: self._reservation(p, fresh=k), p.unstarted, others)
                if k:
                    self._enter(p, p.admit_fresh, k)
        held[id(p)] = self._reservation(p)
        if p.behind():
            if not p.groups and not others:
                raise EngineOOMError(
                    f"the KV budget of {self.budget} tokens cannot hold one candidate of "
                    f"prompt {p.prompt_id!r} ({p.prompt_tokens} prompt tokens, up to "
                    f"{p.cfg.max_new_tokens} new); raise search.kv_budget_gb (or "
                    "gpu_memory_utilization) or lower generator.sampling.max_new_tokens")
            return False
        return True

    def _reservation(self, p: PromptState, **more) -> list[Term]:
        return p.reservation(self.blocks.has_prefix(p.prefix), **more)

    def _most(self, terms_for: Callable[[int], list[Term]], most: int, others: list[Term]) -> int:
        """The largest k <= most whose reservation fits beside the others (0 if none)."""
        room, chunk = self.room, self.blocks.chunk

        def fits(k: int) -> bool:
            return peak(others + terms_for(k), chunk) <= room

        if fits(most):
            return most
        lo, hi = 0, most  # fits(lo) or lo == 0; not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _enter(self, p: PromptState, admit: Callable[..., list[Candidate]], arg) -> bool:
        """Admit (taking the prefix's slots, for the batch to prefill, if it is not held),
        the rows in a group of their own; False when the prefix does not fit the cache now.
        Reservations look at the steps ahead, and rows about to leave still hold their
        slots: the prefix's slots are taken at once."""
        if not self.blocks.has_prefix(p.prefix):
            if self.blocks.tokens() + p.prompt_tokens > self.room:
                return False
            before = self._checkpoint()
            slots = self.blocks.add_prefix(p.prefix, p.prompt_tokens)
            self._prefills.append(Prefill(p, before, slots, self.blocks.capacity))
        rows = admit(arg)
        forks, fresh = self._forks(p, rows)
        for parent, positions, children in forks:
            at = children[0].forked_at - 1  # the tokens the parent's row holds for them
            group = Group(p, children, self.blocks.fork(parent.gid, positions, at))
            group.cached = at
            p.enter(group)
        if fresh:
            p.enter(Group(p, fresh, self.blocks.add_group(p.prefix, len(fresh))))
        return True

    @staticmethod
    def _forks(p: PromptState, rows: list[Candidate]
               ) -> tuple[list[tuple[Group, list[int], list[Candidate]]], list[Candidate]]:
        """Rows that are children at their fork, whose parents' rows hold the tokens they
        share: (parent group, the parents' places, the children) each; and the rest."""
        if not any(c.parent is not None for c in rows):
            return [], rows
        where, forks, fresh = p.rows_where(), {}, []
        for c in rows:
            found = where.get(c.parent) if c.forked_at == len(c.tokens) else None
            if found is None or found[0].cached < c.forked_at - 1:
                fresh.append(c)
                continue
            group, place = found
            _, places, children = forks.setdefault(group.gid, (group, [], []))
            places.append(place)
            children.append(c)
        return list(forks.values()), fresh

    def _checkpoint(self) -> Checkpoint:
        return Checkpoint(len(self.running), [(p, p.admission()) for p in self.running],
                          self.stalls, self.evictions, self.blocks.tokens())

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
        room = self.room - self.blocks.tokens()
        need = sum(self._growth(g) for g in groups if g.decodes)
        for p in reversed(self.running):
            if need <= room:
                break
            mine = [g for g in groups if g.prompt is p]
            grow = sum(self._growth(g) for g in mine if g.decodes)
            if grow:
                groups = [g for g in groups if g.prompt is not p]
                need -= grow
                self.stalls += 1
        return groups if need <= room else []

    def _growth(self, g: Group) -> int:
        return self.blocks.growth(g.gid, g.cached)

    def _unstick(self) -> bool:
        """Nothing can step and no scores are out: evict something so rows can move.
        Rows parked at a decision while others of their prompt wait go first (they come
        back by replay), else the youngest prompt in the cache leaves entirely."""
        for p in reversed(self.running):
            if p.behind() and p.parked():
                self._evict(p, p.parked())
                return True
        cached = [p for p in self.running if p.groups]
        if len(cached) > 1 or (cached and cached[-1].behind()):
            victim = cached[-1]
            self._evict(victim, list(victim.groups))
            self._drop_prefix(victim)
            self._prefills = [f for f in self._prefills if f.prompt is not victim]
            return True
        return False

    def _evict(self, p: PromptState, groups: list[Group]) -> None:
        for g in groups:
            self.blocks.drop_group(g.gid)
        self.evictions += p.evict(groups)

    def _drop_prefix(self, p: PromptState) -> None:
        self.blocks.drop_prefix(p.prefix)
        p.forget_prefix()

    # -- out of memory --------------------------------------------------------------------

    def back_off(self, error: Exception, batch: Batch) -> None:
        """The device ran out of memory running `batch`: empty the cache, halve the budget;
        every row comes back by replaying its tokens. If a prefill failed, admission first
        rolls back to just before its prompt."""
        held = self.blocks.tokens()
        if batch.prefilled < len(batch.prefills):
            before = batch.prefills[batch.prefilled].before
            self._roll_back(before)
            held = before.held
        rows = sum(len(g) for p in self.running for g in p.groups)
        if rows <= 1:
            raise EngineOOMError(
                f"out of memory with one candidate in the batch ({error}); use a smaller "
                "model, dtype or generator.sampling.max_new_tokens") from error
        self.blocks.clear()
        for p in self.running:
            p.lose_cache()
        # Half of what failed, but never less than one candidate needs: if even that runs
        # out of memory, the error above says so.
        one = max(p.layout.prompt(1, p.cfg.max_new_tokens - 1)
                  for p in self.running + list(self.waiting))
        self.budget = max(min(self.budget, held) // 2, self._budget_with_room(one))
        for p in self.running + list(self.waiting):
            p.resize(self.room)
        self.blocks.set_limit(self.room)
