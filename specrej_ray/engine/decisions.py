"""A prompt's candidates and its decisions, whatever batch decodes them: the part of the
algorithm every backend shares (the hf engine's PromptState, the vLLM backend's
PromptRequests).

A decision sends every candidate in play to the rewards (live ones cut at its length,
finished ones on their full text); when the scores are in, search.rejection's cut-off over
all of them rejects the lowest, and the rejected are cut back to the decision length (they
may have decoded on while the scores were out). When nothing is live, the finished
candidates' final scores are sent for, and once they are in the best one is picked. Nothing
here waits for an answer unless asked to (`wait`): the backend polls them between steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from specrej_ray.engine.draws import CAP, KEPT, RULE, DrawState, shortest_stop, undo_past
from specrej_ray.engine.sampling import prompt_key
from specrej_ray.engine.scoring import FinalScores, OpenDecision, RewardSet, Scorer, Tracking
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.engine.stopping import StopChecker
from specrej_ray.engine.task import DrawPlan, EngineTask, LocalScores
from specrej_ray.search.bounds import Keep, Standing, prune
from specrej_ray.search.branching import branch_uniform, choose_parents, may_reach
from specrej_ray.search.rejection import best_index, decide
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
    chunk: int  # the KV cache's allocation unit, in tokens (the hf engine's chunk, a block)
    bounds_every: int = 0  # generated tokens between bounds checks (0: none)
    keep: Keep = Keep()  # what the job keeps of a prompt: bounds protect it
    draws: DrawPlan | None = None  # per-prompt budgets (engine.draws); None: n candidates
    branch_seed: int | None = None  # search.branch on: the seed its parents are drawn with


class Decisions:
    """A prompt's candidates, its open decision and its result. `layout` sizes its KV use,
    `cap` the tokens live rows may decode past an open decision, `kv_share` its KV budget."""

    def __init__(self, cfg: PromptConfig, task: EngineTask, n: int, layout: Layout, cap: int,
                 kv_share: int) -> None:
        self.cfg = cfg
        self.prompt_id, self.input_ids = task.prompt_id, task.input_ids
        self.layout, self.cap, self.kv_share = layout, cap, kv_share
        self.candidates = [Candidate(k) for k in range(n)]
        self.scorer = Scorer(task.prompt_id, cfg.rewards.names, task.score, task.submit)
        # The prompt's ids are what a reward on the generator's likelihood conditions on.
        self.self_scored = task.self_scored and cfg.rewards.any_free
        self.local = task.local  # the rewards scored here (RewardSet.local)
        self.bounded = bool(cfg.bounds_every) and cfg.rewards.bounded and task.local is not None
        self.bounds_at = 0  # the longest live candidate's length at the last bounds check
        self.exact: dict[int, float] = {}  # finished candidates' scores, for the bounds
        self.witnesses: set[int] = set()  # candidates the paper's rule must keep (bounds)
        self.bounds_checks, self.bounds_seconds = 0, 0.0
        self.open: OpenDecision | None = None
        self.final: FinalScores | None = None  # the final scores, once sent for
        self.decided_at = 0  # the length of the last decision (0: none yet)
        self.rounds = 0
        self.discarded = self.replayed = 0
        self.engine_seconds = 0.0
        self.t0: float | None = None
        self.result: PromptResult | None = None
        self.draws = DrawState(cfg.draws) if cfg.draws is not None else None

    @property
    def n(self) -> int:
        return len(self.candidates)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def waiting(self) -> bool:
        """Scores are out: an open decision's, finished candidates' (search.draws), or the
        final ones."""
        return self.open is not None or self.final is not None or \
            (self.draws is not None and self.draws.scoring is not None)

    def wait(self) -> None:
        """Block until the scores that are out are in, and apply them."""
        if self.open is not None:
            self.apply_open(wait=True)
        elif self.draws is not None and self.draws.scoring is not None:
            self._apply_finished(wait=True)
        elif self.final is not None:
            self.apply_final(wait=True)

    @property
    def may_finish(self) -> bool:
        """Whether its final scores may be sent for once nothing is live: always, or with
        search.draws once it stopped drawing."""
        return self.draws is None or self.draws.reason is not None

    def limit(self) -> int:
        """The length rows may decode to now (they wait there)."""
        s, max_new = self.cfg.schedule, self.cfg.max_new_tokens
        if self.open is not None:
            at = self.open.at
            limit = min(at + self.cap, s.meeting(at, max_new), max_new)
        else:
            limit = s.meeting(self.decided_at, max_new)
        if self.draws is not None and self.draws.stop_at is not None:
            limit = min(limit, self.draws.stop_at)
        return limit

    def append(self, c: Candidate, token: int, logprob: float | None) -> bool:
        """A candidate's next token (and its log-probability); True when that finished it
        (EOS, a stop string, max_new_tokens)."""
        c.tokens.append(token)
        if logprob is not None:
            c.logprobs.append(logprob)
        return self._ended(c)

    def extend(self, rows: list[Candidate], tokens: np.ndarray,
               logprobs: np.ndarray | None) -> None:
        """One token for each of these rows of one length (and its log-probability), as
        `append` does; only rows that drew an end-of-sequence token (or that a stop string or
        the length may end) are looked at one by one."""
        drawn = tokens.tolist()
        for c, t in zip(rows, drawn, strict=True):
            c.tokens.append(t)
        if logprobs is not None:
            for c, lp in zip(rows, logprobs.tolist(), strict=True):
                c.logprobs.append(lp)
        stop = self.cfg.stopper
        if stop.stop or len(rows[0].tokens) >= self.cfg.max_new_tokens:
            maybe = range(len(rows))
        else:
            # A set lookup a row: an np.isin call was most of a small group's step (issue 30's
            # profile of the host work a step).
            maybe = [i for i, t in enumerate(drawn) if t in stop.eos_ids]
        for i in maybe:
            self._ended(rows[i])

    def _ended(self, c: Candidate) -> bool:
        stop = self.cfg.stopper
        reason = stop.reason(c.tokens) or \
            ("length" if len(c.tokens) >= self.cfg.max_new_tokens else None)
        if reason:
            c.finish(reason, stop.text(c.tokens))
        return reason is not None

    def _live(self) -> list[Candidate]:
        return [c for c in self.candidates if c.live]

    def _draw(self) -> list[Candidate]:
        """The candidates the rule ranks together: all, or with search.draws the current
        draw's."""
        return self.candidates if self.draws is None else self.candidates[self.draws.start:]

    def _in_play(self) -> int:
        return sum(1 for c in self._draw() if c.in_play)

    def cohort(self, live: int, length: int) -> Cohort:
        return Cohort(live, self._in_play(), length, self.cfg.max_new_tokens, self.cfg.alpha,
                      self.cap, self.kv_share, self.decided_at)

    def open_decision(self, length: int) -> None:
        """Send everything in play to the rewards (finished ones on their full text)."""
        self.rounds += 1
        self.decided_at = length
        if self.draws is not None:
            self.draws.decisions.append(length)
        in_play = [c for c in self._draw() if c.in_play]
        unscored = [c for c in in_play if c.finished and not c.components]
        live = [c for c in in_play if c.live]
        stop = self.cfg.stopper
        texts = [c.text for c in unscored] + [stop.text(c.tokens[:length]) for c in live]
        items = [(c, len(c.tokens)) for c in unscored] + [(c, length) for c in live]
        answer = self.scorer.send(texts, self._local(items, texts), tracking_of(items))
        self.open = OpenDecision(self.rounds, length, in_play, [c.finished for c in in_play],
                                 unscored, live, answer)

    def apply_open(self, wait: bool) -> list[Candidate]:
        """Apply the open decision once its scores are in (waiting for them if `wait`);
        the candidates it rejected."""
        d = self.open
        if d is None or not (wait or d.answer.done()):
            return []
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
        # Bounds may have stopped some while the scores were out; one that finished meanwhile
        # is still cut back, as it would have been had the scores come at once.
        rejected = [d.in_play[i] for i in self._cut(d, scores) if not d.in_play[i].pruned]
        for c in rejected:
            self.discarded += c.reject(d.round, d.at, text_of)
        if self.cfg.branch_seed is not None and rejected:
            self._branch(d, scores, len(rejected))
        return rejected

    # -- branching (search.branch) --------------------------------------------------------

    def _branch(self, d: OpenDecision, scores: list[float], freed: int) -> None:
        """The decision freed `freed` rows: as many children of its survivors, parents drawn
        by rank (search.branching), each continuing its parent's first `d.at` tokens on its
        own stream (its own index)."""
        survivors = [(c, s) for c, was, s in zip(d.in_play, d.finished, scores, strict=True)
                     if not was and not c.rejected and not c.pruned]
        if not survivors:
            return
        eligible = self._may_win([c for c, _ in survivors], d.at)
        parents = choose_parents([s for _, s in survivors], [c.index for c, _ in survivors],
                                 freed, branch_uniform(self.cfg.branch_seed,
                                                       prompt_key(self.prompt_id), d.round),
                                 eligible)
        by_index = {c.index: c for c, _ in survivors}
        children = [by_index[i].child(self.n + k, d.at) for k, i in enumerate(parents)]
        self.candidates += children
        self.children_born(children)

    def _may_win(self, survivors: list[Candidate], at: int) -> list[bool] | None:
        """With bounds: which survivors' prefixes can still reach the best's floor (None:
        all may)."""
        if not self.bounded:
            return None
        stop = self.cfg.stopper
        settled = [stop.settled(c.tokens[:at]) for c in survivors]
        bounds = [row[0] for row in self.local.bounds(settled, [c.index for c in survivors])]
        floors = [lo for lo, _ in bounds] + [self.exact.get(c.index, float("-inf"))
                                             for c in self.candidates if c.finished]
        best = max(floors, default=float("-inf"))
        return [may_reach(hi, best) for _, hi in bounds]

    def children_born(self, children: list[Candidate]) -> None:
        """A backend's hook: these children joined the prompt (live, holding their parents'
        prefix tokens)."""

    def children_gone(self, children: list[Candidate]) -> None:
        """A backend's hook: these children left the prompt (stopped, no longer listed)."""

    def _cut(self, d: OpenDecision, scores: list[float]) -> list[int]:
        """Who the decision rejects: alpha's cut over everything in play, and then, if the
        schedule holds fewer live rows, the lowest ranked of the live ones left."""
        rejected = set(decide(scores, d.finished, self.cfg.alpha).rejected)
        rejected -= {i for i, c in enumerate(d.in_play) if c.index in self.witnesses}
        live = [i for i, was in enumerate(d.finished) if not was and i not in rejected]
        most = self.cfg.schedule.max_live(self.cohort(len(live), d.at), self.layout)
        if most is not None and len(live) > most:
            live.sort(key=lambda i: (-scores[i], i))
            rejected.update(live[most:])
        return sorted(rejected)

    def send_final(self, n0: int, waves: int) -> None:
        """Send for the final scores: the finished candidates not scored yet (`apply_final`
        picks the best once they are in)."""
        todo = [c for c in self.candidates if c.finished and not c.components]
        texts = [c.text for c in todo]
        items = [(c, len(c.tokens)) for c in todo]
        answer = self.scorer.send(texts, self._local(items, texts),
                                  tracking_of(items, last=True))
        self.final = FinalScores(todo, answer, n0, waves)

    def apply_final(self, wait: bool) -> bool:
        """Once the final scores are in (waiting for them if `wait`): the rewards combined
        over all of the prompt's finished candidates, the best picked, the result made."""
        f = self.final
        if f is None or not (wait or f.answer.done()):
            return False
        self.final = None
        rows = self.scorer.receive(f.answer, f.todo)
        for c, row in zip(f.todo, rows, strict=True):
            c.components = dict(zip(self.cfg.rewards.names, row, strict=True))
        finished = [c for c in self.candidates if c.finished]
        if self.local is not None:
            for c in finished:
                c.details = self.local.details(c.text)
        combined = self.cfg.rewards.combine([self._row(c) for c in finished])
        for c, s in zip(finished, combined, strict=True):
            c.final_score = s
        best = best_index([c.final_score if c.final_score is not None else float("-inf")
                           for c in self.candidates], [c.finished for c in self.candidates])
        self.result = PromptResult(
            prompt_id=self.prompt_id, candidates=self.candidates, best=best,
            n0=f.n0, waves=f.waves, rounds=self.rounds, prompt_tokens=self.prompt_tokens,
            seconds=time.perf_counter() - (self.t0 or time.perf_counter()),
            score_seconds=self.scorer.seconds, discarded_tokens=self.discarded,
            replayed_tokens=self.replayed, engine_seconds=self.engine_seconds,
            bounds_checks=self.bounds_checks, bounds_seconds=self.bounds_seconds,
            stop_reason=self.draws.reason if self.draws else None,
            draws=self.draws.count if self.draws else None,
            branched=self.cfg.branch_seed is not None,
        )
        return True

    # -- per-prompt budgets (engine.draws) ------------------------------------------------

    def draws_step(self) -> None:
        """With search.draws: score candidates as they finish; once those scored meet the
        need, decode every live one to the longest of them and stop the prompt at the
        shortest length that meets it; when a draw ends short of the need, draw again, or
        stop at the cap. Never waits."""
        d = self.draws
        if d is None or d.reason is not None:
            return
        self._apply_finished(wait=False)
        self._score_finished()
        if d.scoring is not None:
            return
        draw = self._draw()
        if d.stop_at is None and d.plan.met([c for c in self.candidates if c.finished]):
            d.stop_at = max(len(c.tokens) for c in draw if c.finished)
        if d.stop_at is not None:
            if self.open is None and not any(c.live and len(c.tokens) < d.stop_at
                                             for c in draw):
                self._stop_drawing(d)
            return
        if self.open is None and not any(c.live for c in draw):
            drawn = sum(c.parent is None for c in self.candidates)  # children replace rows
            finished = [c for c in self.candidates if c.finished]
            if d.plan.enough is not None and d.plan.enough(finished):
                d.reason = RULE
            elif drawn < d.plan.max_n:
                self._new_draw(d, min(d.plan.wave, d.plan.max_n - drawn))
            else:
                d.reason = CAP

    def _score_finished(self) -> None:
        """Send the final scores of candidates that finished since (a request at a time)."""
        todo = [c for c in self.candidates if c.finished and not c.components]
        if not todo:
            return
        texts = [c.text for c in todo]
        items = [(c, len(c.tokens)) for c in todo]
        self.draws.scoring = (todo, self.scorer.send(texts, self._local(items, texts),
                                                     tracking_of(items)))
        self._apply_finished(wait=False)

    def _apply_finished(self, wait: bool) -> None:
        out = self.draws.scoring
        if out is None or not (wait or out[1].done()):
            return
        self.draws.scoring = None
        todo, answer = out
        for c, row in zip(todo, self.scorer.receive(answer, todo), strict=True):
            c.components = dict(zip(self.cfg.rewards.names, row, strict=True))

    def _stop_drawing(self, d: DrawState) -> None:
        """Stop at L*, undoing what the draw did past it (engine.draws)."""
        draw = self._draw()
        earlier = [c for c in self.candidates[: d.start] if c.finished]
        at = shortest_stop(earlier, draw, d.stop_at, d.plan.met)
        self.discarded += undo_past(draw, at, self.cfg.stopper.text)
        self.rounds -= sum(1 for length in d.decisions if length >= at)
        late = [c for c in draw if c.forked_at is not None and c.forked_at >= at]
        if late:  # children of a decision that no longer counts: they never were
            self.discarded += sum(len(c.tokens) - c.forked_at for c in late)
            del self.candidates[late[0].index:]
            self.children_gone(late)
        d.reason = KEPT

    def _new_draw(self, d: DrawState, k: int) -> None:
        """k more candidates, ranked among themselves from length 0."""
        d.start = self.n
        d.count += 1
        d.decisions = []
        self.candidates += [Candidate(i) for i in range(d.start, d.start + k)]
        self.decided_at = 0

    def _row(self, c: Candidate) -> list[float]:
        return [c.components[name] for name in self.cfg.rewards.names]

    def _local(self, items: list[tuple[Candidate, int]],
               texts: list[str]) -> list[list[float | None]] | None:
        return scores_here(items, texts, self.cfg.rewards, self.self_scored, self.local)

    # -- bounds ---------------------------------------------------------------------------

    def prune_by_bounds(self, live: list[Candidate]) -> list[Candidate]:
        """Every `bounds_every` tokens: stop the live candidates that can no longer be in
        what the job keeps (search.bounds), and keep their witnesses from the paper's rule.
        `live`: the candidates decoding (started ones, where a backend starts them in
        waves). Returns the candidates it stopped."""
        if not self.bounded or not live:
            return []
        longest = max(len(c.tokens) for c in live)
        if longest < self.bounds_at + self.cfg.bounds_every:
            return []
        self.bounds_at = longest
        t0 = time.perf_counter()
        stop = self.cfg.stopper
        settled = [stop.settled(c.tokens) for c in live]
        finished = [c for c in self.candidates if c.finished]
        fresh = [c for c in finished if c.index not in self.exact]
        for c, row in zip(fresh, self.local.score([c.text for c in fresh]) if fresh else [],
                          strict=True):
            self.exact[c.index] = row[0]
        standings = [Standing(c.index, self.exact[c.index], self.exact[c.index], True,
                              c.finish_reason == "length", c.text) for c in finished]
        standings += [Standing(c.index, *row[0], text=text) for c, text, row in
                      zip(live, settled, self.local.bounds(settled, [c.index for c in live]),
                          strict=True)]
        result = prune(standings, self.cfg.keep)
        self.witnesses.update(result.witnesses)
        gone = set(result.pruned)
        pruned = [c for c in live if c.index in gone]
        for c in pruned:
            c.prune(stop.text(c.tokens))
        self.bounds_checks += 1
        self.bounds_seconds += time.perf_counter() - t0
        return pruned


def scores_here(items: list[tuple[Candidate, int]], texts: list[str], rewards: RewardSet,
                self_scored: bool, local: LocalScores | None
                ) -> list[list[float | None]] | None:
    """Per response (a candidate's first `length` tokens, its text): the scores known in this
    process, None where a reward must score it; None for all when nothing is known here.
    Known here: the generator's own likelihood, from the log-probabilities decoding computed
    (free_scores), and the rewards the task scores itself (LocalScores)."""
    rows = free_scores(items, rewards.free) if self_scored else None
    if local is None or not texts:
        return rows
    if rows is None:
        rows = [[None] * len(rewards.names) for _ in items]
    for row, scores in zip(rows, local.score(texts), strict=True):
        for j, value in zip(local.rewards, scores, strict=True):
            row[j] = value
    return rows


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
