"""Reading an output directory's shard records (specrej_ray.output's layout) in tests."""

from __future__ import annotations

import json
from pathlib import Path


def finished_shards(out: Path) -> dict[str, list[str]]:
    """Shard id -> its prompt ids, for every shard whose record is written (none yet: {})."""
    shards = {}
    for record in sorted((out / "shards").glob("*.json")) if (out / "shards").is_dir() else []:
        try:
            shards[record.stem] = list(json.loads(record.read_text())["prompts"])
        except (OSError, ValueError, KeyError):  # being replaced right now
            continue
    return shards
