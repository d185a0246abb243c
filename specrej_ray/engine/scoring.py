"""A prompt's requests to its rewards: sent at a decision, checked when the answer is in.

A scorer is a plain function (texts -> a row of scores per text, one score per reward),
answered at once; or a submit function whose answer arrives later (reward actors), so
the engine can go on decoding while the rewards work.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specrej_ray.engine.sequence import Candidate
from specrej_ray.search.combine import combine

# Scores one prompt's responses (partial or complete): a row per response, a score per
# reward of the RewardSet, in order.
ScoreFn = Callable[[list[str]], list[list[float]]]


class Answer(Protocol):
    def done(self) -> bool: ...  # the rows are in: result() will not wait

    def result(self) -> list[list[float]]: ...


SubmitFn = Callable[[list[str]], Answer]


@dataclass(frozen=True)
class RewardSet:
    """The rewards a ScoreFn returns, and how their scores combine into one."""

    names: tuple[str, ...] = ("reward",)
    weights: tuple[float, ...] = (1.0,)
    method: str = "zscore"  # see search.combine

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


class Scorer:
    def __init__(self, prompt_id: str, names: tuple[str, ...], score: ScoreFn,
                 submit: SubmitFn | None = None) -> None:
        self.prompt_id = prompt_id
        self.names = names
        self._score = score
        self._submit = submit
        self.seconds = 0.0  # time decoding stood still waiting for scores

    def send(self, texts: list[str]) -> Answer:
        if not texts:
            return Answered([])
        if self._submit is not None:
            return self._submit(texts)
        t0 = time.perf_counter()
        rows = self._score(texts)
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

    def now(self, texts: list[str], cands: list[Candidate]) -> list[list[float]]:
        return self.receive(self.send(texts), cands)


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
