"""Per-actor setup that Ray does not do for us: GPU visibility."""

from __future__ import annotations


def actor_runtime_env(num_gpus: float) -> dict:
    # Ray actors with num_gpus=0 see every GPU; hide them so CPU actors stay on the CPU.
    return {} if num_gpus > 0 else {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
