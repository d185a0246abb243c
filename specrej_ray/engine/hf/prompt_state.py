"""One prompt's speculative rejection as a state machine the scheduler steps.

A prompt's N candidates enter the cache in groups, as memory allows (the first group's size is
its n0). Each step, every group below the prompt's current limit decodes one token: the limit is
the next decision length (where all live candidates meet, so one cut-off ranks them all), or
`cap` tokens past an open decision whose scores are out, or max_new_tokens. Rows that reach the
limit wait there. When every live candidate stands at a decision length, the prompt opens a
decision; when its scores are in, the rejected candidates are cut back to the decision length
and leave the cache. Nothing here depends on what else shares the batch, so a prompt's result
is the same alone or mixed with others (candidate identity).

Rows evicted from the cache (to let another group of the prompt reach a decision, to break a
stall, or after an out-of-memory error) keep their tokens and come back by replaying them:
their cache is rebuilt by feeding the known tokens, one decode step each, without sampling.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specrej_ray.engine.hf.kv_cache import KVCache
from specrej_ray.engine.hf.sampling import prompt_key
from specrej_ray.engine.hf.scoring import (
    OpenDecision,
    RewardSet,
    ScoreFn,
    Scorer,
    SubmitFn,
    Tracking,
)
from specrej_ray.engine.hf.stopping import StopChecker
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.search.rejection import best_index, decide, keep_count
from specrej_ray.search.reservation import FOREVER, Term, growth_terms
from specrej_ray.search.schedule import Cohort, Layout, Schedule


@dataclass(frozen=True)
class PromptConfig:
    """The engine settings a prompt works with (one per run, shared by its prompts)."""

    n: int | None  # None: `search.n: auto`, as many as the device budget holds
    alpha: float
    schedule: Schedule
    max_new_tokens: int
    overlap_tokens: int  # decoding allowed past an open decision (asynchronous scores)
    rewards: RewardSet
    stopper: StopChecker
    chunk: int


class Group:
    """Rows of one prompt holding the same generated tokens in the cache, in cache order."""

    def __init__(self, prompt: PromptState, rows: list[Candidate]) -> None:
        self.prompt, self.rows = prompt, rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def prefix(self):
        return self.prompt.prefix

    @property
    def pkey(self) -> int:
        return self.prompt.pkey

    @property
    def fed(self) -> int:
        return self.prompt.kv.fed(self)

    @property
    def length(self) -> int:
        return len(self.rows[0].tokens)

    @property
    def fresh(self) -> bool:
        """No token yet: the first one is sampled from the prompt's own logits."""
        return self.length == 0

    @property
    def replaying(self) -> bool:
        return self.fed + 1 < self.length

    @property
    def samples(self) -> bool:
        """Whether this step samples a token (a replaying row only feeds a known one)."""
        return self.fed + 1 >= self.length

    @property
    def virtual(self) -> int:
        """The length whose timing and memory the group follows (replays included)."""
        return 0 if self.fresh else self.fed + 1

    def feed(self) -> list[int]:
        at = self.fed
        return [c.tokens[at] for c in self.rows]

    def streams(self) -> tuple[list[int], list[int]]:
        return [c.index for c in self.rows], [len(c.tokens) for c in self.rows]


class PromptState:
    def __init__(self, cfg: PromptConfig, prompt_id: str, input_ids: list[int], score: ScoreFn,
                 submit: SubmitFn | None, kv: KVCache, room: int,
                 self_scored: bool = False, samples_of: str | None = None) -> None:
        self.cfg, self.kv = cfg, kv
        self.prompt_id, self.input_ids = prompt_id, input_ids
        self.pkey = prompt_key(samples_of or prompt_id)  # the key of its random streams
        self.prefix = ("prompt", prompt_id, id(self))
        self.layout = Layout(len(input_ids), cfg.chunk)
        self.cap = cfg.overlap_tokens if submit is not None else 0
        n = cfg.n or cfg.schedule.auto_n(room, self.layout, self.cap, cfg.max_new_tokens)
        self.candidates = [Candidate(k) for k in range(n)]
        self.share = cfg.schedule.share(room, n, self.layout, self.cap, cfg.max_new_tokens)
        self.scorer = Scorer(prompt_id, cfg.rewards.names, score, submit)
        # The prompt's ids are what a reward on the generator's likelihood conditions on.
        self.self_scored = self_scored and cfg.rewards.any_free
        self.groups: list[Group] = []
        self.first_logits: torch.Tensor | None = None
        self.started = 0  # candidates that entered the cache at least once
        self.evicted: list[Candidate] = []  # live, started, not in the cache
        self.open: OpenDecision | None = None
        self.decided_at = 0  # the length of the last decision (0: none yet)
        self.rounds = 0
        self.sizes: list[int] = []  # sizes of the fresh groups
        self.discarded = self.replayed = 0
        self.engine_seconds = 0.0
        self.t0: float | None = None
        self.result: PromptResult | None = None

    # -- what the scheduler asks ------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.candidates)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def unstarted(self) -> int:
        return self.n - self.started

    @property
    def done(self) -> bool:
        return self.result is not None

    def resize(self, room: int) -> None:
        """The budget changed (an out-of-memory back-off): so does the share."""
        self.share = self.cfg.schedule.share(room, self.n, self.layout, self.cap,
                                             self.cfg.max_new_tokens)

    def limit(self) -> int:
        """The length rows may decode to now (they wait there)."""
        s, max_new = self.cfg.schedule, self.cfg.max_new_tokens
        if self.open is not None:
            at = self.open.at
            return min(at + self.cap, s.meeting(at, max_new), max_new)
        return s.meeting(self.decided_at, max_new)

    def runnable(self) -> list[Group]:
        """Groups that decode this step: below the limit, or replaying (in lockstep, only
        the rows that are not ahead of the others)."""
        limit = self.limit()
        groups = [g for g in self.groups if g.replaying or g.length < limit]
        if self.cfg.schedule.lockstep(self.decided_at):
            low = min(len(c.tokens) for c in self._live())
            groups = [g for g in groups if g.replaying or g.length == low]
        return groups

    def parked(self) -> list[Group]:
        """Groups waiting at the limit for the rest of the prompt's candidates."""
        limit = self.limit()
        return [g for g in self.groups if g.length >= limit and not g.replaying]

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

    def admit_fresh(self, k: int) -> Group:
        rows = self.candidates[self.started : self.started + k]
        self.started += k
        self.sizes.append(k)
        return self._add(rows)

    def admit_restore(self, rows: list[Candidate]) -> Group:
        keep = {id(c) for c in rows}
        self.evicted = [c for c in self.evicted if id(c) not in keep]
        return self._add(rows)

    def _add(self, rows: list[Candidate]) -> Group:
        if self.t0 is None:
            self.t0 = time.perf_counter()
        group = Group(self, rows)
        self.kv.add_group(group, self.prefix, len(rows))
        self.groups.append(group)
        return group

    def evict(self, groups: Sequence[Group]) -> int:
        """Take these groups out of the cache (their rows keep their tokens and come back
        by replaying them). Returns the rows evicted."""
        for g in groups:
            self.kv.drop_group(g)
            self.groups.remove(g)
            self.evicted += g.rows
        return sum(len(g) for g in groups)

    def drop_prefix(self) -> None:
        self.kv.drop_prefix(self.prefix)
        self.first_logits = None

    # -- reservations ---------------------------------------------------------------------

    def reservation(self, fresh: int = 0, restore: Sequence[list[Candidate]] = ()) -> list[Term]:
        """The KV slots this prompt may hold at each future step, with `fresh` more new rows
        and the `restore` groups back in the cache: the peak over all its remaining phases,
        rows counted until they must end (see search.reservation)."""
        groups = [(len(g), g.virtual) for g in self.groups]
        groups += [(fresh, 0)] if fresh else []
        groups += [(len(r), 1) for r in restore]
        pending = self.behind() - fresh - sum(len(r) for r in restore) > 0
        if not groups:
            held = self.kv.has_prefix(self.prefix)
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
        """(terms, last step) for these (rows, virtual length) groups, nothing pending."""
        s, max_new, limit = self.cfg.schedule, self.cfg.max_new_tokens, self.limit()
        if limit >= max_new:  # no meeting ahead: the rows run to their end
            if not s.decides:  # Best-of-N rows each on their own
                terms = [t for rows, v in groups for t in s.reserve(self._cohort(rows, v),
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
                       self.share, decided_at=self.open.at if self.open else limit)
        rest = s.reserve(after, self.layout, start=arrive + 1)
        return terms + rest, max(arrive, _last(rest))

    def _cohort_terms(self, groups: list[tuple[int, int]]) -> tuple[list[Term], float]:
        """The rows as one cohort (they decide together); rows behind the others (replays)
        finish later, so the bound holds until they can."""
        lo, hi = min(v for _, v in groups), max(v for _, v in groups)
        c = self._cohort(sum(rows for rows, _ in groups), hi)
        terms = [Term(t.first, t.last + hi - lo, t.rows, t.fed, t.grows, t.const, t.ceiling)
                 for t in self.cfg.schedule.reserve(c, self.layout)]
        return terms, _last(terms)

    def _cohort(self, live: int, length: int) -> Cohort:
        return Cohort(live, self._in_play(), length, self.cfg.max_new_tokens, self.cfg.alpha,
                      self.cap, self.share, self.decided_at)

    def _in_play(self) -> int:
        return sum(1 for c in self.candidates if c.rejected_round is None)

    # -- stepping -------------------------------------------------------------------------

    def take(self, group: Group, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """Append a step's sampled tokens (and their log-probabilities) to the group's rows."""
        stop, max_new = self.cfg.stopper, self.cfg.max_new_tokens
        for i, (c, t) in enumerate(zip(group.rows, tokens, strict=True)):
            c.tokens.append(t)
            if logprobs is not None:
                c.logprobs.append(logprobs[i])
            reason = stop.reason(c.tokens) or ("length" if len(c.tokens) >= max_new else None)
            if reason:
                c.finish(reason, stop.text(c.tokens))

    def after_step(self) -> None:
        """Drop finished rows from the cache, apply scores that are in, open a decision when
        the live candidates meet; finish when nothing is left."""
        self._prune()
        self.close(wait=False)
        self._maybe_decide()
        if self.open is None and not self.unstarted and not self._live():
            self.drop_prefix()
            self._finish()

    def _live(self) -> list[Candidate]:
        return [c for c in self.candidates[: self.started] if c.live]

    def _prune(self) -> None:
        for g in list(self.groups):
            keep = [i for i, c in enumerate(g.rows) if c.live]
            if len(keep) == len(g.rows):
                continue
            self.kv.keep_rows(g, keep)
            g.rows = [g.rows[i] for i in keep]
            if not keep:
                self.groups.remove(g)
        self.evicted = [c for c in self.evicted if c.live]

    def _maybe_decide(self) -> None:
        """Open a decision when every live candidate stands at one length that decides (a
        memory-schedule cut may repeat at one length until the survivors fit)."""
        while self.open is None and self.cfg.schedule.decides and not self.unstarted:
            live = self._live()
            lengths = {len(c.tokens) for c in live}
            if len(lengths) != 1:
                return
            length = lengths.pop()
            cohort = Cohort(len(live), self._in_play(), length, self.cfg.max_new_tokens,
                            self.cfg.alpha, self.cap, self.share, self.decided_at)
            if length >= self.cfg.max_new_tokens or \
                    not self.cfg.schedule.decide_now(cohort, self.layout):
                return
            self._open_decision(length)
            self.close(wait=False)

    def _open_decision(self, length: int) -> None:
        """Send everything in play to the rewards (finished ones on their full text)."""
        self.rounds += 1
        self.decided_at = length
        in_play = [c for c in self.candidates if c.rejected_round is None]
        unscored = [c for c in in_play if c.finished and not c.components]
        live = [c for c in in_play if c.live]
        stop = self.cfg.stopper
        texts = [c.text for c in unscored] + [stop.text(c.tokens[:length]) for c in live]
        items = [(c, len(c.tokens)) for c in unscored] + [(c, length) for c in live]
        answer = self.scorer.send(texts, self._local(items), tracking_of(items))
        self.open = OpenDecision(self.rounds, length, in_play, [c.finished for c in in_play],
                                 unscored, live, answer)

    def close(self, wait: bool) -> None:
        """Apply the open decision once its scores are in (waiting for them if `wait`)."""
        d = self.open
        if d is None or not (wait or d.answer.done()):
            return
        self.open = None
        rewards = self.cfg.rewards
        rows = self.scorer.receive(d.answer, d.unscored + d.live)
        for c, row in zip(d.unscored, rows[: len(d.unscored)], strict=True):
            c.components = dict(zip(rewards.names, row, strict=True))
        fresh = iter(rows[len(d.unscored) :])
        ranked = [self._row(c) if was else next(fresh) for c, was in zip(d.in_play, d.finished,
                                                                         strict=True)]
        scores = rewards.combine(ranked)
        for c, was, s in zip(d.in_play, d.finished, scores, strict=True):
            if not was:
                c.partial_scores.append((d.at, s))
        text_of = self.cfg.stopper.text
        for i in self._cut(d, scores):
            self.discarded += d.in_play[i].reject(d.round, d.at, text_of)
        self._prune()

    def _cut(self, d: OpenDecision, scores: list[float]) -> list[int]:
        """Who the decision rejects: alpha's cut over everything in play, and then, if the
        schedule holds fewer live rows, the lowest ranked of the live ones left."""
        rejected = set(decide(scores, d.finished, self.cfg.alpha).rejected)
        live = [i for i, was in enumerate(d.finished) if not was and i not in rejected]
        most = self.cfg.schedule.max_live(self._cohort(len(live), d.at), self.layout)
        if most is not None and len(live) > most:
            live.sort(key=lambda i: (-scores[i], i))
            rejected.update(live[most:])
        return sorted(rejected)

    def _finish(self) -> None:
        """Final scores: the rewards combined over all of the prompt's finished candidates."""
        finished = [c for c in self.candidates if c.finished]
        todo = [c for c in finished if not c.components]
        texts = [c.text for c in todo]
        items = [(c, len(c.tokens)) for c in todo]
        rows = self.scorer.now(texts, todo, self._local(items),
                               tracking_of(items, last=True))
        for c, row in zip(todo, rows, strict=True):
            c.components = dict(zip(self.cfg.rewards.names, row, strict=True))
        combined = self.cfg.rewards.combine([self._row(c) for c in finished])
        for c, s in zip(finished, combined, strict=True):
            c.final_score = s
        best = best_index([c.final_score if c.final_score is not None else float("-inf")
                           for c in self.candidates], [c.finished for c in self.candidates])
        self.result = PromptResult(
            prompt_id=self.prompt_id, candidates=self.candidates, best=best,
            n0=self.sizes[0] if self.sizes else 0, waves=len(self.sizes), rounds=self.rounds,
            prompt_tokens=self.prompt_tokens,
            seconds=time.perf_counter() - (self.t0 or time.perf_counter()),
            score_seconds=self.scorer.seconds, discarded_tokens=self.discarded,
            replayed_tokens=self.replayed, engine_seconds=self.engine_seconds,
        )

    def _row(self, c: Candidate) -> list[float]:
        return [c.components[name] for name in self.cfg.rewards.names]

    def _local(self, items: list[tuple[Candidate, int]]) -> list[list[float | None]] | None:
        """Scores known here: the generator's own likelihood of a response, from the
        log-probabilities decoding computed (free_scores); None where a reward must score it
        (everything, without free rewards)."""
        if not self.self_scored:
            return None
        return free_scores(items, self.cfg.rewards.free)


def free_scores(items: list[tuple[Candidate, int]],
                free: tuple[bool, ...]) -> list[list[float | None]]:
    """Per response (a candidate's first `length` tokens): the free rewards' scores from its
    log-probabilities, None for the other rewards and where there is none (free_likelihood)."""
    rows = []
    for c, length in items:
        value = free_likelihood(c, length)
        rows.append([value if is_free else None for is_free in free])
    return rows


def free_likelihood(c: Candidate, length: int) -> float | None:
    """Mean log-probability of the response's tokens (the EOS that ended it apart): what the
    reward scores for the same tokens, since the job's rewards score a response's sampled ids
    where they share the generator's vocabulary (reward.tracked), and self-likelihood does.
    None where the response is not these tokens (cut at a stop string) or has none (an
    empty response scores the likelihood of ending there: the reward does that)."""
    if len(c.logprobs) < length:
        return None
    tokens = response_tokens(c, length)
    if not tokens:
        return None
    return math.fsum(c.logprobs[: len(tokens)]) / len(tokens)


def tracking_of(items: list[tuple[Candidate, int]], last: bool = False) -> Tracking:
    """Who the responses of a request are: each candidate's index and its response tokens."""
    return Tracking([c.index for c, _ in items], [response_tokens(c, n) for c, n in items], last)


def response_tokens(c: Candidate, length: int) -> list[int] | None:
    """The tokens a response of the candidate's first `length` tokens is: the EOS that ended
    it apart; None after a stop string (the text was cut, it is no longer these tokens)."""
    ended = c.finished and length == len(c.tokens)
    if ended and c.finish_reason == "stop":
        return None
    return c.tokens[: length - 1] if ended and c.finish_reason == "eos" else c.tokens[:length]


def _last(terms: list[Term]) -> float:
    return max((t.last for t in terms), default=1)
