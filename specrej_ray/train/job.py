"""One round's training: from a model directory and a training file to a published model
directory, resumed from the trainer's checkpoints when it was cut short."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrej_ray.errors import TrainError
from specrej_ray.models.identity import weights_sha256

TRAIN_STAMP = "specrej-train.json"  # inside a published model: what made it


@dataclass(frozen=True)
class TrainJob:
    round: int
    data: str  # the round's training file (parquet)
    start: str  # the model directory training starts from
    model: str  # where the trained model is published (a directory, absent until whole)
    checkpoints: str  # the trainer's checkpoints, kept across restarts
    train_on: str  # sft | preference
    kind: str  # trl | command
    seed: int = 0
    args: dict[str, Any] = field(default_factory=dict)  # trl: SFTConfig / DPOConfig fields
    command: str | None = None  # command: the template
    threads: int = 1  # torch threads (CPU training)


def train(job: TrainJob, echo=print) -> dict[str, Any]:
    """Train, publish `job.model` whole (a rename), and return its stamp: what it was
    trained from and on, its weight hash, how training went. TrainError for the user's
    mistakes; anything else is a crash the caller may retry (checkpoints are kept)."""
    if not Path(job.data).is_file():
        raise TrainError(f"round {job.round}: the training file {job.data} is missing; the "
                         "round's generation did not write it (check output.formats)")
    t0 = time.time()
    target = Path(job.model)
    target.parent.mkdir(parents=True, exist_ok=True)
    Path(job.checkpoints).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    try:
        if job.kind == "command":
            from specrej_ray.train.command import run_command

            how = run_command(job, tmp, echo)
        else:
            from specrej_ray.train.trl_trainer import run_trl

            how = run_trl(job, tmp, echo)
        stamp = {"round": job.round, "data": job.data, "data_sha256": _file_sha256(job.data),
                 "data_rows": _rows(job.data),
                 "start": job.start, "train_on": job.train_on, "trainer": job.kind,
                 "args": job.args, "command": job.command,
                 "sha256": weights_sha256(tmp), "seconds": time.time() - t0, **how}
        (tmp / TRAIN_STAMP).write_text(json.dumps(stamp, indent=2))
        if target.exists():  # a published model is never replaced: a finished round stays
            raise TrainError(f"round {job.round}: {target} appeared while training; another "
                             "iterate on the same output.path? Remove one")
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of shared storage
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stamp


def _rows(path: str) -> int:
    """The training file's rows: what a round trained on, after output.filters."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _temp_prefix(model: Path) -> str:
    return f".{model.name}-"


def remove_leftovers(model: str | Path) -> list[Path]:
    """Remove the temporary folders that train() made beside `model` and never renamed (a
    trainer killed with its worker skips the clean-up); returns them. Only mkdtemp's names
    with our prefix, only real folders: nothing else beside the model is touched."""
    model = Path(model)
    # mkdtemp adds 8 characters from tempfile's alphabet (lowercase letters, digits, _).
    ours = re.compile(re.escape(_temp_prefix(model)) + r"[a-z0-9_]{8}")
    try:
        entries = list(os.scandir(model.parent))
    except FileNotFoundError:
        return []
    found = [Path(e.path) for e in entries
             if ours.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def read_stamp(model: str | Path) -> dict[str, Any] | None:
    """A published model's stamp (None: not a model this loop published)."""
    path = Path(model) / TRAIN_STAMP
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
