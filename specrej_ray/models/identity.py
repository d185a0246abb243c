"""Which weights a model name stood for: a hub snapshot's revision, a local directory's
content hash. Cards and run.json name models by it, and expert iteration ties each round's
data to the policy that generated it."""

from __future__ import annotations

import contextlib
import hashlib
import re
from pathlib import Path
from typing import Any

# The files that hold weights: what a retrained policy changes (a trainer's own files beside
# them, training_args.bin, optimizer.pt, are not the model).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_PREFIXES = ("model", "pytorch_model", "adapter_model", "consolidated")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")
_CHUNK = 1 << 22


def weights_sha256(path: str | Path) -> str:
    """sha256 over a model's weights: every tensor of its safetensors files (name, dtype,
    shape, bytes, in name order), or the bytes of other weight files. Tensors rather than
    file bytes: two saves of the same weights may differ in their files' headers."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(
        p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
        and p.name.startswith(WEIGHT_PREFIXES))
    if not files:
        raise FileNotFoundError(f"no weight files in {root}")
    digest = hashlib.sha256()
    tensors = [f for f in files if f.suffix == ".safetensors"]
    if tensors:
        _hash_tensors(digest, tensors)
    for f in (f for f in files if f.suffix != ".safetensors"):
        digest.update(f.name.encode() + b"\x00")
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _hash_tensors(digest, files: list[Path]) -> None:
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (not a dict)
    for name in sorted(where):
        t = where[name].get_tensor(name).contiguous()
        digest.update(f"{name}\x00{t.dtype}\x00{tuple(t.shape)}\x00".encode())
        digest.update(t.view(-1).view(torch_uint8()).numpy().tobytes())


def torch_uint8():
    import torch

    return torch.uint8


def describe_model(requested: str, resolved: str | None, revision: str | None = None
                   ) -> dict[str, Any]:
    """{model, revision, sha256}: a hub snapshot by its commit, anything local by the hash of
    its weights (None where neither can be known, e.g. a callable reward)."""
    info: dict[str, Any] = {"model": requested, "revision": revision, "sha256": None}
    if resolved is None:
        return info
    found = _SNAPSHOT.search(str(resolved))
    if found:
        info["revision"] = found.group(1)
        return info
    # A remote or unreadable source is named by what the spec says only.
    with contextlib.suppress(OSError):
        info["sha256"] = weights_sha256(resolved)
    return info
