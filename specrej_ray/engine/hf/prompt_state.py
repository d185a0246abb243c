"""One prompt's speculative rejection as a state machine the scheduler steps.

A prompt's N candidates enter the cache in groups, as memory allows (the first group's size is
its n0). Each step, every group below the prompt's current limit decodes one token: the limit is
the next decision length (where all live candidates meet, so one cut-off ranks them all), or
`cap` tokens past an open decision whose scores are out, or max_new_tokens. Rows that reach the
limit wait there. When every live candidate stands at a decision length, the prompt opens a
decision; when its scores are in, the rejected candidates are cut back to the decision length
and leave the cache. Nothing here depends on what else shares the batch, so a prompt's result
is the same alone or mixed with others (candidate identity).

A prompt never sees the cache: its groups say which rows hold how many tokens there, and the
scheduler, which alone changes the block manager, makes the cache follow them (`release`).

Rows evicted from the cache (to let another group of the prompt reach a decision, to break a
stall, or after an out-of-memory error) keep their tokens and come back by replaying them:
their cache is rebuilt by feeding the known tokens, one decode step each, without sampling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specrej_ray.engine.decisions import Decisions, PromptConfig
from specrej_ray.engine.sampling import prompt_key
from specrej_ray.engine.sequence import Candidate
from specrej_ray.engine.task import EngineTask
from specrej_ray.search.rejection import keep_count
from specrej_ray.search.reservation import FOREVER, Term, growth_terms
from specrej_ray.search.schedule import Cohort, Layout


class Group:
    """Rows of one prompt holding the same generated tokens in the cache, in cache order.

    Its rows have `generated` tokens each, of which the cache holds `cached`: one less when
    the rows step normally (the token drawn last step is fed this step), fewer while they
    replay tokens the cache lost, none before their first token (drawn from the prompt's own
    logits, with no decode)."""

    def __init__(self, prompt: PromptState, rows: list[Candidate], gid: int) -> None:
        self.prompt, self.rows, self.gid = prompt, rows, gid  # gid: its block manager id
        self.index = np.array([c.index for c in rows], np.int64)  # candidate index per row
        self.last: np.ndarray | None = None  # the tokens the rows drew last step
        self.cached = 0  # generated tokens its rows hold in the cache (the scheduler counts)

    def keep(self, positions: list[int]) -> None:
        """Keep only these rows, in this order."""
        self.rows = [self.rows[i] for i in positions]
        self.index = self.index[positions]
        if self.last is not None:
            self.last = self.last[positions]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def pkey(self) -> int:
        return self.prompt.pkey

    @property
    def generated(self) -> int:
        return len(self.rows[0].tokens)

    @property
    def decodes(self) -> bool:
        """Whether its step feeds a token through the model: not before its first token,
        which is drawn from the prompt's own logits."""
        return self.generated > 0

    @property
    def replaying(self) -> bool:
        """The cache lost some of its tokens: it feeds them again, drawing nothing."""
        return self.cached + 1 < self.generated

    @property
    def draws_token(self) -> bool:
        """Whether its step draws a token (a replaying group only feeds a known one)."""
        return self.cached + 1 >= self.generated

    @property
    def paced_length(self) -> int:
        """The generated length whose timing and memory the group follows: its length, or
        while it replays, the length its cache will have rebuilt after this step."""
        return self.cached + 1 if self.decodes else 0

    def feed(self) -> np.ndarray | list[int]:
        at = self.cached
        if self.last is not None and at + 1 == self.generated:
            return self.last  # the token each row drew last step, no walk over the rows
        return [c.tokens[at] for c in self.rows]

    def streams(self) -> tuple[np.ndarray, int]:
        """Each row's candidate index, and the step they all draw (one length a group)."""
        return self.index, self.generated


@dataclass(frozen=True)
class Admission:
    """A prompt's admission state (PromptState.admission): candidates started, groups of new
    candidates admitted, its groups and evicted rows, when it first entered."""

    started: int
    waves: int
    groups: list[Group]
    evicted: list[Candidate]
    t0: float | None

    @classmethod
    def none(cls) -> Admission:
        """A prompt that never entered the cache."""
        return cls(0, 0, [], [], None)


class PromptState(Decisions):
    def __init__(self, cfg: PromptConfig, task: EngineTask, room: int) -> None:
        self.pkey = prompt_key(task.samples_of or task.prompt_id)  # its random streams' key
        self.prefix = ("prompt", task.prompt_id, id(self))
        layout = Layout(len(task.input_ids), cfg.chunk)
        cap = cfg.overlap_tokens if task.overlaps else 0
        n = cfg.n or cfg.schedule.auto_n(room, layout, cap, cfg.max_new_tokens)
        super().__init__(cfg, task, n, layout, cap,
                         cfg.schedule.kv_share(room, n, layout, cap, cfg.max_new_tokens))
        self.groups: list[Group] = []
        self.first_logits: torch.Tensor | None = None
        self.started = 0  # candidates that entered the cache at least once
        self.evicted: list[Candidate] = []  # live, started, not in the cache
        self.wave_sizes: list[int] = []  # rows of each group of new candidates admitted

    # -- what the scheduler asks ------------------------------------------------------------

    @property
    def unstarted(self) -> int:
        return self.n - self.started

    def resize(self, room: int) -> None:
        """The budget changed (an out-of-memory back-off): so does the share."""
        self.kv_share = self.cfg.schedule.kv_share(room, self.n, self.layout, self.cap,
                                             self.cfg.max_new_tokens)

    def runnable(self) -> list[Group]:
        """Groups that decode this step: below the limit, or replaying (in lockstep, only
        the rows that are not ahead of the others)."""
        limit = self.limit()
        groups = [g for g in self.groups if g.replaying or g.generated < limit]
        if groups and self.cfg.schedule.lockstep(self.decided_at):
            low = min(len(c.tokens) for c in self._started_live())
            groups = [g for g in groups if g.replaying or g.generated == low]
        return groups

    def parked(self) -> list[Group]:
        """Groups waiting at the limit for the rest of the prompt's candidates."""
        limit = self.limit()
        return [g for g in self.groups if g.generated >= limit and not g.replaying]

    def restores(self) -> list[list[Candidate]]:
        """Evicted live candidates that must move on before the next decision (the ones at
        the limit wait outside the cache), in groups of one length, longest first."""
        limit = self.limit()
        by_length: dict[int, list[Candidate]] = {}
        for c in self.evicted:
            if len(c.tokens) < limit:
                by_length.setdefault(len(c.tokens), []).append(c)
        return [by_length[k] for k in sorted(by_length, reverse=True)]

    def behind(self) -> int:
        """Live candidates outside the cache that still have to reach the limit."""
        return self.unstarted + sum(len(r) for r in self.restores())

    # -- admission ------------------------------------------------------------------------

    def admit_fresh(self, k: int) -> list[Candidate]:
        """The next k candidates start (the scheduler gives them a group, `enter`)."""
        rows = self.candidates[self.started : self.started + k]
        self.started += k
        self.wave_sizes.append(k)
        return rows

    def admit_restore(self, rows: list[Candidate]) -> list[Candidate]:
        """These evicted rows come back (the scheduler gives them a group, `enter`)."""
        keep = {id(c) for c in rows}
        self.evicted = [c for c in self.evicted if id(c) not in keep]
        return rows

    def children_born(self, children: list[Candidate]) -> None:
        """Children start out of the cache: admission forks them from their parents' rows
        where those are cached (the scheduler), else they replay their prefix tokens."""
        self.started = self.n
        self.evicted += children

    def children_gone(self, children: list[Candidate]) -> None:
        self.started = self.n
        gone = {id(c) for c in children}
        self.evicted = [c for c in self.evicted if id(c) not in gone]

    def rows_where(self) -> dict[int, tuple[Group, int]]:
        """Each cached candidate's group and place in it, by candidate index."""
        return {c.index: (g, i) for g in self.groups for i, c in enumerate(g.rows)}

    def enter(self, group: Group) -> None:
        if self.t0 is None:
            self.t0 = time.perf_counter()
        self.groups.append(group)

    def evict(self, groups: Sequence[Group]) -> int:
        """These groups leave the cache (their rows keep their tokens and come back by
        replaying them). Returns the rows evicted."""
        for g in groups:
            self.groups.remove(g)
            self.evicted += g.rows
        return sum(len(g) for g in groups)

    def forget_prefix(self) -> None:
        """The prompt's prefix left the cache: it is prefilled again to come back."""
        self.first_logits = None

    def lose_cache(self) -> None:
        """The cache was emptied (an out-of-memory back-off): every group's rows come back
        by replaying their tokens, and the prompt is prefilled again."""
        self.evict(list(self.groups))
        self.forget_prefix()

    def admission(self) -> Admission:
        """What admission and eviction change of the prompt, to roll back to."""
        return Admission(self.started, len(self.wave_sizes), list(self.groups),
                         list(self.evicted), self.t0)

    def roll_back(self, to: Admission) -> None:
        self.started, self.groups, self.evicted, self.t0 = to.started, to.groups, to.evicted, to.t0
        del self.wave_sizes[to.waves:]

    # -- reservations ---------------------------------------------------------------------

    def reservation(self, held: bool, fresh: int = 0,
                    restore: Sequence[list[Candidate]] = ()) -> list[Term]:
        """The KV slots this prompt may hold at each future step, with `fresh` more new rows
        and the `restore` groups back in the cache: the peak over all its remaining phases,
        rows counted until they must end (see search.reservation). `held`: its prefix is in
        the cache."""
        groups = [(len(g), g.paced_length) for g in self.groups]
        groups += [(fresh, 0)] if fresh else []
        groups += [(len(r), 1) for r in restore]
        pending = self.behind() - fresh - sum(len(r) for r in restore) > 0
        if not groups:
            return [Term(1, FOREVER, const=self.prompt_tokens)] if held else []
        terms, end = self._pending_terms(groups) if pending else self._row_terms(groups)
        return terms + [Term(1, end, const=self.prompt_tokens)]

    def _pending_terms(self, groups: list[tuple[int, int]]) -> tuple[list[Term], float]:
        """More rows are still to come: each group runs to the limit and may wait there
        until they have (Best-of-N rows simply run to their end)."""
        limit = self.limit()
        terms = [t for rows, v in groups for t in growth_terms([(limit, rows)], v)]
        if self.cfg.schedule.decides and limit < self.cfg.max_new_tokens:
            terms += [Term(limit - v + 1, FOREVER, rows=rows, fed=limit - 1, grows=False)
                      for rows, v in groups]
        return terms, FOREVER

    def _row_terms(self, groups: list[tuple[int, int]]) -> tuple[list[Term], float]:
        """(terms, last step) for these (rows, paced length) groups, nothing pending."""
        s, max_new, limit = self.cfg.schedule, self.cfg.max_new_tokens, self.limit()
        if limit >= max_new:  # no meeting ahead: the rows run to their end
            if not s.decides:  # Best-of-N rows each on their own
                terms = [t for rows, v in groups for t in s.reserve(self.cohort(rows, v),
                                                                     self.layout)]
                return terms, _last(terms)
            return self._cohort_terms(groups)
        # Each group runs to the limit and waits there for the others ...
        terms = [t for rows, v in groups for t in growth_terms([(limit, rows)], v)]
        arrive = max(limit - v for _, v in groups)  # the step the last one samples `limit`
        terms += [Term(limit - v + 1, arrive, rows=rows, fed=limit - 1, grows=False)
                  for rows, v in groups if limit - v < arrive]
        # ... then the decision cuts them and the survivors go on together.
        kept = keep_count(self._in_play(), self.cfg.alpha)
        live = sum(rows for rows, _ in groups)
        after = Cohort(min(live, kept), kept, limit, max_new, self.cfg.alpha, self.cap,
                       self.kv_share, decided_at=self.open.at if self.open else limit)
        rest = s.reserve(after, self.layout, start=arrive + 1)
        return terms + rest, max(arrive, _last(rest))

    def _cohort_terms(self, groups: list[tuple[int, int]]) -> tuple[list[Term], float]:
        """The rows as one cohort (they decide together); rows behind the others (replays)
        finish later, so the bound holds until they can."""
        lo, hi = min(v for _, v in groups), max(v for _, v in groups)
        c = self.cohort(sum(rows for rows, _ in groups), hi)
        terms = [Term(t.first, t.last + hi - lo, t.rows, t.fed, t.grows, t.const, t.ceiling)
                 for t in self.cfg.schedule.reserve(c, self.layout)]
        return terms, _last(terms)

    # -- stepping -------------------------------------------------------------------------

    def take(self, group: Group, tokens: np.ndarray, logprobs: np.ndarray | None = None) -> None:
        """Append a step's sampled tokens (and their log-probabilities) to the group's rows;
        only rows that may have finished (EOS drawn, a stop string possible, the last
        token) are looked at one by one."""
        self.extend(group.rows, tokens, logprobs)
        group.last = tokens

    def reward_step(self) -> None:
        """The rewards' part of a step, which never waits: stop the candidates bounds rule
        out, apply scores that are in, draw again or stop (search.draws), open a decision
        when the live candidates meet; when nothing is left, send for the final scores, and
        finish once they are in."""
        self.prune_by_bounds(self._started_live())
        self.close(wait=False)
        self.draws_step()
        self._maybe_decide()
        if self.rows_ended and self.may_finish and self.final is None and self.result is None:
            self.send_final(n0=self.wave_sizes[0] if self.wave_sizes else 0,
                            waves=len(self.wave_sizes))
        self.apply_final(wait=False)

    @property
    def rows_ended(self) -> bool:
        """No candidate will decode again: the prompt needs no cache."""
        return self.open is None and not self.unstarted and \
            not any(c.live for c in self.candidates[: self.started])

    def _started_live(self) -> list[Candidate]:
        return [c for c in self.candidates[: self.started] if c.live]

    def release(self) -> list[tuple[int, list[int]]]:
        """Rows no longer live leave their groups (and evicted rows); the (group id, rows
        kept) of each group that changed, for the scheduler to make the cache follow."""
        changed = []
        for g in list(self.groups):
            keep = [i for i, c in enumerate(g.rows) if c.live]
            if len(keep) == len(g.rows):
                continue
            changed.append((g.gid, keep))
            g.keep(keep)
            if not keep:
                self.groups.remove(g)
        self.evicted = [c for c in self.evicted if c.live]
        return changed

    def _maybe_decide(self) -> None:
        """Open a decision when every live candidate stands at one length that decides (a
        memory-schedule cut may repeat at one length until the survivors fit)."""
        stopping = self.draws is not None and self.draws.stop_at is not None
        while self.open is None and self.cfg.schedule.decides and not self.unstarted and \
                not stopping:
            live = self._started_live()
            lengths = {len(c.tokens) for c in live}
            if len(lengths) != 1:
                return
            length = lengths.pop()
            if length >= self.cfg.max_new_tokens or \
                    not self.cfg.schedule.decide_now(self.cohort(len(live), length), self.layout):
                return
            self.open_decision(length)
            self.close(wait=False)

    def close(self, wait: bool) -> None:
        """Apply the open decision once its scores are in (waiting for them if `wait`); the
        rejected leave the cache at the scheduler's next `release`."""
        self.apply_open(wait)


def _last(terms: list[Term]) -> float:
    return max((t.last for t in terms), default=1)
