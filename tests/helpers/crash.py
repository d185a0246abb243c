"""Run `specrej-ray run` and die abruptly at a chosen write, for the fault matrix.

    python -m tests.helpers.crash JOB.yaml NAME [NTH]

The process exits with os._exit(137) (no clean-up, as under SIGKILL) the NTH time (default 1)
it is about to publish a file whose name ends with NAME: the file's temp copy is written and
not yet renamed. `shards/*.json` names a shard record; `best.jsonl` a final file, moved into
place with the rest of its set once run.json says `publishing` (data/final_set.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys

from specrej_ray.cli import main
from specrej_ray.data import dataset, final_set


def crash_at(pattern: str, nth: int) -> None:
    publishing = dataset._publishing
    move = final_set.Staging.move
    seen = 0

    def dying(name: str) -> None:
        nonlocal seen
        if fnmatch.fnmatch(name, pattern):
            seen += 1
            if seen == nth:
                os._exit(137)

    @contextlib.contextmanager
    def dying_publishing(out, name, *args):
        with publishing(out, name, *args) as tmp:
            yield tmp
            dying(name)

    def dying_move(self, name):
        dying(name)
        move(self, name)

    dataset._publishing = dying_publishing
    final_set.Staging.move = dying_move


if __name__ == "__main__":
    job, pattern, *rest = sys.argv[1:]
    crash_at(pattern, int(rest[0]) if rest else 1)
    sys.exit(main(["run", job]))
