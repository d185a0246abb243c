"""Which survivors of a decision the freed rows branch from (pure): search.branch.

A decision that rejects r live candidates frees r rows; with branching they go to r children
of the survivors, each continuing its parent's text from the decision's length on a random
stream of its own. The parents are drawn by **systematic resampling in proportion to rank**:
the eligible survivors ranked by partial score (best first, ties by index), survivor i of m
weighing m - i. Rank rather than score, because rewards live on every scale (a likelihood's
differences are tiny, z-scores are not comparable across prompts) and a rank weighting is the
same for all; proportional rather than all to the top, because children of one parent share
its prefix and narrow what the prompt's candidates say (TreeBoN samples by score for the same
reason); systematic, because r children get each survivor's share up to one, with one uniform.
The uniform comes from (seed, prompt, round), so the choice is the same whatever shares the
batch.

Survivors whose score's upper bound cannot reach the best lower bound in the prompt are not
eligible (a bounded reward): a child of one could never be the answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def rank_weights(m: int) -> list[float]:
    """Weight of the i-th ranked of m: m - i, normalised."""
    total = m * (m + 1) / 2
    return [(m - i) / total for i in range(m)]


def systematic(weights: Sequence[float], draws: int, u: float) -> list[int]:
    """`draws` indices into `weights` by systematic resampling with offset u in [0, 1): index
    i is drawn floor or ceil of draws x weights[i] times."""
    if draws <= 0 or not weights:
        return []
    picks, edge, i = [], weights[0], 0
    for j in range(draws):
        point = (u + j) / draws
        while point >= edge and i < len(weights) - 1:
            i += 1
            edge += weights[i]
        picks.append(i)
    return picks


def choose_parents(scores: Sequence[float], indices: Sequence[int], children: int,
                   u: float, eligible: Sequence[bool] | None = None) -> list[int]:
    """The parents (candidate indices, one per child) of `children` children among survivors
    with these partial scores and candidate indices; `eligible` says which may be parents
    (bounds). Best-ranked parents come first. None eligible: no children."""
    ranked = sorted((i for i in range(len(scores)) if eligible is None or eligible[i]),
                    key=lambda i: (-scores[i], indices[i]))
    return [indices[ranked[k]] for k in systematic(rank_weights(len(ranked)), children, u)] \
        if ranked else []


def branch_uniform(seed: int, prompt_key: int, round_: int) -> float:
    """A uniform in [0, 1) that is a pure function of the seed, the prompt and the round."""
    digest = hashlib.blake2b(f"{seed}:{prompt_key}:{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def may_reach(hi: float, best_lo: float) -> bool:
    """Whether a prefix whose score's upper bound is `hi` can still reach the best's floor."""
    return hi >= best_lo
