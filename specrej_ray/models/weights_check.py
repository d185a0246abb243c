"""A local model's weights checked against its config before anything loads them.

`validate` and the start of `run` read only the safetensors headers (a few KB a file) and
build the model on the meta device from config.json (no memory, no weights): a truncated
file or weights of another shape are one line naming the file and the tensor, in seconds,
not a traceback from an actor after Ray has started. Only what transformers could load
is compared; other weight formats and remote code are left to the load itself.

The build imports torch and transformers' model classes (7 s here), so the headers and the
embedding's shape (config.json's vocab_size x hidden_size, in the families where that is its
shape) are checked first, with `build=False`: a config of another model is refused before
any import, and the build then compares every tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from specrej_ray.errors import ModelError

_HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header
_PASSED: set[tuple] = set()  # the files check_weights passed in this process, as they were


def check_weights(path: str, field: str, source: str, classifier: bool = False,
                  trust_remote_code: bool = False, build: bool = True) -> None:
    """ModelError (one line) if the safetensors files in the local dir `path` are cut short,
    or hold a tensor whose shape is not the one config.json gives it. `classifier`: the
    model is loaded as a sequence classifier (a reward), not a causal LM. `build=False`:
    the headers and the embedding only, with nothing imported."""
    root = Path(path)
    if not root.is_dir() or not (root / "config.json").is_file():
        return  # a hub id, or a .gguf converted by us
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return
    # `run` checks before the driver loads and the driver checks again, and a generator is
    # often its own reward: files checked once and unchanged since pass at once.
    key = (str(root.resolve()), classifier, trust_remote_code,
           tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                 for f in (root / "config.json", *files)))
    if key in _PASSED:
        return
    _check(root, files, field, source, classifier, trust_remote_code, build)
    if build:
        _PASSED.add(key)


def _check(root: Path, files: list[Path], field: str, source: str, classifier: bool,
           trust_remote_code: bool, build: bool) -> None:
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        found.update(read_header(f, field, source))
    if trust_remote_code:
        return  # the model's own code decides its shapes; building it would run that code
    _compare(found, _embedding_shape(root, found), field, source)
    if build:
        _compare(found, _expected_shapes(root, classifier), field, source)


def _compare(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
             field: str, source: str) -> None:
    for name, shape in sorted(found.items()):
        want = expected.get(name)
        if want is not None and want != shape:
            raise ModelError(
                f"{field}: '{source}' does not match its config.json: {name} is "
                f"{list(shape)} in the weights, {list(want)} by the config; give the config "
                "these weights were saved with")


# Decoder families whose input embedding is [vocab_size, hidden size] in transformers, and
# the name that size has in their config.json.
_EMBEDDING = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                     "qwen3_moe", "gemma", "gemma2", "phi3", "olmo", "olmo2", "starcoder2",
                     "granite", "smollm3", "gpt_neox", "falcon"), "hidden_size"),
    "gpt2": "n_embd",
}
_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "embed_in.weight",
                    "word_embeddings.weight")


def _embedding_shape(root: Path, found: dict[str, tuple[int, ...]]
                     ) -> dict[str, tuple[int, ...]]:
    """{the embedding's tensor name: [vocab_size, hidden size]} by config.json read as JSON
    (no import), for the families in _EMBEDDING; else {}."""
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # the load names what is wrong with the config
    if not isinstance(config, dict) or "quantization_config" in config:
        return {}  # quantized files store packed shapes
    width = config.get(_EMBEDDING.get(config.get("model_type"), ""))
    vocab = config.get("vocab_size")
    if not (isinstance(width, int) and isinstance(vocab, int)):
        return {}
    return {name: (vocab, width) for name in found if name.endswith(_EMBEDDING_NAMES)}


def read_header(file: Path, field: str, source: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors header, after checking that the header is
    whole and that every tensor's bytes lie inside the file."""
    size = file.stat().st_size
    where = f"{field}: '{source}': {file.name}"
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelError(f"{where} is cut short ({size} bytes); copy it again")
        (length,) = struct.unpack("<Q", head)
        if length > _HEADER_LIMIT or 8 + length > size:
            raise ModelError(f"{where} is cut short or not safetensors (a {length}-byte "
                             f"header in {size} bytes); copy it again")
        try:
            header = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ModelError(f"{where} has an unreadable header; copy it again") from None
    shapes, last = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in entry["data_offsets"])
            shapes[name] = tuple(int(d) for d in entry["shape"])
            if not 0 <= start <= end:
                raise ValueError(name)
        except (TypeError, KeyError, ValueError):
            raise ModelError(f"{where} has an unreadable header entry for {name}; copy it "
                             "again") from None
        last = max(last, end)
    if 8 + length + last > size:  # the offsets count from the end of the header
        raise ModelError(f"{where} is cut short: it is {size:,} bytes, but its header says "
                         f"its tensors end at byte {8 + length + last:,}; copy it again")
    return shapes


def _expected_shapes(root: Path, classifier: bool) -> dict[str, tuple[int, ...]]:
    """Parameter and buffer shapes of the model config.json describes, built on the meta
    device (no memory is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(root, trust_remote_code=False)
        with torch.device("meta"):
            model = auto.from_config(config)
    except Exception:  # an architecture transformers cannot build: its load will say why
        return {}
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
