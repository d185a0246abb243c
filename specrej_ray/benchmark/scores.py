"""Per-prompt rewards of an arm and the paired normalized score (paper eq. 5), pure.

Arms are compared on one reward's raw score: the first reward of the spec. With a single
reward that is the final score itself; with several, the combined final score is a z-score
(or rank) within each prompt's candidate set, which means nothing across arms.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from specrej_ray.engine.sequence import PromptResult
from specrej_ray.search.metrics import mean_or_nan, normalized_score


def best_reward(result: PromptResult, reward: str) -> float | None:
    """The chosen candidate's raw score under `reward`; None when no candidate finished."""
    if result.best is None:
        return None
    return result.candidates[result.best].components[reward]


def finished_rewards(result: PromptResult, reward: str) -> list[float]:
    return [c.components[reward] for c in result.candidates if c.finished]


def mean_best_reward(results: Sequence[PromptResult], reward: str) -> float:
    """Mean over prompts of the best candidate's reward (prompts with none are left out)."""
    return mean_or_nan(r for r in (best_reward(x, reward) for x in results) if r is not None)


def paired_normalized_scores(
    sbon: Sequence[PromptResult], bon: Sequence[PromptResult], reward: str
) -> dict[str, float]:
    """Eq. 5 per prompt: SBoN's best against the range of BoN's finished candidates.

    Paired: the same prompt, seed and N, so SBoN's survivors are BoN's candidates cut short.
    A prompt where either arm finished nothing has no score.
    """
    bon_by_id = {r.prompt_id: r for r in bon}
    scores: dict[str, float] = {}
    for s in sbon:
        b = bon_by_id.get(s.prompt_id)
        best = best_reward(s, reward)
        ref = finished_rewards(b, reward) if b is not None else []
        if best is not None and ref:
            scores[s.prompt_id] = normalized_score(ref, best)
    return scores


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and min (NaN when empty), for a column of per-prompt figures."""
    vals = list(values)
    if not vals:
        return {"mean": math.nan, "median": math.nan, "min": math.nan}
    return {"mean": mean_or_nan(vals), "median": statistics.median(vals), "min": min(vals)}
