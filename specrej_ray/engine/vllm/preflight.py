"""The generator's vLLM settings checked before Ray or any engine starts (job/preflight.py, for
`validate` and `run`): what vLLM would refuse half a minute into its start-up, as one line
that names the spec key. vLLM's own config objects are built from the spec (EngineArgs and its
create_engine_config: the model's config.json is read, no weights are loaded).

Importing vLLM takes 6 to 9 s, and torch 3 s, so the mistakes a user makes first are found
before either is imported: tensor parallelism on a machine with no GPU device, a
max_model_len beyond every length config.json gives, an engine_kwargs value whose plain type
(spec/vllm_fields.py) it does not have. Each of these quick checks refuses only what vLLM's
own check refuses too, which runs after them."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from specrej_ray.engine.vllm.annotations import resolve
from specrej_ray.engine.vllm.refusal import refusal
from specrej_ray.errors import ModelError
from specrej_ray.spec import JobSpec
from specrej_ray.spec.base import fits
from specrej_ray.spec.vllm_fields import engine_arg_annotations, plain_types, type_name


def uses_vllm(spec: JobSpec) -> bool:
    """generator.engine: vllm, or auto with tensor parallelism (vLLM's alone). `auto` on one
    GPU is decided where the generator runs, which may not be this machine."""
    g = spec.generator
    return g.engine == "vllm" or (g.engine == "auto" and g.tensor_parallel_size > 1)


def local_gpus(spec: JobSpec) -> int | None:
    """The GPUs of this machine when the run starts its own Ray here, else None (a cluster's
    nodes are not this machine)."""
    if spec.cluster.address or os.environ.get("RAY_ADDRESS"):
        return None
    if no_gpu_device():
        return 0
    import torch

    return torch.cuda.device_count()


# Where a GPU's driver shows itself: NVIDIA's device nodes and proc entry, AMD's kernel
# fusion driver (ROCm), WSL2's GPU paravirtualisation.
_GPU_DEVICES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def no_gpu_device() -> bool:
    """True when torch could certainly see no GPU here (none visible, or no GPU driver's
    device): then torch, 3 s to import, need not be asked."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return True
    return not any(os.path.exists(p) for p in _GPU_DEVICES)


def check_vllm_quick(spec: JobSpec, model_path: str, local_gpus: int | None) -> None:
    """ModelError, one line naming the key, for a vLLM setting vLLM would refuse, of those
    found with nothing imported: tensor parallelism beyond this machine's GPUs, a
    max_model_len beyond config.json's, an engine_kwargs value of the wrong plain type.
    `local_gpus`: the GPUs of the machine the generators will run on when that is this one
    (a local run), else None."""
    if not uses_vllm(spec):
        return
    _check_tensor_parallel(spec, local_gpus)
    if importlib.util.find_spec("vllm") is None:
        return  # the cluster's generators may have it; they say so at start if not
    # engine_kwargs' names were checked with the spec (spec/vllm_kwargs.py); their values,
    # and the context:
    _check_plain_kwarg_types(spec.generator.vllm.engine_kwargs)
    _check_max_model_len(spec.generator.vllm.max_model_len, model_path)


def check_vllm_config(spec: JobSpec, model_path: str, local_gpus: int | None) -> None:
    """The rest of what vLLM would refuse, asked of vLLM's own objects (imports vLLM), on
    the resolved model (`model_path`: a directory, a GGUF converted)."""
    if not uses_vllm(spec) or importlib.util.find_spec("vllm") is None:
        return
    _check_max_model_len(spec.generator.vllm.max_model_len, model_path)  # a GGUF's, now
    _check_kwarg_types(spec.generator.vllm.engine_kwargs)
    _check_engine_config(spec, model_path, on_gpu=bool(local_gpus))


def _check_tensor_parallel(spec: JobSpec, local_gpus: int | None) -> None:
    k = spec.generator.tensor_parallel_size
    if k == 1 or local_gpus is None or local_gpus >= k:
        return
    have = f"{local_gpus} GPU{'s' if local_gpus != 1 else ''}" if local_gpus else "no GPU"
    raise ModelError(
        f"generator.tensor_parallel_size: {k} needs {k} GPUs on one node, and this machine "
        f"has {have} (a local run: cluster.address is not set); vLLM runs tensor parallel "
        "on GPUs only: set it to 1, or set cluster.address to a cluster with such nodes")


def _check_plain_kwarg_types(kwargs: dict[str, Any]) -> None:
    """Each engine_kwargs value whose field has a plain type (bool, int, float, str, None)
    has it, read from vLLM's source without importing vLLM."""
    fields = engine_arg_annotations() if kwargs else None
    for key, value in (kwargs or {}).items():
        types = plain_types(fields.get(key, "")) if fields else None
        if types is not None and not fits(value, types):
            raise ModelError(f"generator.vllm.engine_kwargs.{key}: {value!r} is not "
                             f"{type_name(types)} (a {type(value).__name__} was given)")


# config.json's keys for the context length, as vLLM reads them (ModelArchConfigConvertor).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")


def longest_context(config: dict[str, Any]) -> tuple[int, str] | None:
    """The longest context any length key of config.json (or its text_config) allows, times
    its RoPE scaling factor: an upper bound of what vLLM derives (the smallest key, times the
    factor for some RoPE types only). None where config.json gives no length."""
    found: list[tuple[float, str]] = []
    factor = 1.0
    for part in (config, *(v for k, v in config.items() if k.endswith("_config")
                           and isinstance(v, dict))):
        for key in _LENGTH_KEYS:
            value = part.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                found.append((float(value), key))
        for rope in (part.get("rope_scaling"), part.get("rope_parameters")):
            for r in (rope.values() if isinstance(rope, dict) and "factor" not in rope
                      else [rope]):
                f = r.get("factor") if isinstance(r, dict) else None
                if isinstance(f, int | float) and not isinstance(f, bool):
                    factor = max(factor, float(f))
    if not found:
        return None
    length, key = max(found)
    return int(length * factor), key


def _check_max_model_len(max_model_len: int | None, model_path: str) -> None:
    """generator.vllm.max_model_len beyond every length config.json gives: vLLM refuses it
    (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set)."""
    config = Path(model_path) / "config.json"
    if not max_model_len or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") \
            or not config.is_file():
        return
    try:
        bound = longest_context(json.loads(config.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return  # the model's own checks name what is wrong with its config
    if bound is not None and max_model_len > bound[0]:
        raise ModelError(
            f"generator.vllm.max_model_len: {max_model_len} is beyond the model's context "
            f"({bound[0]}, from config.json's {bound[1]}); vLLM refuses it: set it at most "
            f"{bound[0]}, or leave it out for the model's own")


def engine_arg_types() -> dict[str, Any]:
    """EngineArgs' field types, each one that can be resolved: a type vLLM writes as a string
    is resolved from its module's names without running it (annotations.py); one that names
    a type imported for type checkers only is left out (vLLM's own check runs later)."""
    from vllm import EngineArgs

    namespace = vars(sys.modules[EngineArgs.__module__])
    types = {}
    for f in dataclasses.fields(EngineArgs):
        try:
            types[f.name] = resolve(f.type, namespace) if isinstance(f.type, str) else f.type
        except (ValueError, TypeError):  # an unknown name; a subscript its type refuses
            continue
    return types


def _check_kwarg_types(kwargs: dict[str, Any]) -> None:
    """Each engine_kwargs value has its EngineArgs field's type: vLLM itself fails on a wrong
    one with an error that names no key ('<' not supported between 'int' and 'str')."""
    from pydantic import ConfigDict, PydanticUserError, TypeAdapter, ValidationError

    if not kwargs:
        return
    types = engine_arg_types()
    for key, value in kwargs.items():
        if key not in types:
            continue
        try:
            try:
                adapter = TypeAdapter(types[key], config=ConfigDict(arbitrary_types_allowed=True))
            except PydanticUserError:  # a model or dataclass carries its own config
                adapter = TypeAdapter(types[key])
            adapter.validate_python(value, strict=True)  # YAML gives real types: no coercion
        except ValidationError as e:
            raise ModelError(f"generator.vllm.engine_kwargs.{key}: {value!r} is not "
                             f"{_type_name(types[key])} ({e.errors()[0]['msg'].lower()})"
                             ) from None
        except Exception:  # noqa: S112 (a type pydantic cannot check: vLLM's own check runs)
            continue


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _check_engine_config(spec: JobSpec, model_path: str, on_gpu: bool) -> None:
    from specrej_ray.engine.vllm.build import engine_args

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs

    args = engine_args(spec, model_path, on_gpu)
    try:
        EngineArgs(**args).create_engine_config()
    except Exception as e:  # vLLM refuses settings with many types, pydantic's among them
        raise ModelError(refusal(e, args)) from None
