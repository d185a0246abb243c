"""search.draws for a job: when a prompt's finished candidates are what its outputs keep
(engine.draws stops drawing there), judged by the very selection the training files make
(data.formats), so the stop and the files agree."""

from __future__ import annotations

from collections.abc import Sequence

from specrej_ray.data.formats import filter_candidates, pairs, ranked
from specrej_ray.engine.sequence import Candidate
from specrej_ray.engine.task import DrawPlan
from specrej_ray.spec import JobSpec

# reward.type instructions: the share of a row's instructions followed; all of them is 1.0.
INSTRUCTIONS_CEILING = 1.0


def draw_plan(spec: JobSpec) -> DrawPlan | None:
    d = spec.search.draws
    if d is None:
        return None
    name, ceiling, output = spec.reward[0].label, INSTRUCTIONS_CEILING, spec.output

    def met(finished: Sequence[Candidate]) -> bool:
        rows = [{"candidate": c.index, "status": "finished", "final_score": c.components[name],
                 "finish_reason": c.finish_reason, "text": c.text} for c in finished]
        kept, _ = filter_candidates(rows, output.filters)
        if not kept or ranked(kept)[0]["final_score"] < ceiling:
            return False
        if "top_k" in output.formats and len(kept) < output.top_k:
            return False
        if "preference" in output.formats:
            margin = output.filters.min_margin
            found = pairs(kept, output.pairs, output.pairs_k)
            return any(margin is None or a["final_score"] - b["final_score"] >= margin
                       for a, b in found)
        return True

    return DrawPlan(max_n=d.max_n, wave=d.wave or spec.search.n, met=met)
