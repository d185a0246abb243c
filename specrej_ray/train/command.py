"""A trainer of the user's own: a command line (accelerate, torchrun, OpenRLHF, a script)
given the round's data and model, which must save a model directory to {output}."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

from specrej_ray.errors import TrainError

LOG = "train.log"


def command_line(job, out: Path) -> list[str]:
    values = {"data": job.data, "model": job.start, "output": str(out),
              "checkpoints": job.checkpoints, "round": job.round, "seed": job.seed}
    return shlex.split(job.command.format(**{k: shlex.quote(str(v))
                                             for k, v in values.items()}))


def run_command(job, out: Path, echo) -> dict[str, Any]:
    argv = command_line(job, out)
    log = Path(job.checkpoints) / LOG
    echo(f"[specrej] round {job.round}: training with `{shlex.join(argv)}` (log: {log}; "
         f"checkpoints kept across restarts in {job.checkpoints})")
    try:
        with log.open("ab") as fh:
            # A cancelled or lost task's worker takes this child with it (Ray kills a
            # worker's child processes when it exits; tests/test_iterate.py checks it).
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT).returncode
    except OSError as e:
        raise TrainError(f"iterate.trainer.command: cannot start {argv[0]!r} "
                         f"({e.strerror or e}); check the command line") from None
    if rc != 0:
        raise TrainError(f"iterate.trainer.command exited with {rc} in round {job.round}: "
                         f"{_last_line(log)} (whole log: {log})")
    if not (out / "config.json").is_file():
        raise TrainError(f"iterate.trainer.command exited 0 in round {job.round} but saved no "
                         f"model to {{output}} (no config.json there); save_pretrained into it")
    return {"resumed_from": None, "log": str(log)}


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1].strip()[:300] if lines else "no output"
