"""A prompt's requests to its rewards: sent at a decision, checked when the answer is in.

A scorer is a plain function (texts -> a row of scores per text, one score per reward),
answered at once, where it is called; or a submit function whose answer arrives later (reward
actors, or a plain function on the process's scoring thread: `later`). The engine never waits
for an answer that is out: it polls it (`Answer.done`) between steps while every prompt that
does not wait on it decodes on, and waits only when no row can move.
"""

from __future__ import annotations

import inspect
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from specrej_ray.engine.sequence import Candidate
from specrej_ray.engine.task import Answer, ScoreFn, SubmitFn
from specrej_ray.search.combine import combine


@dataclass(frozen=True)
class Tracking:
    """Whose responses a request holds, for rewards that keep each candidate's cache between
    decisions (reward.incremental): the candidates' indices, their token ids (None where the
    text is not simply those tokens, e.g. cut at a stop string), and whether this is the
    prompt's last request (its caches can go)."""

    keys: list[int]
    ids: list[list[int] | None]
    last: bool = False

    def subset(self, picked: list[int]) -> Tracking:
        return Tracking([self.keys[i] for i in picked], [self.ids[i] for i in picked],
                        self.last)




@dataclass(frozen=True)
class RewardSet:
    """The rewards a ScoreFn returns, and how their scores combine into one."""

    names: tuple[str, ...] = ("reward",)
    weights: tuple[float, ...] = (1.0,)
    method: str = "zscore"  # see search.combine
    # Per reward: the generator's own likelihood, which the engine scores from the
    # log-probabilities its decode loop computes (job.self_likelihood); empty: none.
    free: tuple[bool, ...] = ()
    # Per reward: scored in the engine's process by each task's LocalScores; empty: none.
    local: tuple[bool, ...] = ()

    @property
    def any_free(self) -> bool:
        return any(self.free)

    @property
    def bounded(self) -> bool:
        """Whether bounds on a candidate's reward bound its rank: a single reward scored in
        the engine. (Ensembles rank z-scores or ranks over the candidates ranked together, so
        one candidate's standing moves with the others': no bound holds.)"""
        return len(self.names) == 1 and bool(self.local) and self.local[0]

    def combine(self, rows: list[list[float]]) -> list[float]:
        return combine(rows, self.weights, self.method)


class ScoreError(Exception):
    """A reward returned something that cannot be ranked (NaN, inf, wrong count)."""


@dataclass
class Answered:
    """An answer that is already in."""

    rows: list[list[float]]

    def done(self) -> bool:
        return True

    def result(self) -> list[list[float]]:
        return self.rows


class Merged:
    """Scores computed here for some (text, reward) pairs, the rest from an answer that may
    still be out: `asked` the texts sent, `rewards` the rewards asked for (None: all)."""

    def __init__(self, local: list[list[float | None]], answer: Answer, asked: list[int],
                 rewards: tuple[int, ...] | None) -> None:
        self.local, self.answer, self.asked, self.rewards = local, answer, asked, rewards

    def done(self) -> bool:
        return self.answer.done()

    def result(self) -> list[list[float]]:
        rows = [list(row) for row in self.local]
        got = self.answer.result()
        if len(got) != len(self.asked):
            return got  # Scorer.receive reports the wrong count
        for i, row in zip(self.asked, got, strict=True):
            for j, value in zip(self.rewards or range(len(rows[i])), row, strict=True):
                rows[i][j] = value
        return rows


class Later:
    """A plain score function's answer, computed on the scoring thread."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> list[list[float]]:
        return self._future.result()


class ScoringThread:
    """One daemon thread that runs plain score functions in the order they are sent (a
    daemon: a reward that never returns does not keep the process from exiting)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked worker has no thread

    def _reset(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable, *args, **kwargs) -> Later:
        future: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, args=(self._calls,),
                                                name="specrej-scoring", daemon=True)
                self._thread.start()
            self._calls.put((future, fn, args, kwargs))
        return Later(future)

    @staticmethod
    def _work(calls: queue.SimpleQueue) -> None:
        while True:
            future, fn, args, kwargs = calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # the engine raises it where it reads the answer
                future.set_exception(e)


SCORING = ScoringThread()


def later(score: ScoreFn) -> SubmitFn:
    """A plain score function as a submit function: each call runs on the scoring thread
    and its answer is polled, so a slow reward in this process never stops the batch."""
    tracks = _accepts(score, "tracking")

    def submit(texts: list[str], rewards=None, tracking=None) -> Answer:
        kwargs: dict = {} if rewards is None else {"rewards": rewards}
        if tracks and tracking is not None:
            kwargs["tracking"] = tracking
        return SCORING.call(score, texts, **kwargs)

    return submit


class Scorer:
    def __init__(self, prompt_id: str, names: tuple[str, ...], score: ScoreFn,
                 submit: SubmitFn | None = None) -> None:
        self.prompt_id = prompt_id
        self.names = names
        self._score = score
        self._submit = submit
        # Only the job's scorers know whose responses they score (plain functions do not).
        self.tracks = _accepts(submit or score, "tracking")
        self.seconds = 0.0  # time the engine stood still waiting for this prompt's scores

    def send(self, texts: list[str], local: list[list[float | None]] | None = None,
             tracking: Tracking | None = None) -> Answer:
        """Scores of `texts`, a row per text; `local` gives what is known here already (None
        where a reward must score it): only the rest is asked for."""
        if not texts:
            return Answered([])
        if local is None:
            return self._ask(texts, None, tracking)
        asked = [i for i, row in enumerate(local) if any(v is None for v in row)]
        if not asked:
            return Answered(local)  # nothing left to ask: no reward pass at all
        needed = tuple(j for j in range(len(self.names))
                       if any(local[i][j] is None for i in asked))
        rewards = None if len(needed) == len(self.names) else needed
        part = tracking.subset(asked) if tracking is not None else None
        return Merged(local, self._ask([texts[i] for i in asked], rewards, part), asked, rewards)

    def _ask(self, texts: list[str], rewards: tuple[int, ...] | None,
             tracking: Tracking | None) -> Answer:
        # A subset of the rewards is asked for only when some are scored here, which the
        # job's scorers support (score(texts, rewards=...)).
        kwargs: dict = {} if rewards is None else {"rewards": rewards}
        if self.tracks and tracking is not None:
            kwargs["tracking"] = tracking
        if self._submit is not None:
            return self._submit(texts, **kwargs)
        t0 = time.perf_counter()
        rows = self._score(texts, **kwargs)
        self.seconds += time.perf_counter() - t0
        return Answered(rows)

    def receive(self, answer: Answer, cands: list[Candidate]) -> list[list[float]]:
        """The answer's rows (waiting for them if need be), checked against `cands`."""
        t0 = time.perf_counter()
        rows = [[float(s) for s in row] for row in answer.result()]
        self.seconds += time.perf_counter() - t0
        if len(rows) != len(cands) or any(len(r) != len(self.names) for r in rows):
            raise ScoreError(
                f"rewards {', '.join(self.names)} returned {len(rows)} score rows for "
                f"{len(cands)} responses of prompt {self.prompt_id!r}"
            )
        for c, row in zip(cands, rows, strict=True):
            for name, s in zip(self.names, row, strict=True):
                if not math.isfinite(s):
                    raise ScoreError(
                        f"reward {name} gave {s} for prompt {self.prompt_id!r} "
                        f"candidate {c.index}; a reward must return finite numbers"
                    )
        return rows

    def now(self, texts: list[str], cands: list[Candidate],
            local: list[list[float | None]] | None = None,
            tracking: Tracking | None = None) -> list[list[float]]:
        return self.receive(self.send(texts, local, tracking), cands)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: plain texts only
        return False


@dataclass
class FinalScores:
    """A prompt's final scores, out: its finished candidates not scored yet."""

    todo: list[Candidate]
    answer: Answer
    n0: int
    waves: int


@dataclass
class OpenDecision:
    """A decision whose scores are still out. The live candidates keep decoding meanwhile;
    those it rejects are cut back to `at` tokens when it closes."""

    round: int
    at: int  # generated tokens of the live candidates when it was taken
    in_play: list[Candidate]
    finished: list[bool]  # per in_play candidate, as it was then
    unscored: list[Candidate]  # finished ones sent for their final scores
    live: list[Candidate]
    answer: Answer
