"""Shared fixtures: tiny models on disk and job specs that use them."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import yaml


def pytest_configure(config):
    """Under xdist, the cores shared among the workers' torch: two workers of two threads on
    two cores oversubscribe them, and an engine test then takes 10x longer (OpenMP's threads
    wait for a core). Ray's actors set their own threads (generator.threads).

    Every Ray node the tests start (in this process, in the runs it starts, in their
    clusters) starts a worker when a task or actor needs one, not ahead of need: Ray's
    prestarted workers were 127 processes in a suite that none used, 11% of its CPU
    (docs/testing.md, "Timings"). A run's behaviour does not depend on them."""
    for flag in ("RAY_enable_worker_prestart", "RAY_prestart_worker_first_driver"):
        os.environ.setdefault(flag, "0")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, vLLM, Ray: about 600,000 objects) stays
    for the whole session: frozen out of the collector's reach, the full collections the
    tests trigger no longer walk it (docs/testing.md, "Timings")."""
    gc.freeze()


def pytest_unconfigure(config):
    """Collectable again for the interpreter's own end, which would otherwise leave it and
    have triton's bindings report it leaked."""
    gc.unfreeze()


@pytest.fixture(scope="module")
def ray_cluster():
    """The test process's local Ray cluster, shared by every module that needs Ray but does not
    test Ray's own start or loss (docs/testing.md). It is started as a run starts its own: a
    new cluster on loopback only, never one a `ray start` left on this machine; 4 logical CPUs
    place a generator and its rewards. Started on first use, and again after a module that owns
    its cluster (test_elastic, test_tensor_parallel) shut it down; it ends with the process.
    Runs in it are apart by their output folders and their actors' unique names; each test
    that used it must leave no actor holding its CPUs (checked after the test)."""
    from tests.helpers.shared_ray import ensure_shared_ray

    ensure_shared_ray()
    yield


@pytest.fixture(autouse=True)
def _nothing_left_in_the_shared_cluster(request):
    """A test on the shared cluster leaves nothing running in it: every CPU is free again."""
    yield
    if "ray_cluster" in request.fixturenames:
        from tests.helpers.shared_ray import assert_idle

        assert_idle(request.node.nodeid)


VLLM_FIXTURES = {"vllm_lm", "small_llm", "vllm_dir", "vllm_bench"}  # vLLM engines
SLOW_FIXTURES = VLLM_FIXTURES | {
    "ray_cluster", "gpu_cluster", "make_cluster", "ray_head",  # Ray clusters
    "s3",  # moto's S3 server
    "converted",  # the packaged SmolLM2, converted from GGUF (30 s)
}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups given here
def pytest_collection_modifyitems(config, items):
    """The tiers and the order of the parallel run (docs/testing.md).

    `slow` marks every test that pays for a Ray cluster, a subprocess, a vLLM engine, a
    trainer or an object-store server; `make check` runs the rest. A test is slow by its `ray`
    mark, by a fixture that starts one of those, or by its own `slow` mark.

    Under `--dist loadgroup` an xdist_group runs whole on one worker: the vLLM tests share
    one (vLLM's parallel state is global to a process: one engine a worker), the tests that own
    whole Ray clusters share another (nodes of their own, `ray start`, the chaos harness: they
    would compete for default ports and both cores), and every other module with a slow test
    is a group of its own, so its module fixtures (a reference run, a server) are paid once.
    The groups go first, the longest kinds first, so that no worker is left with a long group
    while the other idles."""
    for item in items:
        if (item.get_closest_marker("ray") or SLOW_FIXTURES & set(item.fixturenames)
                or _starts_vllm(item)):
            item.add_marker(pytest.mark.slow)
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item, slow_modules)))
    items.sort(key=lambda item: _order(item, slow_modules))  # stable: a module's order kept


def _order(item, slow_modules: set[str]) -> int:
    """The shared groups first, then the other slow modules, then the fast tests."""
    if item.get_closest_marker("xdist_group").args[0] in FIRST:
        return 0
    return 1 if item.module.__name__ in slow_modules else 2


def _xdist_group(item, slow_modules: set[str]) -> str:
    module = item.module.__name__
    name = module.rsplit(".", 1)[-1]
    if _starts_vllm(item) or name.startswith("test_vllm"):
        return "vllm"
    if name in OWN_CLUSTER_MODULES:
        return "own-cluster"
    # a fast module's tests spread over the workers one by one
    return name if module in slow_modules else f"{name}::{item.name}"


def _starts_vllm(item) -> bool:
    params = getattr(item, "callspec", None)
    return bool(VLLM_FIXTURES & set(item.fixturenames)) or (
        params is not None and params.params.get("backend") == "vllm")


OWN_CLUSTER_MODULES = {"test_chaos", "test_elastic", "test_tensor_parallel", "test_submit"}
FIRST = {"own-cluster", "vllm"}


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> Path:
    # Imported here: torch and transformers would load in xdist's controller too, which runs
    # no test (7 CPU-seconds beside the workers' start).
    from tests.tiny import save_tiny_lm

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
