"""`tune --from`: an earlier tune.json's candidates, replayed again without generating.

tune.json keeps every prompt's candidate lengths, final and partial rewards. They are replayed
only for a job that would have produced them: the generator, the reward, N, the token limit and
the seed it records must be the job's (sampling and the prompts themselves are not recorded,
so those stay the user's to keep).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specrej_ray.quality.calibrate import table_from_json
from specrej_ray.spec import JobSpec
from specrej_ray.tune.collect import Collected
from specrej_ray.tune.options import TuneError

# tune.json's settings key -> (the job's field as a user writes it, how to read it)
MATCHED: dict[str, tuple[str, Callable[[JobSpec], Any]]] = {
    "generator": ("generator.model", lambda s: s.generator.model),
    "reward": ("reward", lambda s: s.reward_label),
    "n": ("search.n", lambda s: s.search.n),
    "max_new_tokens": ("generator.sampling.max_new_tokens",
                       lambda s: s.generator.sampling.max_new_tokens),
    "seed": ("seed", lambda s: s.seed),
}


def load_saved(path: str, spec: JobSpec, limit: int | None,
               decisions: tuple[int, ...] | None) -> tuple[list[Collected], tuple[int, ...]]:
    """The first `limit` (default: all) prompts of the tune.json at `path`, and the decision
    lengths to replay (default: every one it scored)."""
    saved = _read(path)
    where = f"--from {path}"
    settings, prompts = saved["settings"], saved["prompts"]
    for key, (field, value) in MATCHED.items():
        if key not in settings:
            raise TuneError(f"{where}: records no {field}; pass a tune.json that "
                            "`specrej-ray tune` wrote")
        if settings[key] != value(spec):
            fix = "" if key == "reward" else f" or --set {field} to match"
            raise TuneError(f"{where}: made with {field}={settings[key]!r}, the job has "
                            f"{value(spec)!r}; tune the job again{fix}")
    scored = tuple(settings.get("decisions") or ())
    if not scored:
        raise TuneError(f"{where}: records no decision lengths; tune the job again")
    missing = [t for t in decisions or () if t not in scored]
    if missing:
        raise TuneError(f"--decisions: {missing[0]} was not scored in {path} (scored: "
                        f"{', '.join(map(str, scored))}); pick from those or tune again")
    if limit is not None and limit > len(prompts):
        raise TuneError(f"--prompts: {path} holds {len(prompts)} prompts, not {limit}")
    grid = decisions or scored
    return [_collected(where, p, grid) for p in prompts[:limit]], grid


def _read(path: str) -> dict:
    try:
        saved = json.loads(Path(path).read_text(), parse_constant=_no_constant)
    except OSError as e:
        raise TuneError(f"--from {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise TuneError(f"--from {path}: not JSON ({e})") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("settings"), dict)
            and isinstance(saved.get("prompts"), list) and saved["prompts"]):
        raise TuneError(f"--from {path}: not a tune.json (no settings or no prompts); "
                        "pass the tune.json an earlier `specrej-ray tune` wrote")
    return saved


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a score tune writes")


def _collected(where: str, p: dict, grid: tuple[int, ...]) -> Collected:
    try:
        data = table_from_json(p)
        missing = [t for t in grid if t not in data.partial]
        if missing:
            raise ValueError(f"no partial scores at {missing[0]} tokens")
        return Collected(str(p["id"]), data, float(p["seconds"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TuneError(f"{where}: prompt {p.get('id', '?') if isinstance(p, dict) else '?'}"
                        f" is malformed ({e})") from None
