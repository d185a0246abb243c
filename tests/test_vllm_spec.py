"""generator.engine / generator.vllm: validation (one line per bad key) and the EngineArgs a
spec makes (engine/vllm/build.engine_args, pure: no vLLM engine starts here)."""

from __future__ import annotations

import importlib.util

import pytest

from specrej_ray.engine.vllm.build import GIB, engine_args
from specrej_ray.job.engines import pick_backend
from specrej_ray.spec import SpecError, validate_spec
from specrej_ray.spec.vllm_kwargs import check_engine_kwargs
from tests.conftest import tiny_job

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def spec(tmp_path, **generator):
    job = tiny_job(tmp_path, tmp_path / "m", tmp_path / "p.jsonl")
    job["generator"].update(generator)
    return validate_spec(job)


def test_cpu_sizes_the_cache_from_kv_budget_and_gpu_from_utilization(tmp_path):
    s = spec(tmp_path, engine="vllm")
    cpu = engine_args(s, "/m", on_gpu=False)
    assert cpu["kv_cache_memory_bytes"] == int(s.search.kv_budget_gb * GIB)
    assert "gpu_memory_utilization" not in cpu and cpu["dtype"] == "float32"
    gpu = engine_args(s, "/m", on_gpu=True)
    assert gpu["gpu_memory_utilization"] == s.search.gpu_memory_utilization
    assert gpu["dtype"] == "bfloat16" and "kv_cache_memory_bytes" not in gpu
    assert gpu["enable_prefix_caching"] and gpu["logprobs_mode"] == "raw_logprobs"
    assert gpu["logits_processors"] == ["specrej_ray.engine.vllm.candidate_sampler:"
                                        "CandidateSampler"]
    assert "distributed_executor_backend" not in gpu


def test_cpu_blocks_are_small_enough_to_share_a_prompt_unless_the_spec_says(tmp_path):
    """vLLM's CPU default block (128 tokens) is longer than most prompts, so its prefix cache
    would share none; a GPU keeps vLLM's own default; engine_kwargs has the last word."""
    s = spec(tmp_path, engine="vllm")
    assert engine_args(s, "/m", on_gpu=False)["block_size"] == 32
    assert "block_size" not in engine_args(s, "/m", on_gpu=True)
    s = spec(tmp_path, engine="vllm", vllm={"engine_kwargs": {"block_size": 64}})
    assert engine_args(s, "/m", on_gpu=False)["block_size"] == 64


def test_the_spec_options_reach_engine_args(tmp_path):
    s = spec(tmp_path, engine="vllm", dtype="float16", tensor_parallel_size=2,
             vllm={"gpu_memory_utilization": 0.7, "max_model_len": 2048, "enforce_eager": True,
                   "quantization": "fp8", "kv_cache_dtype": "fp8",
                   "engine_kwargs": {"max_num_seqs": 512}})
    a = engine_args(s, "/m", on_gpu=True)
    assert {k: a[k] for k in ("gpu_memory_utilization", "max_model_len", "enforce_eager",
                              "quantization", "kv_cache_dtype", "tensor_parallel_size",
                              "distributed_executor_backend", "dtype", "max_num_seqs")} == {
        "gpu_memory_utilization": 0.7, "max_model_len": 2048, "enforce_eager": True,
        "quantization": "fp8", "kv_cache_dtype": "fp8", "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray", "dtype": "float16", "max_num_seqs": 512}


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"max_model_len": 10}, "engine_kwargs.max_model_len: set generator.vllm.max_model_len"),
    ({"seed": 1}, "engine_kwargs.seed: set seed instead"),
    ({"logits_processors": []}, "engine_kwargs.logits_processors: specrej-ray sets it"),
])
def test_keys_the_job_sets_are_refused_in_one_line(tmp_path, kwargs, expected):
    with pytest.raises(SpecError, match=expected) as info:
        spec(tmp_path, engine="vllm", vllm={"engine_kwargs": kwargs})
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make setup installs it)")
def test_an_unknown_engine_kwarg_gets_did_you_mean(tmp_path):
    with pytest.raises(SpecError, match="engine_kwargs.max_num_seq is not a vLLM EngineArgs "
                                        "field; did you mean max_num_seqs"):
        spec(tmp_path, engine="vllm", vllm={"engine_kwargs": {"max_num_seq": 8}})


def test_engine_kwargs_check_without_vllm_checks_our_keys_only(monkeypatch):
    from specrej_ray.spec import vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "engine_arg_names", lambda: None)  # a driver without vLLM
    check_engine_kwargs({"anything": 1})
    with pytest.raises(ValueError, match="engine_kwargs.seed: set seed instead"):
        check_engine_kwargs({"seed": 1})
    with pytest.raises(ValueError, match="not a vLLM EngineArgs field"):
        check_engine_kwargs({"bogus": 1}, names={"max_num_seqs"})
    check_engine_kwargs({"max_num_seqs": 1}, names={"max_num_seqs"})


@pytest.mark.parametrize(("setting", "gpu", "installed", "picked"), [
    ("auto", True, True, "vllm"), ("auto", False, True, "hf"), ("auto", True, False, "hf"),
    ("hf", True, True, "hf"), ("vllm", False, True, "vllm")])
def test_auto_picks_vllm_with_a_gpu_where_it_is_installed(monkeypatch, setting, gpu, installed,
                                                         picked):
    from specrej_ray.job import engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: installed)
    assert pick_backend(setting, gpu) == picked


def test_bad_engine_settings_are_one_line(tmp_path):
    with pytest.raises(SpecError, match="generator.engine"):
        spec(tmp_path, engine="tgi")
    with pytest.raises(SpecError, match="generator.vllm.enforce_eagr"):
        spec(tmp_path, vllm={"enforce_eagr": True})
