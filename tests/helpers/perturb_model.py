"""A stand-in trainer for iterate's tests (`trainer.type: command`): the model copied with
its weights nudged by noise seeded with the round, so every round publishes a model of its
own, in a fraction of a second (numpy and safetensors, no torch).

    python tests/helpers/perturb_model.py MODEL OUTPUT ROUND
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


def main(model: str, output: str, round_: str) -> None:
    shutil.copytree(model, output, dirs_exist_ok=True)
    weights = Path(output) / "model.safetensors"
    rng = np.random.default_rng(int(round_))
    tensors = {k: v + rng.normal(0.0, 0.2, v.shape).astype(v.dtype)
               for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})


if __name__ == "__main__":
    main(*sys.argv[1:])
