"""SIGTERM and SIGINT stop `specrej-ray run` cleanly: finished shards are kept and written
out, the invocation is recorded as interrupted, the exit code is the terminated process's,
and a resume gives the dataset of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specrej_ray.distributed.driver import run_job
from specrej_ray.job.interrupt import Interrupt, Interrupted, exit_code, handling_signals
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import (
    REPO,
    alive,
    cli,
    dataset_rows,
    descendants,
    finished_shards,
    shard_records,
    start_run,
    wait_for,
)

FAULTS = {"type": "callable", "function": "tests.helpers.faults:score"}

# --- the handlers alone (no Ray) ---------------------------------------------------------


def test_a_signal_before_defer_raises_at_once_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as caught, handling_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # never reached: the handler raises as soon as the signal lands
    assert caught.value.signum == signal.SIGTERM and str(caught.value) == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_error_that_took_the_place_of_the_stop_is_the_stop():
    """A SIGTERM that lands inside numpy's C import became an ImportError there, and the
    command exited 1 with a traceback instead of 143 (seen in make test)."""
    with pytest.raises(Interrupted) as caught, handling_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # never reached
        except Interrupted:
            raise ImportError("PyCapsule_Import could not import module") from None
    assert caught.value.signum == signal.SIGTERM
    assert isinstance(caught.value.__cause__, ImportError)


def test_an_error_after_a_deferred_signal_stays_that_error():
    with pytest.raises(ValueError), handling_signals() as stop:
        stop.defer()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and not stop.raised
        raise ValueError("a bug while writing what is finished")


def test_after_defer_a_signal_only_sets_the_flag():
    with handling_signals() as stop:
        stop.defer()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGINT
        with pytest.raises(Interrupted):
            stop.check()


def test_at_once_raises_even_after_defer_and_defers_again_after():
    """Ray's start and the start-up's other slow steps are cut short by a stop (it waited
    for them: 15-23 s for Ray's start on a loaded machine); the shard loop, after, polls."""
    with handling_signals() as stop:
        stop.defer()
        with pytest.raises(Interrupted), stop.at_once():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # never reached
        assert stop.signum == signal.SIGTERM
    with handling_signals() as stop:
        stop.defer()
        with stop.at_once():
            pass
        stop._handle(signal.SIGINT, None)  # deferred again: the flag only
        assert stop.requested
        with pytest.raises(Interrupted):  # one that came before the block raises on entry
            stop.at_once().__enter__()


class _SignalledOnCollection:
    """Sends SIGTERM from its __del__ and runs Python code after: the handler's Interrupted
    lands where Python cannot pass it on (as in an at-fork hook while Ray forks)."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))  # the handler runs here, inside __del__


def test_a_signal_in_a_callback_python_cannot_raise_from_is_delivered_again(capfd):
    """It was printed as `Exception ignored in: <function _releaseLock>` with a traceback,
    and Ray's start went on to the end."""
    with handling_signals() as stop:
        stop.defer()
        with pytest.raises(Interrupted) as caught, stop.at_once():
            _SignalledOnCollection()  # collected at once
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # ordinary code: delivered again here
                pass
            raise AssertionError("the stop was swallowed")
        assert caught.value.signum == signal.SIGTERM and not stop._again
    assert capfd.readouterr().err == ""  # no "Exception ignored" traceback


def test_a_signal_while_the_models_resolve_stops_the_run_at_once(tmp_path, tiny_lm_dir,
                                                                  monkeypatch):
    """The start-up's slow steps (a .gguf converted, weights hashed, a million prompts
    tokenized) are cut short, not finished first: the flag was checked only after each."""
    from specrej_ray.job import preflight

    quick = preflight.resolve_generator

    def converting(spec, convert=True, build=True):
        if not convert:  # the quick look at the model's files, before the output's checks
            return quick(spec, convert=False, build=build)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # what a conversion does meanwhile; never reached
        raise AssertionError("the stop waited for the model to resolve")

    monkeypatch.setattr(preflight, "resolve_generator", converting)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    spec = validate_spec(tiny_job(tmp_path, tiny_lm_dir, prompts))
    with handling_signals() as stop:
        stop.defer()  # as `run` has it
        with pytest.raises(Interrupted):
            run_job(spec, echo=lambda *a, **k: None, stop=stop)
    assert not (tmp_path / "out").exists()


def test_ray_init_leaves_our_handlers_in_place():
    """Ray sets its SIGTERM handlers (sys.exit) through one function while it starts: inside
    connect_ray that does nothing, so a scheduler's SIGTERM then is our clean stop."""
    import ray

    from specrej_ray.distributed.cluster import _ray_keeps_our_handlers

    with handling_signals():
        ours = signal.getsignal(signal.SIGTERM)
        with _ray_keeps_our_handlers():
            ray._private.utils.set_sigterm_handler(lambda *a: sys.exit(15))
            assert signal.getsignal(signal.SIGTERM) == ours
            # nor does the driver's core worker put absl's stack dump in front of ours
            assert ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
        ray._private.utils.set_sigterm_handler(lambda *a: None)  # restored after the start
        assert signal.getsignal(signal.SIGTERM) != ours


def test_a_signal_once_the_command_is_done_is_ignored_while_the_process_exits():
    """After the command, Ray's atexit shutdown still runs: a SIGINT there was a
    KeyboardInterrupt traceback from inside Ray (found by test_signal_property.py). It is
    ignored now; a second one would end the process at once with the command's code."""
    from specrej_ray.__main__ import _done

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _done(0)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt here
        time.sleep(0.05)
        after_first = signal.getsignal(signal.SIGINT)
        assert after_first is not saved[signal.SIGINT] and callable(after_first)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@pytest.mark.slow  # a process of its own, ended by the command's last exit handler
def test_the_process_ends_with_the_commands_code_once_its_exit_handlers_ran():
    """The interpreter's teardown after the command (3 s here) put SIGTERM back to the OS's
    default first: a signal then killed a finished run with -15 (test_signal_property.py,
    in CI). The process ends at the last exit handler now: one registered before the command
    ran never runs, and the code is the command's (argparse's 2 here)."""
    code = textwrap.dedent("""
        import atexit, sys
        atexit.register(lambda: print("interpreter teardown reached", flush=True))
        sys.argv = ["specrej-ray", "run"]  # no job: a usage error
        from specrej_ray.__main__ import main
        sys.exit(main())
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "the following arguments are required: job" in done.stderr
    assert "teardown reached" not in done.stdout


@pytest.mark.slow  # a process of its own, ended by the command's last exit handler
def test_a_stop_prints_no_traceback_from_a_thread_that_fails_as_ray_ends():
    """A stop ends the run's Ray processes; Ray's log printer, a thread of the driver's, then
    failed on its cut calls with a traceback after the stop line (RpcError 'Cancelling all
    calls'; test_signal_property.py, 2026-11-29). The stop line is all the user sees of it;
    another thread's error still shows."""
    code = textwrap.dedent("""
        import signal, sys, threading
        import specrej_ray.__main__ as entry
        import specrej_ray.cli
        from specrej_ray.job.interrupt import Interrupted

        from ray.exceptions import RpcError

        ending = threading.Event()
        def log_printer():
            ending.wait()
            raise RpcError("Cancelling all calls")
        def our_thread():
            ending.wait()
            raise ValueError("a thread of ours that broke")
        threads = [threading.Thread(target=log_printer, name="ray_print_logs", daemon=True),
                   threading.Thread(target=our_thread, name="ours", daemon=True)]
        for t in threads:
            t.start()

        def command():
            raise Interrupted(signal.SIGTERM)
        def end_descendants(grace):
            ending.set()
            for t in threads:
                t.join()
        specrej_ray.cli.main = command
        entry.end_descendants = end_descendants
        sys.exit(entry.main())
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    stop_line, *rest = done.stderr.splitlines()
    assert stop_line == "specrej-ray: stopped by SIGTERM; run the same command again to resume"
    assert "RpcError" not in done.stderr and "ray_print_logs" not in done.stderr
    # An error that is not Ray's still shows, as it would without a stop.
    assert "Exception in thread ours" in rest[0] and "a thread of ours that broke" in rest[-1]


def test_reinstall_puts_the_handlers_back_only_where_they_were_installed():
    bare = Interrupt()
    bare.reinstall()  # never installed: leaves the process's handlers alone
    assert signal.getsignal(signal.SIGTERM) is not bare._handle
    with handling_signals() as stop:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what ray.init does, in effect
        stop.reinstall()
        assert signal.getsignal(signal.SIGTERM) == stop._handle


@pytest.mark.slow  # a process of its own, to be signalled
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once_with_the_code_of_the_first(signum):
    code = textwrap.dedent(f"""
        import os, time
        from specrej_ray.job.interrupt import Interrupt
        stop = Interrupt().install()
        stop.defer()
        os.kill(os.getpid(), {int(signum)})
        os.kill(os.getpid(), {int(signum)})
        time.sleep(30)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == exit_code(signum) == {15: 143, 2: 130}[int(signum)]
    assert done.stderr == f"specrej-ray: second {signal.Signals(signum).name}; exiting now\n"


# --- the CLI, stopped --------------------------------------------------------------------


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for signum (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


def _stop_line(name: str, out: Path) -> str:
    return (f"specrej-ray: stopped by {name}; finished shards are kept in {out}: "
            "run the same command again to resume")


@pytest.mark.slow  # the CLI's own process, signalled
def test_sigterm_before_ray_started_exits_143(tmp_path, tiny_lm_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    job_path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir, prompts))
    log = tmp_path / "run.log"
    # A fresh interpreter: its seconds of imports, between the first line and Ray, are the
    # window this test signals in (a fork of the test zygote has them done).
    proc = start_run(job_path, log, fork=False)
    # SIGTERM is caught from the moment `run` installs its handlers; Ray starts seconds later.
    wait_for(lambda: _catches(proc.pid, signal.SIGTERM), proc, log, "SIGTERM was caught")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    text = log.read_text()
    assert "Started a local Ray instance" not in text
    # Caught from the command's first line (specrej_ray/__main__.py), before `run` itself.
    assert "specrej-ray: stopped by SIGTERM;" in text
    assert "Traceback" not in text
    assert not (tmp_path / "out").exists()  # the folder the run made is gone again


@pytest.mark.ray
def test_sigint_while_the_actors_load_stops_at_once(tmp_path, tiny_lm_dir):
    """A reward actor that would take two minutes to load: the stop must not wait for it
    (it waited for every actor to answer, about 10 s with real models)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    slow = {"type": "callable", "function": "tests.helpers.slow_start:score"}
    job_path = write_job(tmp_path / "job.yaml",
                         tiny_job(tmp_path, tiny_lm_dir, prompts, reward=slow))
    log = tmp_path / "run.log"
    proc = start_run(job_path, log)
    try:
        wait_for(lambda: "Started a local Ray instance" in log.read_text(), proc, log,
                 "Ray started", limit_s=120)
        time.sleep(1.0)  # the actors are being created and load their models
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "stopped by SIGINT" in log.read_text(), proc, log, "the stop line",
                 limit_s=60)
        acted_in = time.monotonic() - sent
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"\nSIGINT during start-up: stop line after {acted_in:.2f} s")
    # Issue 24 asks for 2 s (0.4 s measured); 10 leaves room for a loaded CI machine and
    # still fails a stop that waits for the loading reward (two minutes).
    assert acted_in < 10, log.read_text()
    assert "Traceback" not in log.read_text()
    assert not (tmp_path / "out").exists()  # no prompt had finished: nothing is left


@pytest.fixture(scope="module")
def held_job(tmp_path_factory, tiny_lm_dir, ray_cluster):
    """Five prompts; the third one's shard stays in flight until its `go` file exists. Also
    the dataset of an uninterrupted run of them (with `go` there, nothing is held)."""
    tmp = tmp_path_factory.mktemp("held")
    go = tmp / "go"
    ids = [f"q{i}" for i in range(5)]
    prompts = write_jsonl(tmp / "p.jsonl", [
        {"id": i, "prompt": f"Tell me about {i}." + (f" [hold-until:{go}]" if i == "q2" else "")}
        for i in ids])
    job = tiny_job(tmp, tiny_lm_dir, prompts, reward=FAULTS, cluster={"shard_size": 1})
    go.touch()
    run_job(validate_spec(job), echo=lambda *a, **k: None)
    go.unlink()
    return job, go, ids, dataset_rows(tmp / "out")


@pytest.mark.ray
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_keeps_finished_work_and_a_resume_matches_an_uninterrupted_run(
        tmp_path, held_job, signum):
    job, go, ids, (want_best, want_cands) = held_job
    out = tmp_path / "out"
    job_path = write_job(tmp_path / "job.yaml", dict(job, output={"path": str(out)}))
    held = Path(f"{go}.held")
    held.unlink(missing_ok=True)
    log = tmp_path / "stopped.log"
    proc = start_run(job_path, log)
    try:
        wait_for(lambda: finished_shards(out) >= 1 and held.exists(), proc, log,
                 "a shard finished and another in flight")
        tree = descendants(proc.pid)
        done_at_signal = finished_shards(out)
        signalled = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
        stopped_in = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    name = signal.Signals(signum).name
    assert code == {"SIGTERM": 143, "SIGINT": 130}[name], text
    assert _stop_line(name, out) in text  # the actors' log lines may come around it
    assert "received at time" not in text and "Traceback" not in text  # no abort dump
    # The stop does not wait for the held batch's actors to answer for their counters: it
    # waited 30 s for each (33 s here); a scheduler's grace before SIGKILL is often 30 s.
    assert stopped_in < 15, f"stopped {stopped_in:.1f} s after the signal:\n{text}"
    # The actors and the run's own Ray processes are shut down, not left behind.
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "raylet" in " ".join(tree.values())
    assert not {p: c for p, c in tree.items() if alive(p)}

    # What was finished is written out; the held shard was abandoned, never half-written.
    kept = [i for shard in shard_records(out).values() for i in shard]
    assert done_at_signal <= len(kept) < len(ids) and "q2" not in kept
    assert sorted(r["id"] for r in dataset_rows(out)[0]) == sorted(kept)
    assert not [f for f in (out / "shards").iterdir() if f.name.startswith(".")]  # no temp
    assert (out / "errors.jsonl").read_text() == ""
    info = json.loads((out / "run.json").read_text())
    assert [(i["status"], i["shards_done"], i["shards_failed"]) for i in info["invocations"]] \
        == [("interrupted", len(kept), 0)]

    go.touch()
    try:  # the resume is not what this test is about: in this process, on the shared cluster
        again = cli("run", job_path)
    finally:
        go.unlink()
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{len(kept)} already done" in again.stdout
    assert dataset_rows(out) == (want_best, want_cands)
    info = json.loads((out / "run.json").read_text())
    assert [i["status"] for i in info["invocations"]] == ["interrupted", "completed"]
