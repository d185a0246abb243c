"""Counterfactual analysis (paper section 6.2): replay SBoN on pre-generated Best-of-N candidates.

Each prompt's N candidates are generated once in full (alpha 0). For a setting (alpha and a
tokens schedule [t1, t2, ...]) we replay what the engine would decide on those very candidates:
with candidate identity, SBoN's candidates are BoN's cut short, so the tokens SBoN would spend
and the response it would return follow from the lengths and the scores alone. The replay
assumes one wave (n0 = N) and calls `rejection.decide`, the rule the engine applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specrej_ray.search.metrics import mean_or_nan, normalized_score, token_rate
from specrej_ray.search.rejection import best_index, decide
from specrej_ray.search.schedule import TokensSchedule


@dataclass(frozen=True)
class PromptCandidates:
    """One prompt's N complete candidates.

    lengths[k]: generated tokens of candidate k (it finished there: EOS, stop or max length).
    final[k]: its final score. partial[t][k]: its score at generated length t, for every
    decision length t a schedule may use; ignored where lengths[k] <= t (finished by then, so
    the replay ranks it with its final score, as the engine does).
    """

    lengths: tuple[int, ...]
    final: tuple[float, ...]
    partial: Mapping[int, Sequence[float]]

    def __post_init__(self) -> None:
        n = len(self.lengths)
        if n == 0:
            raise ValueError("a prompt needs at least one candidate")
        if len(self.final) != n:
            raise ValueError(f"{n} lengths but {len(self.final)} final scores")
        if any(length < 1 for length in self.lengths):
            raise ValueError(f"candidate lengths must be >= 1, got {self.lengths}")
        for t, scores in self.partial.items():
            if len(scores) != n:
                raise ValueError(f"{n} candidates but {len(scores)} partial scores at t={t}")


@dataclass(frozen=True)
class Replay:
    """What SBoN would have done on one prompt's candidates."""

    sbon_tokens: int  # rejected candidates count their length at rejection
    bon_tokens: int  # every candidate in full
    rejected: dict[int, int]  # candidate -> decision length that stopped it
    best: int  # the candidate SBoN returns (highest final score among survivors)
    best_score: float  # its final score
    score: float  # normalized score of that candidate vs Best-of-N (eq. 6)


def replay(p: PromptCandidates, alpha: float, schedule: Sequence[int]) -> Replay:
    """Replay SBoN with rejection rate `alpha` deciding at the generated lengths `schedule`.

    As in the engine, a decision at t is held only when some candidate in play is still live
    after t tokens; finished candidates are ranked with the live ones and never rejected.
    An empty schedule (or alpha 0) decides nothing: that is Best-of-N.
    """
    if schedule:
        TokensSchedule(schedule)  # same validation as a live run's schedule
    rejected: dict[int, int] = {}
    for t in schedule if alpha > 0 else ():
        in_play = [k for k in range(len(p.lengths)) if k not in rejected]
        finished = [p.lengths[k] <= t for k in in_play]
        if all(finished):
            continue
        scores = _scores_at(p, t, in_play)
        for i in decide(scores, finished, alpha).rejected:
            rejected[in_play[i]] = t
    spent = sum(min(n, rejected.get(k, n)) for k, n in enumerate(p.lengths))
    best = best_index(p.final, [k not in rejected for k in range(len(p.lengths))])
    assert best is not None  # decide always keeps at least one candidate
    return Replay(spent, sum(p.lengths), rejected, best, p.final[best],
                  normalized_score(p.final, p.final[best]))


def _scores_at(p: PromptCandidates, t: int, in_play: list[int]) -> list[float]:
    if t not in p.partial:
        raise ValueError(f"no partial scores at decision length {t}; scored: {sorted(p.partial)}")
    return [p.final[k] if p.lengths[k] <= t else float(p.partial[t][k]) for k in in_play]


@dataclass(frozen=True)
class SettingResult:
    """One (alpha, schedule) over all prompts."""

    alpha: float
    schedule: tuple[int, ...]
    token_rate: float  # sum of SBoN tokens / sum of BoN tokens over the prompts
    mean_score: float  # mean over prompts of the normalized score
    min_score: float
    scores: tuple[float, ...]  # per prompt
    sbon_tokens: int
    bon_tokens: int


def evaluate(prompts: Sequence[PromptCandidates], alpha: float,
             schedule: Sequence[int]) -> SettingResult:
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    runs = [replay(p, alpha, schedule) for p in prompts]
    scores = tuple(r.score for r in runs)
    sbon, bon = sum(r.sbon_tokens for r in runs), sum(r.bon_tokens for r in runs)
    return SettingResult(alpha, tuple(schedule), token_rate(sbon, bon), mean_or_nan(scores),
                         min(scores), scores, sbon, bon)
