"""The checks that run before torch or vLLM is imported (issue 31): each refuses only what the
thorough check after it refuses too, and leaves to it what it cannot read."""

from __future__ import annotations

import collections.abc
import json
import typing

import pytest

from specrej_ray.engine.vllm import preflight
from specrej_ray.engine.vllm.annotations import resolve
from specrej_ray.engine.vllm.preflight import longest_context, no_gpu_device
from specrej_ray.errors import ModelError
from specrej_ray.job.engines import vllm_installed
from specrej_ray.models.weights_check import check_weights
from specrej_ray.spec.base import fits
from specrej_ray.spec.vllm_fields import engine_arg_annotations, plain_types, type_name


@pytest.mark.parametrize("annotation, types", [
    ("int", (int,)), ("int | None", (int, type(None))), ("Optional[float]", (float, type(None))),
    ("bool | str | None", (bool, str, type(None))), ("'int | None'", (int, type(None))),
    ("list[str] | None", None), ("LogprobsMode", None), ("Literal['a', 'b']", None),
    ("dict[str, Any]", None),
])
def test_only_plain_annotations_give_types(annotation, types):
    assert plain_types(annotation) == types


@pytest.mark.parametrize("value, types, ok", [
    (3, (int,), True), (True, (int,), False), ("3", (int,), False), (3, (float,), True),
    (0.5, (int,), False), (False, (float,), False), (None, (int, type(None)), True),
    (True, (bool,), True), (1, (bool,), False), ("x", (str, type(None)), True),
])
def test_values_fit_as_yaml_gives_them(value, types, ok):
    assert fits(value, types) is ok


def test_type_names_are_written_as_vllm_writes_them():
    assert type_name((int, type(None))) == "int | None"


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup installs it)")
def test_the_fields_read_from_source_are_engine_args_fields():
    """The names and plain types read without importing vLLM are EngineArgs' own."""
    import dataclasses
    import typing

    from vllm import EngineArgs

    read = engine_arg_annotations()
    assert set(read) == {f.name for f in dataclasses.fields(EngineArgs)}
    plain = {k: plain_types(v) for k, v in read.items() if plain_types(v)}
    assert len(plain) > 100  # most fields are plain: the quick check covers them
    resolved = preflight.engine_arg_types()
    for name, types in plain.items():
        assert set(typing.get_args(resolved[name]) or (resolved[name],)) == set(types), name


def test_a_wrong_plain_type_is_refused_and_other_types_are_left_to_vllm(monkeypatch):
    monkeypatch.setattr(preflight, "engine_arg_annotations",
                        lambda: {"max_num_seqs": "int | None", "hf_overrides": "HfOverrides"})
    with pytest.raises(ModelError, match=r"^generator.vllm.engine_kwargs.max_num_seqs: 'abc' "
                                         r"is not int \| None \(a str was given\)$"):
        preflight._check_plain_kwarg_types({"max_num_seqs": "abc"})
    preflight._check_plain_kwarg_types({"max_num_seqs": 8, "hf_overrides": "anything",
                                        "unknown": 1})


@pytest.mark.parametrize("config, bound", [
    ({"max_position_embeddings": 4096}, (4096, "max_position_embeddings")),
    ({"n_positions": 1024, "max_position_embeddings": 2048}, (2048, "max_position_embeddings")),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
     (16384, "max_position_embeddings")),
    ({"max_position_embeddings": 4096,
      "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2}}},
     (8192, "max_position_embeddings")),
    ({"text_config": {"max_position_embeddings": 8192}}, (8192, "max_position_embeddings")),
    ({"model_max_length": 131072, "max_position_embeddings": 8192},
     (131072, "model_max_length")),
    ({"hidden_size": 64}, None), ({"max_position_embeddings": True}, None),
])
def test_the_longest_context_bounds_what_vllm_derives(config, bound):
    assert longest_context(config) == bound


def test_max_model_len_is_refused_only_beyond_the_bound_and_not_when_vllm_is_told_to_allow_it(
        tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    preflight._check_max_model_len(256, str(tmp_path))
    preflight._check_max_model_len(None, str(tmp_path))
    with pytest.raises(ModelError, match=r"max_model_len: 257 is beyond the model's context "
                                         r"\(256, from config.json's max_position_embeddings\)"):
        preflight._check_max_model_len(257, str(tmp_path))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    preflight._check_max_model_len(10**8, str(tmp_path))


@pytest.mark.parametrize("visible, devices, none", [
    ("", {"/dev/nvidiactl"}, True), ("-1", {"/dev/kfd"}, True), (None, set(), True),
    (None, {"/dev/nvidiactl"}, False), (None, {"/proc/driver/nvidia"}, False),
    (None, {"/dev/dxg"}, False), ("0", {"/dev/kfd"}, False),
])
def test_no_gpu_device_is_said_only_when_torch_could_see_none(monkeypatch, visible, devices,
                                                              none):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(preflight.os.path, "exists", lambda p: p in devices)
    assert no_gpu_device() is none


def _model(tmp_path, tensors: dict, **config):
    import numpy as np
    from safetensors.numpy import save_file

    tmp_path.mkdir(exist_ok=True)
    save_file({k: np.zeros(s, np.float32) for k, s in tensors.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config, refused", [
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": 6}, True),
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": 4}, False),
    ({"model_type": "opt", "vocab_size": 10, "hidden_size": 6}, False),  # its own projection
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": 6,
      "quantization_config": {}}, False),  # packed shapes
])
def test_the_embedding_is_checked_without_a_build_in_the_families_that_fix_its_shape(
        tmp_path, config, refused):
    path = _model(tmp_path / "m", {"model.embed_tokens.weight": (10, 4)}, **config)
    if refused:
        with pytest.raises(ModelError, match=r"model.embed_tokens.weight is \[10, 4\] in the "
                                             r"weights, \[10, 6\] by the config"):
            check_weights(path, "generator.model", path, build=False)
    else:
        check_weights(path, "generator.model", path, build=False)


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make setup installs it)")
def test_a_key_the_source_reading_missed_is_asked_of_the_class_before_it_is_refused(
        monkeypatch):
    from specrej_ray.spec import vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "engine_arg_annotations", lambda: {"block_size": "int"})
    vllm_kwargs.check_engine_kwargs({"block_size": 16, "max_num_seqs": 8})  # the class has it
    with pytest.raises(ValueError, match="engine_kwargs.max_num_seq is not a vLLM EngineArgs "
                                         "field; did you mean max_num_seqs"):
        vllm_kwargs.check_engine_kwargs({"max_num_seq": 8})


class _Marker:
    """A name of the module an annotation is resolved in."""


@pytest.mark.parametrize("text, expected", [
    ("int | None", int | None), ("'int | None'", int | None), ("None", None),
    ("dict[str, Any] | _Marker", dict[str, typing.Any] | _Marker),
    ("Literal['a', 'b']", typing.Literal["a", "b"]), ("Optional[Literal['x']]",
                                                       typing.Literal["x"] | None),
    ("collections.abc.Callable[[Any], Any]",
     collections.abc.Callable[[typing.Any], typing.Any]),
])
def test_a_string_annotation_resolves_to_the_type_it_names(text, expected):
    namespace = {"Any": typing.Any, "Literal": typing.Literal, "Optional": typing.Optional,
                 "_Marker": _Marker, "collections": collections}
    assert resolve(text, namespace) == expected


@pytest.mark.parametrize("text", [
    "__import__('os').system('false')", "int if True else str", "(lambda: int)()",
    "Missing | None", "int.__class__", "Literal[print]", "int + str",
])
def test_an_annotation_that_would_run_code_or_names_nothing_is_refused(text, monkeypatch):
    ran = []
    namespace = {"Literal": typing.Literal, "print": lambda *a: ran.append(a)}
    with pytest.raises(ValueError):
        resolve(text, namespace)
    assert not ran
