"""search.draws for a job: when a prompt's finished candidates are what its outputs keep
(engine.draws stops drawing there), judged by the very selection the training files make
(data.formats), so the stop and the files agree; or, for a reward without a ceiling, the
stopping rule on the prompt's own rewards (search.pandora)."""

from __future__ import annotations

from collections.abc import Sequence

from specrej_ray.data.formats import filter_candidates, pairs, ranked
from specrej_ray.engine.sequence import Candidate
from specrej_ray.engine.task import DrawPlan
from specrej_ray.search import pandora
from specrej_ray.search.ceiling import at_ceiling
from specrej_ray.spec import JobSpec


def draw_plan(spec: JobSpec) -> DrawPlan | None:
    d = spec.search.draws
    if d is None:
        return None
    wave = d.wave or spec.search.n
    if d.until == "rule":
        name = spec.reward[0].label
        return DrawPlan(d.max_n, wave, enough=lambda finished: pandora.enough(
            [c.components[name] for c in finished], d.cost))
    return DrawPlan(d.max_n, wave, met=outputs_have(spec))


def outputs_have(spec: JobSpec):
    """met(finished): whether these finished candidates (their components scored) give every
    file of output.formats what it keeps: the SFT files a best at the ceiling (every reward
    at its own) after the filters, `top_k` k responses, `preference` a pair the margin filter
    keeps. Monotone: more finished candidates never take it back. With one reward the files'
    own ranking is its score; with several, one at every ceiling is the best whatever the
    combination (it is the highest in every reward), and the filters need no combined score
    (the spec refuses min_reward and min_margin there)."""
    names = [r.label for r in spec.reward]
    ceilings = [r.reward_ceiling for r in spec.reward]
    output, single = spec.output, len(names) == 1

    def met(finished: Sequence[Candidate]) -> bool:
        top = [at_ceiling([c.components[n] for n in names], ceilings) for c in finished]
        rows = [{"candidate": c.index, "status": "finished", "finish_reason": c.finish_reason,
                 "text": c.text,
                 "final_score": c.components[names[0]] if single else float(hit)}
                for c, hit in zip(finished, top, strict=True)]
        kept, _ = filter_candidates(rows, output.filters)
        best = ranked(kept)[0] if kept else None
        if best is None or not top[[c.index for c in finished].index(best["candidate"])]:
            return False
        if "top_k" in output.formats and len(kept) < output.top_k:
            return False
        if "preference" in output.formats:
            margin = output.filters.min_margin
            return any(margin is None or a["final_score"] - b["final_score"] >= margin
                       for a, b in pairs(kept, output.pairs, output.pairs_k))
        return True

    return met
