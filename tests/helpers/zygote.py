"""`python -m MODULE ARGS` as a fork of a process that has already imported what the CLI
imports: for the tests whose subject is a process (a signal, a SIGKILL, a crash and its
resume). The child is a real process of its own (own pid, own session if asked, its own
local Ray, killed like any other), started as `python -m` starts one, minus the interpreter's
start and about 8 s of imports (torch, transformers, Ray) that every fresh interpreter pays on
this machine (docs/testing.md). The children's parent is the zygote, not the test: the exit
code comes back over the zygote's socket, so `Forked` looks like a `subprocess.Popen`.

A command falls back to a fresh interpreter (`launch` returns a real Popen) where a fork
could differ from one: a command that is not `python -m`, an environment that differs from
the zygote's in a variable read at import time (PYTHON*, HF_*, TORCH*, OMP_*, ...), or no
zygote (SPECREJ_TEST_ZYGOTE=0).

A second zygote forks the Ray workers of the clusters a test process and its children start
(tests/helpers/ray_worker.py).

Its hooks into Ray and the interpreter, and the lists of environment variables read at import,
are tests/helpers/zygote_hooks.py's, each checked before use: where one is missing the suite
runs without it (Ray's own workers, or fresh interpreters), with one warning line.

    python -m tests.helpers.zygote SOCKET cli|workers   (started by `launch`, once a process)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from tests.helpers import zygote_hooks
from tests.helpers.ray_worker import SOCKET_ENV, use_forked_workers
from tests.helpers.zygote_hooks import AT_IMPORT, PER_WORKER

REPO = Path(__file__).resolve().parents[2]
# What a CLI process imports before its first line and on its way to Ray: the children
# inherit it. Nothing here may start work (threads, Ray, a model).
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "ray",
           "pyarrow.parquet", "specrej_ray.cli", "specrej_ray.distributed.driver",
           "specrej_ray.job.prepare", "specrej_ray.models.weights_check",
           "specrej_ray.iterate.loop", "tests.helpers.crash", "tests.helpers.zygote_preloaded")
# What a Ray worker imports on its way to being a run's actor, but Ray itself: importing
# Ray's core extension module reads Ray's internal flags from the environment for good (the
# worker's job id, its raylet's pid), and those are the worker's own.
PRELOAD_WORKERS = ("torch", "transformers", "transformers.models.llama.modeling_llama",
                   "pyarrow.parquet", "specrej_ray.job.engines", "specrej_ray.engine.hf.engine",
                   "specrej_ray.models.loader", "specrej_ray.reward.classifier",
                   "specrej_ray.reward.likelihood", "specrej_ray.reward.callable",
                   "specrej_ray.quality.calibrate", "specrej_ray.quality.audit",
                   "specrej_ray.train.job")
MAX_REQUEST = 1 << 20


# -- the zygote ---------------------------------------------------------------------------

def serve(path: str, kind: str) -> int:
    """Preload, then fork a child per request until the test process goes (its end of our
    stdin closes: a parent-death signal would follow the thread that started us)."""
    preloaded, start_env = _preload(PRELOAD_WORKERS if kind == "workers" else PRELOAD), dict(
        os.environ)
    missing = None
    if kind == "cli":  # the Ray nodes our children start fork their workers too
        missing = use_forked_workers(warn=False)  # the test process warns (_Zygote)
    read_later = _read_later() if kind == "workers" else ()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin.buffer, selectors.EVENT_READ, "parent")
    print("ready" if missing is None else f"ready\t{missing}", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                if not os.read(key.fd, 4096):
                    return 0
            elif key.data == "accept":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                conn = key.fileobj
                msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 4)
                sel.unregister(conn)
                if not msg:
                    conn.close()
                    continue
                request = json.loads(msg)
                if "script" in request and not same_at_import(request["env"], start_env,
                                                              read_later):
                    for fd in fds:  # a Ray worker whose imports would differ: it starts fresh
                        os.close(fd)
                    conn.send(json.dumps({"pid": None}).encode())
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    conn.close()
                    return _child(request, fds, preloaded)
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # the test may no longer listen
                    conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                conn.close()


def _preload(modules: tuple[str, ...]) -> list[tuple]:
    """Import the modules; the exit handlers those imports registered (func, args, kwargs)."""
    registered, register = [], atexit.register

    def recording(func, *args, **kwargs):
        registered.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recording
    try:
        for name in modules:
            __import__(name)
    finally:
        atexit.register = register
    return registered


def _read_later() -> tuple[str, ...]:
    """PER_WORKER, and the GPUs a worker may see where torch has no CUDA to read them at all
    (Ray hides them from the CPU-only actors of a run)."""
    import torch

    return PER_WORKER + (("CUDA_VISIBLE_DEVICES",) if torch.version.cuda is None else ())


def _preloaded_run_first(handlers: list[tuple]) -> None:
    """In a fresh interpreter the preloaded modules are imported by the command, after its
    first exit handler (specrej_ray.__main__'s `_exit_now`, which ends the process), so
    theirs run before it (Ray's shutdown among them: without it the run's raylet dies by
    SIGKILL and its agents hang). Here they were registered first: move them after the
    command's first one."""
    register = atexit.register

    def first(func, *args, **kwargs):
        atexit.register = register
        for f, _, _ in handlers:
            atexit.unregister(f)
        register(func, *args, **kwargs)
        for f, a, k in handlers:
            register(f, *a, **k)
        return func

    atexit.register = first


def _child(request: dict, fds: list[int], preloaded: list[tuple]) -> int:
    """Become the command's process; its exit code, as `python -m` (or `python SCRIPT`)
    would end with it."""
    if len(fds) > 3:  # a Ray worker's stand-in (ray_worker.py): die with it
        threading.Thread(target=_die_with, args=(fds.pop(),), daemon=True).start()
    if "script" not in request:
        _preloaded_run_first(preloaded)
    if request["new_session"]:
        os.setsid()
    elif request.get("new_group"):
        os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` has it (what is imported already stays)
    os.environ.clear()
    os.environ.update(request["env"])
    # As exec leaves them for a fresh interpreter: a signal this test process ignores stays
    # ignored (`make test &` ignores SIGINT; Python keeps an inherited SIG_IGN), the others
    # get the interpreter's defaults.
    ignored = set(request["ignored"])
    signal.signal(signal.SIGINT, signal.SIG_IGN if signal.SIGINT in ignored
                  else signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if signal.SIGTERM in ignored else signal.SIG_DFL)
    _threads_as_at_start()
    if "script" in request:
        _threads_as_ray_sets_them()
    import runpy

    try:
        if "script" in request:
            sys.argv = [request["script"], *request["argv"]]
            sys.path[0] = os.path.dirname(request["script"])
            runpy.run_path(request["script"], run_name="__main__")
        else:
            sys.argv = list(request["argv"])
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return _exit_code(e.code)
    except KeyboardInterrupt:  # as an interpreter ends on one: traceback, exit handlers, SIGINT
        traceback.print_exc()
        zygote_hooks.run_exit_handlers()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _die_with(fd: int) -> None:
    """The write end of this pipe is held by the process we stand for: when it dies, so do we."""
    while os.read(fd, 4096):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _threads_as_at_start() -> None:
    """OpenMP read OMP_NUM_THREADS when the zygote loaded torch; a Ray worker's environment
    sets its own (1, unless the task asked for more): give torch what a fresh process would."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _threads_as_ray_sets_them() -> None:
    """A Ray worker sets OMP_NUM_THREADS (the task's CPUs) before each task, whose code then
    imports torch: here torch was imported before, so give it those threads as Ray sets them.
    (Ray is this worker's own import, after its environment is set: default_worker.py's first.)"""
    zygote_hooks.on_threads_set(_threads_as_at_start)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# -- the test's side ----------------------------------------------------------------------

class Forked:
    """A child of the zygote, with what the tests use of subprocess.Popen."""

    def __init__(self, argv: list[str], pid: int, conn: socket.socket, stdout=None) -> None:
        self.args, self.pid, self._conn, self.stdout = argv, pid, conn, stdout
        self.returncode: int | None = None

    def _receive(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        try:
            msg = self._conn.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        if not msg:
            raise RuntimeError(f"the zygote went away while {self.pid} ran")
        self.returncode = json.loads(msg)["exit"]
        self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._receive(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | bytes | None, None]:
        out = self.stdout.read() if self.stdout is not None else None
        if self.stdout is not None:
            self.stdout.close()
        self.wait(timeout)
        return out, None


def forkable(argv: list[str], env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a fork of the zygote starts argv as a fresh interpreter would: `python -m`,
    in an environment the same as the zygote's in every variable read at import time."""
    return argv[:2] == [sys.executable, "-m"] and len(argv) >= 3 and same_at_import(
        env, zygote_env)


def same_at_import(env: dict[str, str], zygote_env: dict[str, str],
                   ignored: tuple[str, ...] = ()) -> bool:
    """The same as the zygote's in every variable read at import time, but the ignored ones
    (names, or their starts)."""
    changed = {k for k in env.keys() | zygote_env.keys()
               if _as_read(k, env.get(k)) != _as_read(k, zygote_env.get(k))}
    return not any(k.startswith(AT_IMPORT) and not (ignored and k.startswith(ignored))
                   for k in changed)


def _as_read(name: str, value: str | None):
    """A search path as the loader reads it: its folders in order, a repeat of one adding
    nothing (opencv's cv2 prepends its folder to LD_LIBRARY_PATH at each import, so a fresh
    interpreter's children have it twice)."""
    if name == "LD_LIBRARY_PATH" and value is not None:
        return list(dict.fromkeys(value.split(":")))
    return value


def _read_ready(line: bytes) -> bool:
    """Whether a zygote's first line says it is ready. A hook it found missing (`ready<TAB>
    what`: its children's Ray nodes then start their workers themselves) is warned of here,
    where the warning is seen."""
    ready, _, missing = line.decode().rstrip("\n").partition("\t")
    if missing:
        zygote_hooks.fall_back(missing, zygote_hooks.WORKERS_FALLBACK)
    return ready == "ready"


class _Zygote:
    """kind "cli": forks the test's `python -m` processes; "workers": the Ray workers of the
    clusters the test process and those processes start (ray_worker.py finds it by SOCKET_ENV,
    set here for every process started after it)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.dir = tempfile.mkdtemp(prefix=f"specrej-zygote-{kind}-")
        self.path = os.path.join(self.dir, "sock")
        if kind == "workers":
            os.environ[SOCKET_ENV] = self.path
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.zygote", self.path, kind], cwd=REPO,
            env=self.env, stdout=subprocess.PIPE, stdin=subprocess.PIPE)
        atexit.register(self.stop)
        if not _read_ready(self.proc.stdout.readline()):
            raise RuntimeError(f"the test zygote did not start (exit {self.proc.wait()})")

    def current(self) -> bool:
        """Alive, and (the CLI's) started in the environment the test process has now: a
        variable read at import that changed since (RAY_AUTH_MODE, set by the test's
        ray.init) would send every command to a fresh interpreter."""
        return self.proc.poll() is None and (self.kind == "workers" or same_at_import(
            {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, self.env))

    def can_run(self, argv: list[str], env: dict[str, str]) -> bool:
        return self.proc.poll() is None and forkable(argv, env, self.env)

    def fork(self, argv: list[str], cwd, env: dict[str, str], stdout, stderr,
             new_session: bool, text: bool) -> Forked:
        fds, mine = [], None
        for i, f in enumerate((subprocess.DEVNULL, stdout, stderr)):
            if f == subprocess.PIPE:
                r, w = os.pipe()
                mine = os.fdopen(r, "r" if text else "rb")
                fds.append(w)
            elif f == subprocess.STDOUT:
                fds.append(os.dup(fds[1]))
            elif f == subprocess.DEVNULL:
                fds.append(os.open(os.devnull, os.O_RDWR))
            else:
                fds.append(os.dup(f if isinstance(f, int) else
                                  (f.fileno() if f is not None else i)))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            # An environment taken before the zygotes started still finds the workers' one.
            env = {**env, SOCKET_ENV: os.environ[SOCKET_ENV]} if SOCKET_ENV in os.environ else env
            request = {"argv": argv[2:], "cwd": str(cwd), "env": env, "new_session": new_session,
                       "ignored": [int(s) for s in (signal.SIGINT, signal.SIGTERM)
                                   if signal.getsignal(s) == signal.SIG_IGN]}
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
        finally:
            for fd in fds:
                os.close(fd)
        pid = json.loads(conn.recv(4096))["pid"]
        return Forked(argv, pid, conn, mine)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self.dir)


_zygotes: dict[str, _Zygote] = {}
_starting = threading.Lock()  # tests launch from threads too (runs side by side)


def _get(kinds: tuple[str, ...] = ("workers", "cli")) -> _Zygote | None:
    """This process's zygotes of these kinds, started if need be; the last one (none where
    SPECREJ_TEST_ZYGOTE=0, or the CLI's where a hook it needs is missing)."""
    if os.environ.get("SPECREJ_TEST_ZYGOTE", "1") == "0":
        return None
    if kinds[-1] == "cli" and (missing := zygote_hooks.exit_hook_missing()):
        zygote_hooks.fall_back(missing, zygote_hooks.COMMANDS_FALLBACK)
        return None
    with _starting:
        for kind in kinds:
            if kind == "workers" and kind not in _zygotes and _inherited_workers_zygote():
                continue
            if kind not in _zygotes or not _zygotes[kind].current():
                _zygotes[kind] = _Zygote(kind)  # one it replaces serves its children still
        return _zygotes.get(kinds[-1])


def _inherited_workers_zygote() -> bool:
    """Whether this process (a fork of the test's zygote: bench/chaos.py under its test) has
    its test process's zygote of Ray's workers to ask: its nodes' workers fork from that."""
    return os.path.exists(os.environ.get(SOCKET_ENV, ""))


def start_workers() -> None:
    """Start the zygote of Ray's workers now, if it is on: before a Ray node whose workers
    should be forks starts (tests/helpers/ray_worker.py)."""
    _get(("workers",))


def launch(argv: list[str], *, cwd=REPO, env: dict[str, str] | None = None, stdout=None,
           stderr=None, start_new_session: bool = False, text: bool = False,
           fork: bool = True):
    """subprocess.Popen(argv, ...), as a fork of the zygote where that is the same (fork=False:
    a fresh interpreter, for a test about the seconds of its imports)."""
    zygote = _get() if fork else None
    env = dict(os.environ) if env is None else env
    if zygote is not None and zygote.can_run(argv, env):
        return zygote.fork(argv, cwd, env, stdout, stderr, start_new_session, text)
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                            start_new_session=start_new_session, text=text)


def run(argv: list[str], *, cwd=REPO, env: dict[str, str] | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, ...), through `launch`."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = launch(argv, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2]))
