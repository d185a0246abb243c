"""Shared fixtures: tiny models on disk and job specs that use them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.tiny import save_tiny_lm


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module, started as a run starts its own: a new
    cluster on loopback only (never one a `ray start` left on this machine); 4 logical CPUs
    place a generator and its rewards."""
    import ray

    from specrej_ray.distributed.local_ray import start_local_ray

    start_local_ray(num_cpus=4, num_gpus=None)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> Path:
    return save_tiny_lm(tmp_path_factory.mktemp("models") / "tiny-lm")


@pytest.fixture(scope="session")
def lm(tiny_lm_dir):
    """The tiny model and its tokenizer, loaded once for the engine tests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # bench/gpu_suite.py runs the engine's tests on a GPU this way
    device = os.environ.get("SPECREJ_TEST_DEVICE", "cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval().to(device)
    return model, AutoTokenizer.from_pretrained(tiny_lm_dir)


def text_score(responses: list[str]) -> list[list[float]]:
    """A deterministic reward that depends on the whole text (one reward: rows of one)."""
    return [[(sum(map(ord, r)) % 101) / 101] for r in responses]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_job(tmp_path: Path, model_dir: Path, prompts: Path, **sections) -> dict:
    """A small, fast job spec dict on the tiny model; sections override whole keys."""
    job = {
        "name": "tiny",
        "prompts": {"path": str(prompts), "id_field": "id"},
        "generator": {"model": str(model_dir), "threads": 1,
                      "sampling": {"max_new_tokens": 12}},
        "reward": {"type": "lm_likelihood", "model": str(model_dir), "threads": 1},
        "search": {"n": 6, "alpha": 0.5, "schedule": {"tokens": [4, 8]}},
        "cluster": {"shard_size": 2},
        "output": {"path": str(tmp_path / "out")},
    }
    for key, value in sections.items():
        job[key] = value
    return job


def write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path
