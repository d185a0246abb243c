"""The memory planner's arithmetic: KV bytes per token, workspace, budgets on CPU and CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from specrej_ray.engine.hf import memory
from specrej_ray.engine.hf.memory import (
    GIB,
    activation_bytes,
    budget_tokens,
    kv_bytes_per_token,
    plan_memory,
)


def llama3_8b() -> LlamaConfig:
    # Grouped-query attention: 32 query heads share 8 KV heads of 128 dims.
    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)


def test_kv_bytes_follow_gqa_heads_and_dtype():
    cfg = llama3_8b()
    # The published figure for Llama-3-8B in bf16: 128 KiB per token.
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 128 * 1024
    assert kv_bytes_per_token(cfg, torch.float32) == 256 * 1024
    cfg.num_key_value_heads = 32  # plain multi-head attention: 4x the cache
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 512 * 1024


def test_kv_bytes_use_an_explicit_head_dim():
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32)
    assert kv_bytes_per_token(cfg, torch.float16) == 2 * 3 * 2 * 32 * 2


def test_activation_workspace_is_the_larger_of_decode_and_prefill():
    cfg = llama3_8b()
    per_token = (2 * 14336 + 4 * 4096) * 2
    decode = 256 * (per_token + 128256 * 4)
    assert activation_bytes(cfg, torch.bfloat16, 256, 16) == decode
    prefill = 100_000 * per_token + 128256 * 4
    assert activation_bytes(cfg, torch.bfloat16, 1, 100_000) == prefill


def fake_model(device: str, dtype: torch.dtype, cfg) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), config=cfg,
                           parameters=lambda: iter([torch.zeros(1, dtype=dtype)]))


def test_cpu_budget_is_the_configured_gib():
    plan = plan_memory(fake_model("cpu", torch.float32, llama3_8b()), 1.5, 0.9)
    assert plan.budget_bytes == int(1.5 * GIB) and plan.free_bytes is None
    assert plan.budget_tokens == int(1.5 * GIB) // (256 * 1024)
    # Planned in what the engine's cache measured a token to take, when it says.
    measured = plan_memory(fake_model("cpu", torch.float32, llama3_8b()), 1.5, 0.9, 1000)
    assert measured.kv_bytes_per_token == 1000 and measured.budget_tokens == int(1.5 * GIB) // 1000


def test_cuda_budget_is_free_memory_after_workspace_times_utilization(monkeypatch):
    cfg = llama3_8b()
    free = 60 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    plan = plan_memory(fake_model("cuda", torch.bfloat16, cfg), 2.0, 0.9)
    workspace = activation_bytes(cfg, torch.bfloat16, memory.WORKSPACE_ROWS,
                                 memory.WORKSPACE_PREFILL_TOKENS)
    assert plan.workspace_bytes == workspace > 0
    assert plan.budget_bytes == int((free - workspace) * 0.9)
    assert plan.budget_tokens == plan.budget_bytes // (128 * 1024)
    # kv_budget_gb is a CPU setting: CUDA ignores it.
    assert plan_memory(fake_model("cuda", torch.bfloat16, cfg), 99.0, 0.9) == plan


def test_no_free_memory_still_allows_one_token(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB // 4, 80 * GIB))
    plan = plan_memory(fake_model("cuda", torch.bfloat16, llama3_8b()), 2.0, 0.9)
    assert plan.workspace_bytes > GIB // 4  # the weights left less than the workspace
    assert plan.budget_bytes == 0 and plan.budget_tokens == 1
    assert budget_tokens(3 * 1024, 1024) == 3
