"""KV-cache accounting from the model config (never from a table of model names)."""

from __future__ import annotations

import torch

GIB = 2**30


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_budget_bytes(device: torch.device, kv_budget_gb: float, utilization: float) -> int:
    """CPU: the configured budget. CUDA: free memory now (weights already loaded) x utilization."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * utilization)
    return int(kv_budget_gb * GIB)


def budget_tokens(budget_bytes: int, bytes_per_token: int) -> int:
    return max(1, budget_bytes // bytes_per_token)
