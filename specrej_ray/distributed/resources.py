"""Per-actor setup that Ray does not do for us: thread counts and GPU visibility."""

from __future__ import annotations

import os


def actor_runtime_env(num_gpus: float) -> dict:
    # Ray actors with num_gpus=0 see every GPU; hide them so CPU actors stay on the CPU.
    return {} if num_gpus > 0 else {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}


def set_torch_threads(threads: int | None) -> int:
    """Ray sets OMP_NUM_THREADS=1 in workers; give torch the cores we were told to use."""
    import torch

    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return torch.get_num_threads()
