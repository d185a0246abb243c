"""Run `specrej-ray iterate` and die abruptly in a chosen phase, for tests/test_iterate.py.

    python -m tests.helpers.iterate_crash JOB.yaml PHASE [ARG]

PHASE:
- `shard N`: the driver exits 137 (no clean-up, as under SIGKILL) as it publishes the Nth
  shard record of the loop (rounds counted together): generation cut short.
- `checkpoint NAME`: the training task's worker exits 137 right after the trainer saved its
  checkpoint NAME, once (a marker beside the checkpoints keeps a restarted task alive): a
  worker lost mid-training.
- `recorded R`: the driver exits 137 once round R's model is published, before iterate.json
  records the round.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from specrej_ray.cli import main
from tests.helpers.crash import crash_at

MARKER = "crashed-once"


def dying_train_task(name: str):
    """The training task, in its Ray worker, with the trainer's checkpoint save patched to
    kill the worker after writing checkpoint `name`. Defined in __main__, so Ray ships it by
    value to the worker."""

    def task(job):
        return _train_dying_at(job, name)

    return task


def _train_dying_at(job, name: str):
    from transformers import Trainer

    from specrej_ray.train import train

    marker = Path(job.checkpoints) / MARKER
    save = Trainer._save_checkpoint

    def saving_then_dying(self, *args, **kwargs):
        save(self, *args, **kwargs)
        if (Path(job.checkpoints) / name).is_dir() and not marker.exists():
            marker.write_text("")
            os._exit(137)

    Trainer._save_checkpoint = saving_then_dying
    return train(job)


def die_once_recorded(r: int) -> None:
    from specrej_ray.iterate.loop import Loop

    record = Loop._save_round

    def dying_record(self, rnd, *args, **kwargs):
        if rnd == r:
            os._exit(137)
        return record(self, rnd, *args, **kwargs)

    Loop._save_round = dying_record


if __name__ == "__main__":
    job, phase, arg = sys.argv[1:4]
    if phase == "shard":
        crash_at("shards/*.json", int(arg))
    elif phase == "checkpoint":
        from specrej_ray.distributed import training

        training._train_task = dying_train_task(arg)
    elif phase == "recorded":
        die_once_recorded(int(arg))
    else:
        raise SystemExit(f"unknown phase {phase}")
    sys.exit(main(["iterate", job]))
