"""generator.vllm.engine_kwargs: checked against vLLM's EngineArgs where vLLM is installed (a
driver without it leaves the check to the generator, which runs the same one at start-up).
The field names are read from vLLM's source (spec/vllm_fields.py), so no key costs vLLM's
import."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from typing import Any

from specrej_ray.spec.vllm_fields import engine_arg_annotations

# EngineArgs fields the job sets itself, and the spec key that sets each.
OWNED = {
    "model": "generator.model", "tokenizer": "generator.model",
    "revision": "generator.revision", "trust_remote_code": "generator.trust_remote_code",
    "dtype": "generator.dtype", "seed": "seed",
    "tensor_parallel_size": "generator.tensor_parallel_size",
    "gpu_memory_utilization": "generator.vllm.gpu_memory_utilization",
    "kv_cache_memory_bytes": "search.kv_budget_gb",
    "max_model_len": "generator.vllm.max_model_len",
    "enforce_eager": "generator.vllm.enforce_eager",
    "quantization": "generator.vllm.quantization",
    "kv_cache_dtype": "generator.vllm.kv_cache_dtype",
    "logits_processors": None, "logprobs_mode": None,  # how our sampling works
    "distributed_executor_backend": None,  # ray, set with tensor parallelism
}


def engine_arg_names(imported: bool = False) -> set[str] | None:
    """EngineArgs' field names, or None where vLLM is not installed: as read from its source,
    or with `imported` (or where the source cannot be read) from the class itself."""
    if importlib.util.find_spec("vllm") is None:
        return None
    read = None if imported else engine_arg_annotations()
    if read is not None:
        return set(read)
    from vllm import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def check_engine_kwargs(kwargs: dict[str, Any], names: set[str] | None = None) -> None:
    """One line (ValueError) for the first key that is not ours to pass on (vLLM is imported
    only when there is a key to check)."""
    if not kwargs:
        return
    for key in kwargs:
        if key in OWNED:
            where = OWNED[key]
            hint = f"set {where} instead" if where else "specrej-ray sets it itself"
            raise ValueError(f"engine_kwargs.{key}: {hint}")
    given = names is not None
    names = engine_arg_names() if names is None else names
    if names is None:
        return
    for key in kwargs:
        if key not in names and not given:
            # A name the source reading missed (a field from a base class, say) is never
            # refused on its word: the class itself decides, at vLLM's import cost.
            names = engine_arg_names(imported=True) or names
            given = True
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean {close[0]}?" if close else \
                "; see vllm.EngineArgs for the fields"
            raise ValueError(f"engine_kwargs.{key} is not a vLLM EngineArgs field{hint}")
