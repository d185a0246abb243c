"""`tune`'s options: parsed and checked before any model is loaded, one line per mistake."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from specrej_ray.data.output_place import side_folder
from specrej_ray.quality.calibration import ALPHAS as DEFAULT_ALPHAS
from specrej_ray.quality.calibration import GRID as DEFAULT_GRID


class TuneError(Exception):
    """A user error in tune's options; str() is one line naming the option."""


PROMPTS = 8  # --prompts when generating


@dataclass(frozen=True)
class TuneOptions:
    prompts: int | None = None  # None: PROMPTS, or every prompt of --from
    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    decisions: tuple[int, ...] | None = None  # None: DEFAULT_GRID below max_new_tokens
    target: float = 99.0
    out: str | None = None
    from_json: str | None = None  # an earlier tune.json whose candidates are replayed

    @classmethod
    def parse(cls, prompts: int | None, alphas: str | None, decisions: str | None,
              target: float, out: str | None, from_json: str | None = None) -> TuneOptions:
        if prompts is not None and prompts < 1:
            raise TuneError(f"--prompts: must be at least 1, got {prompts}")
        if not math.isfinite(target):
            raise TuneError(f"--target: must be a number, got {target}; e.g. --target 99")
        return cls(prompts, parse_alphas(alphas) if alphas else DEFAULT_ALPHAS,
                   parse_decisions(decisions) if decisions else None, target, out, from_json)


def _items(option: str, text: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not all(items):
        raise TuneError(f"{option}: empty item in {text!r}; use comma-separated values")
    return items


def parse_alphas(text: str) -> tuple[float, ...]:
    """'0.5,0.8' -> (0.5, 0.8): each in [0, 1), duplicates dropped, order kept."""
    out: list[float] = []
    for item in _items("--alphas", text):
        try:
            alpha = float(item)
        except ValueError:
            raise TuneError(f"--alphas: {item!r} is not a number; e.g. --alphas 0.5,0.8") from None
        if not 0.0 <= alpha < 1.0:
            raise TuneError(f"--alphas: {item} is not in [0, 1); e.g. --alphas 0.5,0.8")
        out.append(alpha)
    return tuple(dict.fromkeys(out))


def parse_decisions(text: str) -> tuple[int, ...]:
    """'16,32,64' -> (16, 32, 64): positive integers, sorted, duplicates dropped."""
    out: set[int] = set()
    for item in _items("--decisions", text):
        if not item.isdigit() or int(item) < 1:
            raise TuneError(f"--decisions: {item!r} is not a positive integer; "
                            "e.g. --decisions 16,32,64")
        out.add(int(item))
    return tuple(sorted(out))


def decision_grid(decisions: tuple[int, ...] | None, max_new_tokens: int) -> tuple[int, ...]:
    """The decision lengths to score: all below max_new_tokens, where candidates can be live."""
    if decisions is None:
        grid = tuple(t for t in DEFAULT_GRID if t < max_new_tokens)
        if not grid:
            raise TuneError(f"--decisions: no default decision length is below "
                            f"generator.sampling.max_new_tokens={max_new_tokens}; pass some")
        return grid
    late = [t for t in decisions if t >= max_new_tokens]
    if late:
        raise TuneError(f"--decisions: {late[0]} is not below generator.sampling.max_new_tokens="
                        f"{max_new_tokens}; no candidate is live there")
    return decisions


def schedules(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every single decision [t] and every pair [t_i, t_j], t_i < t_j, from the grid."""
    return [(t,) for t in grid] + list(combinations(grid, 2))


def out_dir(out: str | None, output_path: str) -> Path:
    """--out, else <output.path>/tune."""
    return side_folder(out, output_path, "tune", "tune", TuneError)
