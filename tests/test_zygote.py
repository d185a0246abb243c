"""The test zygote (tests/helpers/zygote.py) starts a command as a fresh interpreter would:
the tests that stop, kill and resume runs rely on its children being real processes that
behave like `python -m`, and on it falling back to one where a fork could differ."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ray_worker, zygote, zygote_hooks
from tests.helpers.runs import cli_env

PROBE = [sys.executable, "-m", "tests.helpers.zygote_probe"]


def _both(args: list[str], **kw) -> tuple[subprocess.CompletedProcess, ...]:
    env = {**cli_env(), "PROBE": "seen"}
    forked = zygote.run([*PROBE, *args], cwd=zygote.REPO, env=env, **kw)
    fresh = subprocess.run([*PROBE, *args], cwd=zygote.REPO, env=env, capture_output=True,
                           text=True, **kw)
    return forked, fresh


@pytest.mark.slow  # starts the zygote and fresh interpreters
@pytest.mark.parametrize("args", [["exit", "0"], ["exit", "3"], ["message"], ["raise"],
                                  ["interrupt"]], ids=lambda a: a[0] + "".join(a[1:]))
def test_a_forked_command_ends_as_a_fresh_interpreter_does(args):
    forked, fresh = _both(args, timeout=120)
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout  # argv, cwd, environment, signals, atexit
    assert "PROBE=seen" in forked.stdout
    err, want = forked.stderr.splitlines(), fresh.stderr.splitlines()
    assert err[0] == want[0] and err[-1] == want[-1]  # the traceback's frames differ


@pytest.mark.slow  # starts the zygote and fresh interpreters
def test_a_signal_the_test_process_ignores_is_ignored_by_a_forked_command_too():
    """A fresh interpreter inherits an ignored SIGINT or SIGTERM (`make test &` starts pytest
    with SIGINT ignored): a forked one must have the same, whatever the zygote had."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in before:
            signal.signal(s, signal.SIG_IGN)
        forked, fresh = _both(["exit", "0"], timeout=120)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert "sigint=1" in fresh.stdout and "sigterm=1" in fresh.stdout  # SIG_IGN
    assert forked.stdout == fresh.stdout


@pytest.mark.slow  # starts the zygote
def test_a_forked_run_has_its_own_session_and_dies_by_signal(tmp_path):
    log = tmp_path / "log"
    with open(log, "wb") as f:
        proc = zygote.launch([*PROBE, "wait"], cwd=tmp_path, env=cli_env(),
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    assert isinstance(proc, zygote.Forked)
    deadline = time.monotonic() + 60
    while "own_session" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "own_session=True" in log.read_text() and f"cwd={tmp_path} " in log.read_text()
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_only_python_m_in_the_zygotes_environment_is_forked():
    env = {"PATH": "/bin", "RAY_ADDRESS": "x", "AWS_REGION": "a"}
    m = [sys.executable, "-m", "specrej_ray", "run", "job.yaml"]
    assert zygote.forkable(m, env, env)
    assert zygote.forkable(m, {**env, "AWS_REGION": "b", "SPECREJ_X": "1"}, env)
    assert not zygote.forkable([sys.executable, "-c", "pass"], env, env)
    assert not zygote.forkable(["ray", "start"], env, env)
    assert not zygote.forkable([sys.executable, "-m"], env, env)
    for read_at_import in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "PYTHONPATH", "RAY_DEDUP_LOGS",
                           "TRANSFORMERS_VERBOSITY", "CUDA_VISIBLE_DEVICES"):
        assert not zygote.forkable(m, {**env, read_at_import: "1"}, env), read_at_import
    assert zygote.forkable(m, {k: v for k, v in env.items() if k != "PATH"}, env)
    # a library folder given twice is the same search path; another folder is not
    libs = {**env, "LD_LIBRARY_PATH": "/a/lib:"}
    assert zygote.forkable(m, {**env, "LD_LIBRARY_PATH": "/a/lib:/a/lib:"}, libs)
    assert not zygote.forkable(m, {**env, "LD_LIBRARY_PATH": "/b/lib:/a/lib:"}, libs)
    assert not zygote.forkable(m, env, libs)


# -- the hooks (tests/helpers/zygote_hooks.py) ------------------------------------------------

@pytest.fixture
def ray_params(monkeypatch):
    """Ray's RayParams as this process had it before any hook: Ray's own __init__, the hooks
    unchecked and no warning given (all put back after the test)."""
    from ray._private import parameter

    init = parameter.RayParams.__init__
    monkeypatch.setattr(parameter.RayParams, "__init__", getattr(init, "__wrapped__", init))
    monkeypatch.setattr(zygote_hooks, "_warned", set())
    monkeypatch.setenv(ray_worker.SOCKET_ENV, "/nonexistent/workers-zygote")  # one is there
    zygote_hooks.worker_hooks_missing.cache_clear()
    yield parameter.RayParams
    zygote_hooks.worker_hooks_missing.cache_clear()


def test_with_every_hook_there_a_ray_node_runs_the_forking_stand_in(ray_params):
    assert ray_worker.use_forked_workers() is None
    assert ray_params().worker_path == os.path.abspath(ray_worker.__file__)
    assert os.path.isfile(zygote_hooks.default_worker())


@pytest.mark.parametrize("hook", ["default_worker", "worker_path", "threads"])
def test_a_missing_ray_hook_leaves_rays_own_workers_with_one_warning_line(ray_params,
                                                                          monkeypatch, hook):
    import ray
    from ray._private import utils

    if hook == "default_worker":
        monkeypatch.setattr(zygote_hooks, "default_worker", lambda: "/nowhere/default_worker.py")
    elif hook == "worker_path":  # a RayParams that takes no worker_path
        monkeypatch.setattr(ray_params, "__init__", lambda self, **kwargs: None)
    else:
        monkeypatch.delattr(utils, zygote_hooks.THREADS_HOOK)
    with pytest.warns(zygote_hooks.HookMissing) as warned:
        assert ray_worker.use_forked_workers() is not None
        assert ray_worker.use_forked_workers() is not None
    assert len(warned) == 1
    line = str(warned[0].message)
    assert "\n" not in line and line.startswith(f"Ray {ray.__version__}: ")
    assert line.endswith(zygote_hooks.WORKERS_FALLBACK)
    assert not getattr(ray_params.__init__, "forks_workers", False)  # Ray's own worker start
    if hook != "worker_path":
        assert ray_params().worker_path is None  # the node fills in default_worker.py


def test_a_hook_the_cli_zygote_found_missing_is_warned_of_once_in_the_test_process(
        monkeypatch):
    monkeypatch.setattr(zygote_hooks, "_warned", set())
    with pytest.warns(zygote_hooks.HookMissing) as warned:
        assert zygote._read_ready(b"ready\tRay 9.9.9: x is missing\n")
        assert zygote._read_ready(b"ready\tRay 9.9.9: x is missing\n")
    assert [str(w.message) for w in warned] == [
        f"Ray 9.9.9: x is missing; {zygote_hooks.WORKERS_FALLBACK}"]
    assert zygote._read_ready(b"ready\n") and not zygote._read_ready(b"")


def test_without_the_exit_hook_commands_run_in_fresh_interpreters_with_one_warning_line(
        monkeypatch):
    import atexit

    monkeypatch.setattr(zygote_hooks, "_warned", set())
    monkeypatch.setattr(zygote, "_zygotes", {})
    monkeypatch.delattr(atexit, "_run_exitfuncs")
    with pytest.warns(zygote_hooks.HookMissing) as warned:
        assert zygote._get() is None and zygote._get() is None
    assert len(warned) == 1 and str(warned[0].message).endswith(
        f"atexit._run_exitfuncs is missing; {zygote_hooks.COMMANDS_FALLBACK}")
    assert zygote._zygotes == {}  # nothing started
