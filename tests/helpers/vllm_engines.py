"""The vLLM backend on a tiny random model, for the property suite and the vLLM tests.

vLLM's CPU attention takes head sizes of 32 and up (the conftest tiny model has 8), so its
tiny model has a head of 64; its tokenizer is the same byte-level one, so prompts tokenize
alike. One LLMEngine is started per test process (about 30 s) and shared: every test wraps
it in a VllmEngine with its own settings (owner=False leaves it running).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.task import SearchParams
from specrej_ray.search.bounds import Keep
from tests.tiny import save_tiny_lm

# What vLLM's CPU attention runs: head_dim 64 (hidden 128 over 2 heads), one KV head.
VLLM_TINY = {"hidden_size": 128, "intermediate_size": 128, "num_attention_heads": 2,
             "num_key_value_heads": 1, "max_position_embeddings": 512}
KV_BYTES = 64 << 20  # the shared engine's cache: plenty for the tests' batches


def tiny_vllm_dir(path: Path, seed: int = 0, **config) -> Path:
    return save_tiny_lm(path, seed=seed, **{**VLLM_TINY, **config})


_shared: tuple | None = None


def shared_llm():
    """(LLMEngine, tokenizer, eos ids, model path) on the vLLM tiny model, started once per
    process, and again after another engine in this process shut down: vLLM's parallel
    groups are global to a process, and a shutdown destroys them for every engine in it."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from specrej_ray.engine.vllm.vllm_internals import shutdown

    global _shared
    if _shared is None or not model_parallel_is_initialized():
        if _shared is not None:
            # Shut the old one down now: left to the garbage collector, its finalizer would
            # run at a random later moment and tear down the new engine's groups.
            shutdown(_shared[0])
        _shared = _start(_model_dir())
    return _shared


@functools.cache
def _model_dir() -> str:
    root = Path(tempfile.mkdtemp(prefix="specrej-vllm-tiny-"))
    atexit.register(shutil.rmtree, root, True)
    return str(tiny_vllm_dir(root / "lm"))


def _start(path: str):
    from transformers import AutoTokenizer

    from specrej_ray.engine.vllm.build import start_llm
    from specrej_ray.engine.vllm.candidate_sampler import NAME

    llm = start_llm(dict(
        model=path, dtype="float32", enable_prefix_caching=True, logits_processors=[NAME],
        logprobs_mode="raw_logprobs", kv_cache_memory_bytes=KV_BYTES, max_model_len=512,
        enforce_eager=True, seed=0, disable_log_stats=True))
    tokenizer = AutoTokenizer.from_pretrained(path)
    return llm, tokenizer, {tokenizer.eos_token_id}, path


def vllm_engine(lm=None, *, n=8, alpha=0.5, decisions=(6, 12), min_decision=4, budget=10**6,
                max_new=20, stop=(), temperature=1.0, top_p=1.0, top_k=0, seed=0,
                rewards=None, overlap=4, model=None, ignore_eos=False, bounds_every=0,
                keep=None, draws=None, branch=False):
    """A VllmEngine on the shared tiny model with the settings of helpers.engines.engine
    (`budget`, `lm` and `model` do not apply: vLLM sizes its own cache)."""
    from specrej_ray.engine.vllm.engine import VllmEngine

    llm, tokenizer, eos, _ = shared_llm()
    sampling = SamplingParams(temperature, top_p, top_k, max_new, tuple(stop), ignore_eos)
    search = SearchParams(n, alpha, decisions, min_decision, budget, seed, overlap,
                          bounds_every, keep or Keep(), draws, branch)
    return VllmEngine(llm, tokenizer, sampling, search, rewards, eos, owner=False)
