"""Lossless pruning from score bounds (pure): which live candidates can no longer reach what
the job keeps.

A reward with bounds gives each candidate an interval [lo, hi] that its final score lies in,
whatever it generates next (a finished candidate's interval is its score). Candidate d
surely ranks above c when d's floor is above c's ceiling, or equal to it and d has the lower
index: the tie-break of every pick (rejection.best_index, the formats' ranking). A live
candidate may stop when enough others surely rank above it:

- one, for the best response (best.parquet, the SFT files, a preference pair's chosen side);
- `top` for the top-k file, each surely kept by the output filters (`drop_truncated`:
  finished short of the length limit; `min_reward`: a floor at or above it) and, where
  identical texts are deduplicated, surely different from one another (their known texts
  already differ).

The candidates that make stopping another safe are its witnesses. The paper's rule must not
reject a witness later (it ranks partial scores, not bounds), or the pruned candidate would
lose the very candidates that rank above it; a witness that bounds prune in turn has
witnesses of its own that rank above it, so the chain ends in finished candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Keep:
    """What the job keeps of a prompt's candidates: the best `top` (after the filters)."""

    top: int = 1
    drop_truncated: bool = False
    min_reward: float | None = None
    dedupe: bool = True

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError(f"top must be >= 1, got {self.top}")


@dataclass(frozen=True)
class Standing:
    """A candidate still in play, as the pruning rule sees it. `text` is its final text when
    finished, else a prefix every final text of it starts with."""

    index: int
    lo: float
    hi: float
    finished: bool = False
    truncated: bool = False  # finished at the length limit
    text: str = ""

    def __post_init__(self) -> None:
        if not self.lo <= self.hi:
            raise ValueError(f"candidate {self.index}: bounds [{self.lo}, {self.hi}] are empty")


@dataclass(frozen=True)
class Pruning:
    pruned: tuple[int, ...]  # candidate indices that may stop now
    witnesses: tuple[int, ...]  # candidate indices the paper's rule must keep from now on


def above(d: Standing, c: Standing) -> bool:
    """Whether d ranks above c whatever either generates next."""
    return d.lo > c.hi or (d.lo == c.hi and d.index < c.index)


def surely_kept(d: Standing, keep: Keep) -> bool:
    """Whether the output filters keep d whatever it generates next."""
    if keep.drop_truncated and not (d.finished and not d.truncated):
        return False
    return keep.min_reward is None or d.lo >= keep.min_reward


def may_equal(x: Standing, y: Standing) -> bool:
    """Whether x and y may end with the same text (deduplication would keep one)."""
    if x.finished and y.finished:
        return x.text == y.text
    if x.finished or y.finished:
        done, going = (x, y) if x.finished else (y, x)
        return done.text.startswith(going.text)
    return x.text.startswith(y.text) or y.text.startswith(x.text)


def prune(cands: Sequence[Standing], keep: Keep) -> Pruning:
    """The live candidates that can no longer be in what the job keeps, and their witnesses."""
    order = sorted(cands, key=lambda s: (-s.lo, s.index))  # every "above c" set is a prefix
    kept = [s for s in order if surely_kept(s, keep)]
    pruned, witnesses = [], set()
    for c in cands:
        if c.finished:
            continue
        best = _witnesses(order, c, 1, dedupe=False)
        if not best:
            continue
        filtered_out = keep.min_reward is not None and c.hi < keep.min_reward
        top = [] if filtered_out else _witnesses(kept, c, keep.top, keep.dedupe)
        if filtered_out or len(top) == keep.top:
            pruned.append(c.index)
            witnesses.update(w.index for w in best + top)
    return Pruning(tuple(pruned), tuple(sorted(witnesses - set(pruned))))


def _witnesses(order: list[Standing], c: Standing, count: int, dedupe: bool) -> list[Standing]:
    """Up to `count` candidates of `order` that rank above c, pairwise different if `dedupe`
    (greedy from the strongest: fewer may be found than exist, never a wrong one)."""
    found: list[Standing] = []
    for d in order:
        if not above(d, c) and d.index != c.index:
            break
        if d.index == c.index or (dedupe and any(may_equal(d, w) for w in found)):
            continue
        found.append(d)
        if len(found) == count:
            break
    return found
