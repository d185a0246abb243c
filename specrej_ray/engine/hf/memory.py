"""The memory planner: KV accounting from the model config (never a table of model names).

CUDA: budget = (free memory after the weights - activation workspace) x utilization.
CPU: budget = search.kv_budget_gb. The engine sizes n0 and the memory schedule from the
budget in tokens; an out-of-memory error still halves it at run time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GIB = 2**30
# The decode batch the activation workspace is reserved for, and the longest prefill.
WORKSPACE_ROWS = 256
WORKSPACE_PREFILL_TOKENS = 4096


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token occupies across all layers (grouped-query aware)."""
    cfg = _text_config(config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def activation_bytes(config, dtype: torch.dtype, rows: int, prefill_tokens: int) -> int:
    """Peak transient memory of one forward pass, whichever is larger: a decode step over
    `rows` rows or a prefill of `prefill_tokens` tokens.

    Per token in flight: the float32 logits row (decode keeps every row's; prefill only
    the last), the MLP's gate and up projections, and a few hidden-size buffers.
    """
    cfg = _text_config(config)
    inter = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    per_token = (2 * inter + 4 * cfg.hidden_size) * dtype.itemsize
    decode = rows * (per_token + cfg.vocab_size * 4)
    prefill = prefill_tokens * per_token + cfg.vocab_size * 4
    return max(decode, prefill)


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    kv_bytes_per_token: int
    free_bytes: int | None  # CUDA: free after the weights were loaded
    workspace_bytes: int  # CUDA: held back for activations
    budget_bytes: int
    budget_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def plan_memory(model, kv_budget_gb: float, utilization: float,
                bytes_per_token: int | None = None) -> MemoryPlan:
    """The KV budget for this model on its device (weights already loaded), in tokens of
    `bytes_per_token` (what the engine's cache measured; else from the config)."""
    dtype = next(model.parameters()).dtype
    per_token = bytes_per_token or kv_bytes_per_token(model.config, dtype)
    device = model.device
    free = workspace = None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        workspace = activation_bytes(model.config, dtype, WORKSPACE_ROWS,
                                     WORKSPACE_PREFILL_TOKENS)
        budget = int(max(0, free - workspace) * utilization)
    else:
        budget = int(kv_budget_gb * GIB)
    return MemoryPlan(str(device), per_token, free, workspace or 0, budget,
                      budget_tokens(budget, per_token))


def budget_tokens(budget_bytes: int, bytes_per_token: int) -> int:
    return max(1, budget_bytes // bytes_per_token)
