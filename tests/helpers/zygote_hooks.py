"""Every hook of the test zygote (zygote.py, ray_worker.py) into Ray and the interpreter, in
one place, each checked before it is used.

- Ray's worker command. A node starts every worker as `python default_worker.py ARGS`, the
  file in Ray's own package (`default_worker`), unless RayParams.worker_path names another;
  RayParams.__init__ is wrapped so that the nodes a process starts run ray_worker.py instead
  (`fork_workers`), which has the worker zygote fork default_worker.py.
- The function a Ray worker sets OMP_NUM_THREADS with before each task (Ray's private
  utils.set_omp_num_threads_if_unset): a forked worker's torch read that variable when the
  zygote imported it, so the fork applies the threads too when Ray sets them
  (`on_threads_set`).
- The interpreter's exit handlers, which a forked command runs as an interpreter ends on a
  KeyboardInterrupt (`run_exit_handlers`: atexit's private _run_exitfuncs).
- The environment variables that libraries read when they are imported (AT_IMPORT), and
  those of them a Ray worker's environment sets for itself, read once it runs (PER_WORKER).
  Written for Ray 2.60, torch 2.13 and transformers 5.19: a library that starts reading
  another variable at import makes a fork differ from a fresh interpreter; review the lists
  when pyproject's bounds move.

Where a hook is missing, or no longer what it was, the suite falls back, with one warning
line (`fall_back`), to what needs no hook: Ray starts its own workers, or a command runs in a
fresh interpreter. Slower, never wrong. This module imports nothing but the standard library
when loaded: Ray's worker command (ray_worker.py) imports it.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable

# Environment variables that libraries read when they are imported: a command whose
# environment changes one of these runs in a fresh interpreter.
AT_IMPORT = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_",
             "MKL_", "KMP_", "LD_", "CUDA_", "TOKENIZERS", "RAY_")
# What a Ray worker's environment has that the worker zygote's may not, read once the worker
# runs, not at import: Ray's settings (that zygote has not imported Ray), what ray.init sets in
# the driver's environment (PYTHONBREAKPOINT), torch's default cache folder written into it,
# and the threads (zygote._threads_as_at_start).
PER_WORKER = ("RAY_", "PYTHONBREAKPOINT", "TORCHINDUCTOR_CACHE_DIR", "OMP_NUM_THREADS")
THREADS_HOOK = "set_omp_num_threads_if_unset"
WORKERS_FALLBACK = "Ray starts the tests' workers itself (slower)"
COMMANDS_FALLBACK = "the tests' commands run in fresh interpreters (slower)"


class HookMissing(UserWarning):
    """A hook of the test zygote is missing: the suite runs without it."""


_warned: set[str] = set()


def fall_back(missing: str, instead: str) -> None:
    """One warning line a process, per hook, saying what is missing and what runs instead."""
    if missing not in _warned:
        _warned.add(missing)
        warnings.warn(f"{missing}; {instead}", HookMissing, stacklevel=2)


# -- Ray's worker command ------------------------------------------------------------------

def default_worker() -> str:
    """The worker script Ray's nodes run (found without importing Ray)."""
    ray_dir = importlib.util.find_spec("ray").submodule_search_locations[0]
    return os.path.join(ray_dir, "_private", "workers", "default_worker.py")


@functools.cache
def worker_hooks_missing() -> str | None:
    """None where the hooks that fork Ray's workers are as assumed; else one line naming Ray's
    version and the hook. Imports Ray: the callers have."""
    import ray
    from ray._private import parameter, services, utils

    init = getattr(parameter.RayParams.__init__, "__wrapped__", parameter.RayParams.__init__)
    problems = (
        (not os.path.isfile(default_worker()), f"{default_worker()} is missing"),
        ("worker_path" not in inspect.signature(init).parameters,
         "RayParams takes no worker_path"),
        ("worker_path" not in inspect.signature(services.start_raylet).parameters,
         "services.start_raylet takes no worker_path"),
        (not callable(getattr(utils, THREADS_HOOK, None)),
         f"ray._private.utils.{THREADS_HOOK} is missing"),
    )
    found = next((what for missing, what in problems if missing), None)
    return None if found is None else f"Ray {ray.__version__}: {found}"


def fork_workers(stand_in: str, when: Callable[[], bool]) -> None:
    """Every Ray node this process starts from now on runs `stand_in` as its worker command
    where Ray would run its own, while `when()` holds as the node's parameters are made.
    Check worker_hooks_missing first."""
    from ray._private import parameter

    init = parameter.RayParams.__init__
    if getattr(init, "forks_workers", False):
        return

    @functools.wraps(init)  # its __wrapped__: Ray's own, which worker_hooks_missing reads
    def forking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.worker_path is None and when():
            self.worker_path = stand_in

    forking_init.forks_workers = True
    parameter.RayParams.__init__ = forking_init


def on_threads_set(apply: Callable[[], None]) -> None:
    """In a forked Ray worker: `apply()` each time Ray sets the task's OMP_NUM_THREADS."""
    import ray._private.utils
    import ray._raylet

    set_env = getattr(ray._private.utils, THREADS_HOOK)

    def set_and_apply() -> bool:
        changed = set_env()
        apply()
        return changed

    for module in (ray._private.utils, ray._raylet):  # and any module that holds it too
        if getattr(module, THREADS_HOOK, None) is set_env:
            setattr(module, THREADS_HOOK, set_and_apply)


# -- the interpreter -------------------------------------------------------------------------

def exit_hook_missing() -> str | None:
    if callable(getattr(atexit, "_run_exitfuncs", None)):
        return None
    return f"Python {sys.version.split()[0]}: atexit._run_exitfuncs is missing"


def run_exit_handlers() -> None:
    atexit._run_exitfuncs()
