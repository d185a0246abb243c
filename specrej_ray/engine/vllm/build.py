"""The spec's generator as a VllmEngine: vLLM's EngineArgs from the spec (engine_args, pure,
tested without vLLM) and the engine built in process."""

from __future__ import annotations

import os
from typing import Any

from specrej_ray.engine.vllm.candidate_sampler import NAME as SAMPLER
from specrej_ray.spec import JobSpec

GIB = 1 << 30
# vLLM's CPU default block holds 128 tokens, more than most prompts: its prefix cache then
# shares no prompt between the candidates, and a survivor re-prefills up to 127 tokens per
# decision. 32 is the smallest its CPU attention prefers; measured on the bench job (N = 16,
# 256 tokens): 78% prefix hits instead of 0, and the run 20% faster (BENCHMARKS.md).
# engine_kwargs.block_size overrides it. GPUs keep vLLM's default (16).
CPU_BLOCK = 32


def engine_args(spec: JobSpec, model_path: str, on_gpu: bool) -> dict[str, Any]:
    """vllm.EngineArgs' fields for the spec's generator at a resolved model path."""
    g, v = spec.generator, spec.generator.vllm
    args: dict[str, Any] = {
        "model": model_path, "tokenizer": model_path, "seed": spec.seed,
        "trust_remote_code": g.trust_remote_code,
        # our dtype rule, as the hf engine's: bf16 on a GPU, float32 on CPU
        "dtype": ("bfloat16" if on_gpu else "float32") if g.dtype == "auto" else g.dtype,
        "enable_prefix_caching": True,  # a prompt's N candidates share its blocks
        "logits_processors": [SAMPLER],  # candidate identity (candidate_sampler)
        "logprobs_mode": "raw_logprobs",  # the model's own, for self-likelihood
        "max_model_len": v.max_model_len, "enforce_eager": v.enforce_eager,
        "quantization": v.quantization, "kv_cache_dtype": v.kv_cache_dtype,
        "tensor_parallel_size": g.tensor_parallel_size,
        "disable_log_stats": True,
    }
    if on_gpu:
        args["gpu_memory_utilization"] = (v.gpu_memory_utilization
                                          or spec.search.gpu_memory_utilization)
    else:  # vLLM's CPU build reads the utilization as a share of host RAM: size the cache
        args["kv_cache_memory_bytes"] = int(spec.search.kv_budget_gb * GIB)
        args["block_size"] = CPU_BLOCK
    if g.tensor_parallel_size > 1:
        args["distributed_executor_backend"] = "ray"
    return {**args, **v.engine_kwargs}


def start_llm(args: dict[str, Any]):
    """vLLM's LLMEngine, in this process (its scheduler must be ours to read). vLLM's CPU
    worker replaces torch.set_num_threads with a no-op for the whole process and lowers the
    thread count; both are put back, so the process's own torch work (rewards, tests) keeps
    the threads it was given."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import EngineArgs, LLMEngine

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        return LLMEngine.from_engine_args(EngineArgs(**args))
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def build_vllm_engine(spec: JobSpec, model_path: str, on_gpu: bool, sampling, search,
                      rewards):
    """The spec's generator in vLLM, in this process (its scheduler must be ours to read),
    with the engine settings job.engines made of the spec."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from specrej_ray.engine.stopping import eos_token_ids
    from specrej_ray.engine.vllm import vllm_internals
    from specrej_ray.engine.vllm.engine import VllmEngine
    from specrej_ray.engine.vllm.refusal import refusal
    from specrej_ray.errors import ModelError
    from specrej_ray.models.loader import load_tokenizer
    from specrej_ray.spec.vllm_kwargs import check_engine_kwargs

    g = spec.generator
    check_engine_kwargs(g.vllm.engine_kwargs)
    vllm_internals.check()  # here, not inside vLLM's start, where it would read as a refusal
    args = engine_args(spec, model_path, on_gpu)
    try:
        llm = start_llm(args)
    except Exception as e:  # vLLM refuses settings with many types, pydantic's among them
        raise ModelError(f"vLLM did not start: {refusal(e, args)}") from None
    tokenizer = load_tokenizer(model_path, trust_remote_code=g.trust_remote_code)
    try:
        config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        config = None
    eos = eos_token_ids(SimpleNamespace(generation_config=config), tokenizer)
    return VllmEngine(llm, tokenizer, sampling, search, rewards, eos)
