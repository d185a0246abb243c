"""Candidate identity, checked: a run's candidate k is the same sample as Best-of-N's candidate
k on the same prompt, whatever shared their batches, so SBoN's finished candidates equal
Best-of-N's and its rejected ones are their prefixes. The bench checks its arms with it, the
audit its shadow runs (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specrej_ray.engine.sequence import PromptResult


@dataclass(frozen=True)
class Identity:
    """A run against Best-of-N at the same N, candidate by candidate."""

    finished_equal: int  # finished candidates whose tokens are Best-of-N's
    rejected_prefix: int  # rejected or pruned candidates that are a prefix of Best-of-N's
    mismatches: int  # neither
    first_mismatch: str | None  # "prompt/candidate" of the first, to look at

    @property
    def holds(self) -> bool:
        return self.mismatches == 0


def compare(run: PromptResult, bon: PromptResult) -> Identity:
    """One prompt's candidates against Best-of-N's on the same prompt."""
    equal = prefix = bad = 0
    first = None
    for c in run.candidates:
        theirs = bon.candidates[c.index].tokens if c.index < len(bon.candidates) else []
        if c.finished and c.tokens == theirs:
            equal += 1
        elif (c.rejected or c.pruned) and theirs[: len(c.tokens)] == c.tokens:
            prefix += 1
        else:
            bad += 1
            first = first or f"{run.prompt_id}/{c.index}"
    return Identity(equal, prefix, bad, first)


def identity(run: Sequence[PromptResult], bon: Sequence[PromptResult]) -> Identity:
    """Every prompt of `run` against Best-of-N's result with the same prompt id."""
    bon_by_id = {r.prompt_id: r for r in bon}
    parts = [compare(r, bon_by_id[r.prompt_id]) for r in run]
    return Identity(sum(p.finished_equal for p in parts), sum(p.rejected_prefix for p in parts),
                    sum(p.mismatches for p in parts),
                    next((p.first_mismatch for p in parts if p.first_mismatch), None))
