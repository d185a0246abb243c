"""What a prompt asks of an engine, whatever the backend: its task, the search settings and a
prompt's own choice of them, and how its responses are scored."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specrej_ray.search.bounds import Keep

# Tokens live rows may decode past an open decision while its scores are out (default of
# cluster.overlap_max_tokens): enough to hide a reward pass that takes a few decode steps.
OVERLAP_TOKENS = 16

# Scores one prompt's responses (partial or complete): a row per response, a score per
# reward of the RewardSet, in order. The job's scorers also take `rewards=(j, ...)`: only
# those rewards, when the engine scores the others itself (RewardSet.free); and
# `tracking=Tracking(...)`: whose responses they are (rewards that keep a cache per candidate).
ScoreFn = Callable[..., list[list[float]]]


class Answer(Protocol):
    def done(self) -> bool: ...  # the rows are in: result() will not wait

    def result(self) -> list[list[float]]: ...


SubmitFn = Callable[..., Answer]  # as ScoreFn, answered later


class LocalScores(Protocol):
    """The rewards of one task that its engine scores in its own process: cheap Python checks
    of the text (reward.instructions), so a decision asks nothing of the reward actors for
    them and bounds can be asked for every few tokens."""

    rewards: tuple[int, ...]  # which rewards of the RewardSet it scores, in its rows' order

    def score(self, texts: list[str]) -> list[list[float]]:
        """A row per text: each of its rewards' score."""
        ...

    def details(self, text: str) -> dict[str, list[dict]]:
        """What each reward keeps of a final response (by reward name)."""
        ...

    def bounds(self, texts: list[str], keys: list[int]) -> list[list[tuple[float, float]]]:
        """A row per text: each reward's (lo, hi), holding for every final response that
        starts with the text. `keys` name whose texts they are (candidate indices): a key's
        text only grows from one call to the next, so what it settled may be kept."""
        ...


@dataclass(frozen=True)
class DrawPlan:
    """A per-prompt budget (engine.draws): draws of `wave` candidates, at most `max_n` in
    all, until `met` says the prompt's finished candidates (their final component scores
    set) are what the job's outputs keep (monotone: checked as they finish), or, for a
    reward without a ceiling, until `enough` says so when a draw has ended."""

    max_n: int
    wave: int
    met: Callable[[Sequence], bool] = lambda finished: False
    enough: Callable[[Sequence], bool] | None = None


@dataclass(frozen=True)
class SearchParams:
    n: int | None  # candidates per prompt; None: as many as the KV budget holds (n: auto)
    alpha: float  # 0 = Best-of-N
    decision_tokens: tuple[int, ...] | None  # None = memory schedule
    min_decision_tokens: int
    budget_tokens: int  # KV budget, in token slots
    seed: int
    overlap_tokens: int = OVERLAP_TOKENS
    # Ask the rewards for bounds every this many generated tokens and stop the candidates
    # that can no longer be in what the job keeps (`keep`); 0: never.
    bounds_every: int = 0
    keep: Keep = field(default_factory=Keep)
    draws: DrawPlan | None = None  # None: every prompt draws n
    branch: bool = False  # a decision's freed rows go to children of its survivors


@dataclass(frozen=True)
class Choice:
    """A prompt's own alpha and decision lengths, over the engine's (schedule: auto picks
    them after calibration; alpha 0 is Best-of-N)."""

    alpha: float
    decision_tokens: tuple[int, ...] | None
    # False: every candidate runs to its end, bounds or not (calibration data, an audit's
    # shadow Best-of-N: their worst candidates are part of what they measure).
    bounds: bool = True


@dataclass(frozen=True)
class EngineTask:
    """One prompt for Engine.run: its id, token ids and the scorer of its responses.

    With `submit`, decisions and final scores send their texts there and the engine polls
    the answers; while a decision's are out its live rows decode on (at most
    `overlap_tokens`, with `overlap`) or wait at the decision (without), and every other
    prompt decodes on. Without it, `score` is called where the scores are needed, and
    answers at once.
    """

    prompt_id: str
    input_ids: list[int]
    score: ScoreFn
    submit: SubmitFn | None = None
    # input_ids are what a reward on the generator's own likelihood conditions on (the
    # engine then scores that reward itself, see RewardSet.free).
    self_scored: bool = False
    choice: Choice | None = None  # None: the engine's own search settings
    # Draw the samples of the prompt with this id (a shadow audit task draws its prompt's,
    # so its candidates are the real task's, by candidate identity); None: its own.
    samples_of: str | None = None
    local: LocalScores | None = None  # its rewards scored here (RewardSet.local)
    overlap: bool = True  # with `submit`: live rows decode on past an open decision

    @property
    def overlaps(self) -> bool:
        """Whether live rows decode on while a decision's scores are out."""
        return self.submit is not None and self.overlap
