"""Combining several rewards into one score per candidate (pure).

Rewards live on different scales, so each is first made comparable across the candidates
being ranked together (one prompt's candidates in play): standardized (z-score) or turned
into ranks. A single reward is passed through unchanged, so its scores stay readable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

METHODS = ("zscore", "rank")


def zscores(values: Sequence[float]) -> list[float]:
    """(x - mean) / std over the set; all zeros when the values do not vary."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    return [0.0] * n if std == 0 else [(v - mean) / std for v in values]


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks scaled to [0, 1] (1 = highest); ties share their average rank."""
    n = len(values)
    if n == 1:
        return [1.0]
    order = sorted(range(n), key=lambda i: values[i])
    out = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = ((i + j) / 2) / (n - 1)
        i = j + 1
    return out


def combine(rows: Sequence[Sequence[float]], weights: Sequence[float], method: str) -> list[float]:
    """One score per row from per-reward scores; rows[i][r] is reward r's score of candidate i."""
    if method not in METHODS:
        raise ValueError(f"unknown combination {method!r}; use one of {METHODS}")
    if not rows:
        return []
    if any(len(r) != len(weights) for r in rows):
        raise ValueError("every row needs one score per weight")
    if len(weights) == 1:
        return [float(r[0]) for r in rows]
    transform = zscores if method == "zscore" else ranks
    columns = [transform([r[k] for r in rows]) for k in range(len(weights))]
    total = sum(weights)
    return [sum(w * col[i] for w, col in zip(weights, columns, strict=True)) / total
            for i in range(len(rows))]
