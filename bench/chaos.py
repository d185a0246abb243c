"""Chaos: one job, many faults in series, from a seed; the dataset must equal a clean run's.

    python bench/chaos.py --seed 1 [--prompts 300] [--faults 30] [--store local|s3] \\
        [--json bench/results/chaos/seed-1.json]

A local Ray cluster of several nodes (ray.cluster_utils: a head and --nodes workers) runs a
job of the tiny random model: two generator actors with two shards in flight each, a pool of
two reward actors (lm_likelihood). First the job runs undisturbed (the clean run); then the
same spec runs into another output while faults are injected at random moments drawn from
the seed (a gap of --gap seconds between two, cut short when the job gets ahead, so that
every fault lands before --due-by, 90%, of the shards are written):

- driver-kill: SIGKILL of the driver, then a restart;
- driver-term: SIGTERM of the driver (it must exit 143 with what it finished written), then a
  restart;
- lease-holder-kill: SIGKILL of the driver while it writes (a temporary file is in the output),
  holding the output's lock or lease; on S3 the restart must take the stale lease over;
- disk-full: the driver's next write fails with ENOSPC (injected: bench/chaos.py arms a hook in
  the driver's filesystem layer); it must stop with one line, exit 2, keeping what finished;
- generator-kill / reward-kill: SIGKILL of a generator or reward actor's process (Ray restarts
  it; the shard or reward batch is retried);
- node-removal: a worker node is removed (a lost spot node) and a new one added;
- slow-reward: a reward actor stopped (SIGSTOP) for a few seconds, then let go;
- driver-pause: the driver stopped (SIGSTOP) while a second one starts: on a local disk the
  second must be refused; on S3, once the lease is stale, it takes it over, and the first,
  let go, must stop before its next write.

A driver that exits for a fault is restarted (a start refused because a killed holder's lease
is still fresh is retried, as an operator would). A job that got ahead of its faults all
the same (a fault's own seconds, a restart or a node replaced, count too) is held at its last
shard until they are all in: its driver does not send that shard while a gate file exists
(`held_at_last_shard` counts the drivers that waited there). After the last fault the job
runs to its end. Then the datasets are compared prompt for prompt: ids, texts, statuses and
scores (floats within 1e-5: reward batches differ), every dataset file (each top-level
parquet file: best, candidates and the training formats) but the wall-clock `seconds`
column; no prompt missing or twice, no temporary file, lock or lease left. It prints the faults
injected and survived, the restarts, the time against the clean run's and the first
difference, if any, and exits 1 when the datasets differ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402

KINDS = ("driver-kill", "driver-term", "driver-pause", "lease-holder-kill", "disk-full",
         "generator-kill", "reward-kill", "node-removal", "slow-reward")
NODE = {"num_cpus": 2}
SHARD_SIZE = 5
ARM_ENV = "SPECREJ_CHAOS_ARM"  # the file whose presence makes the driver's next write fail
HOLD_ENV = "SPECREJ_CHAOS_HOLD"  # ... whose presence makes its next write stop half-way
GATE_ENV = "SPECREJ_CHAOS_GATE"  # ... while present, the job's last shard is not sent
# The cluster's address, which the driver makes its RAY_ADDRESS: a driver's environment is
# otherwise the harness's, as a fork of the test zygote needs it (--fork-drivers).
CLUSTER_ENV = "SPECREJ_CHAOS_CLUSTER"
WRITES = ("lease-holder-kill", "disk-full")  # the faults that need the driver to write
HELD = "chaos: the last shard waits for the harness's faults"


# -- the driver, with its hooks ---------------------------------------------------------------


def driver(job: str) -> int:
    """`specrej-ray run JOB`, in this process, with a hook in the filesystem layer: while the
    file named by $SPECREJ_CHAOS_ARM exists, the next write into the output fails with ENOSPC
    after its first bytes (the file is removed: one fault, one failed write); and one in the
    shard loop (_pace)."""
    import errno

    import fsspec.implementations.local as local

    os.environ["RAY_ADDRESS"] = os.environ.pop(CLUSTER_ENV)
    arm = os.environ.get(ARM_ENV)
    hold = os.environ.get(HOLD_ENV)
    opened = local.LocalFileSystem._open

    def _open(self, path, mode="rb", **kwargs):
        f = opened(self, path, mode, **kwargs)
        if "w" not in mode and "a" not in mode:
            return f
        write = f.write
        if arm and _take(arm):
            def full(data, write=write):
                write(bytes(data)[:1])
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

            f.write = full
        elif hold and _take(hold):
            def held(data, write=write):
                write(bytes(data)[:1])
                f.flush()
                open(hold + ".writing", "w").close()  # the harness kills it now
                time.sleep(300)

            f.write = held
        return f

    local.LocalFileSystem._open = _open
    _arm_s3(arm, hold)
    _pace(os.environ.get(GATE_ENV))
    from specrej_ray.cli import main

    return main(["run", job])


def _pace(gate: str | None) -> None:
    """While the file `gate` exists, the job's last shard is not sent: the driver, its actors
    and its lock or lease stay as they are, and a stop signal is obeyed, but the job cannot
    end before the harness's faults are all in. Only a job that got ahead of its faults
    meets it (the gaps are cut short for that first): on a loaded machine the faults'
    own seconds (restarts, a node replaced) let a job end with one fault still to come."""
    if not gate:
        return
    from specrej_ray.distributed.shard_loop import ShardLoop

    dispatch = ShardLoop._dispatch

    def paced(self) -> None:
        if not self.queue or not os.path.exists(gate) or self.stop.requested:
            dispatch(self)
            return
        last = self.queue.pop()  # the others go as they would
        dispatch(self)
        self.queue.append(last)
        if self.queue != [last] or self._shards_in_flight():
            return  # the loop collects those in flight meanwhile
        print(HELD, flush=True)
        while os.path.exists(gate) and not self.stop.requested:
            time.sleep(0.2)
        dispatch(self)

    ShardLoop._dispatch = paced


def _take(flag: str) -> bool:
    """Whether the flag file was there (it is gone now: one fault, one write)."""
    try:
        os.unlink(flag)
        return True
    except FileNotFoundError:
        return False


def _arm_s3(arm: str | None, hold: str | None) -> None:
    """The same hooks for s3:// outputs, on s3fs's every request that writes: the armed
    write fails (ENOSPC) or stops before it reaches the store."""
    if not (arm or hold):
        return
    try:
        import s3fs
    except ImportError:
        return
    import asyncio
    import errno

    call = s3fs.S3FileSystem._call_s3
    writes = {"put_object", "upload_part", "copy_object", "complete_multipart_upload"}

    async def hooked(self, method, *args, **kwargs):
        if method in writes:
            if arm and _take(arm):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if hold and _take(hold):
                open(hold + ".writing", "w").close()
                await asyncio.sleep(300)
        return await call(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = hooked


# -- the job -----------------------------------------------------------------------------------


def make_job(root: Path, name: str, prompts: int, output: str, model: Path) -> Path:
    rows = [{"id": f"c{i:04d}", "prompt": f"Tell me something about the number {i}."}
            for i in range(prompts)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = {
        "name": "chaos",
        "seed": 0,
        "prompts": {"path": str(root / "prompts.jsonl"), "id_field": "id"},
        "generator": {"model": str(model), "threads": 1,
                      "sampling": {"max_new_tokens": 48}},
        "reward": {"type": "lm_likelihood", "model": str(model), "threads": 1,
                   "placement": "own", "pool_size": 2, "num_cpus": 0.5},
        "search": {"n": 8, "alpha": 0.5, "schedule": {"tokens": [8, 24]}},
        "cluster": {"generators": 2, "cpus_per_generator": 1, "shard_size": SHARD_SIZE,
                    "shards_in_flight": 2, "max_shard_retries": 1000,
                    "call_timeout_s": 120, "startup_timeout_s": 120},
        "output": {"path": output, "lease_ttl_s": 5},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


# -- processes ---------------------------------------------------------------------------------


def ray_processes(title: str, cluster) -> list[int]:
    """Live, running processes whose title starts with `title` (Ray names an actor's worker
    ray::Class) and that hold a file of one of `cluster`'s sessions open (a worker's logs):
    another Ray on this machine is never touched. Not by parent: in the tests a worker is a
    fork of a preloaded process, not the raylet's child (tests/helpers/ray_worker.py)."""
    sessions = tuple(os.path.join(node.get_session_dir_path(), "")
                     for node in cluster.list_all_nodes())
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0]
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if cmd.startswith(title.encode()) and state not in ("Z", "T") \
                    and _holds_a_file_under(name, sessions):
                found.append(int(name))
        except OSError:  # it ended while read
            continue
    return sorted(found)


def _holds_a_file_under(pid: str, folders: tuple[str, ...]) -> bool:
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):
            if os.readlink(f"{fds}/{fd}").startswith(folders):
                return True
    return False


@dataclass
class Fault:
    kind: str
    at_s: float
    detail: str = ""
    outcome: str = ""  # what happened right after
    survived: bool = False
    injected: bool = True  # False: its target was gone (the fault is drawn again)


@dataclass
class Chaos:
    args: argparse.Namespace
    job: Path
    out: str
    env: dict
    logs: Path
    cluster: object
    rng: random.Random  # the schedule: when, and which kind
    faults: list[Fault] = field(default_factory=list)
    restarts: int = 0
    refused_starts: int = 0
    proc: subprocess.Popen | None = None
    t0: float = 0.0
    arm: Path | None = None
    hold: Path | None = None
    gate: Path | None = None
    picks: random.Random = field(default_factory=random.Random)  # which actor, node, pause
    unexplained: int = 0  # driver exits in a row that no fault caused
    log: Path | None = None  # the current driver's
    starts: int = 0
    pid_start: dict = field(default_factory=dict)  # driver pid -> which start it was
    paused: list = field(default_factory=list)  # drivers stopped by driver-pause
    ttl_s: float = 5.0  # the job's output.lease_ttl_s
    launch: Callable = subprocess.Popen  # how a driver's process starts

    # -- the driver --------------------------------------------------------------------------

    def start(self) -> subprocess.Popen:
        """A new driver, with a log file of its own (logs/<name>-<n>.log)."""
        self.starts += 1
        self.log = self.logs / f"{self.job.stem}-{self.starts:03d}.log"
        with open(self.log, "wb") as f:
            self.proc = self.launch(
                [sys.executable, "-m", "bench.chaos", "driver", str(self.job)], cwd=REPO,
                env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid_start[self.proc.pid] = self.starts
        return self.proc

    def said(self, log: Path | None = None) -> str:
        """What a driver printed (the current one's by default)."""
        return (log or self.log).read_text(errors="replace")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def finished(self) -> bool:
        return self.proc is not None and self.proc.poll() == 0

    def restart_if_down(self, fault: bool = True) -> None:
        """Restart a driver that exited with an error. A start refused because a killed
        holder's lease is still fresh (exit 2, 'is in use by') is tried again a second later,
        as an operator would; a driver that keeps failing with no fault to blame ends the run
        (a bug, not chaos)."""
        while self.proc is not None and self.proc.poll() not in (None, 0):
            if self.proc.poll() == 2 and "is in use by" in self.said():
                self.refused_starts += 1
                if self.refused_starts > 300:
                    raise SystemExit(f"300 starts refused:\n{self.said()}")
                time.sleep(1.0)
                self.start()
                self.settle()
                continue
            self.unexplained = 0 if fault else self.unexplained + 1
            if self.unexplained > 3:
                raise SystemExit(f"the driver failed {self.unexplained} times with no fault "
                                 f"injected:\n{self.said()}")
            self.restarts += 1
            self.start()
            self.settle()

    def settle(self, limit_s: float = 120.0) -> None:
        """Wait until the new driver holds the output (it connects to Ray only after taking
        it) or has exited: a start that is about to be refused is no target for a fault,
        and its exit would be blamed on one."""
        end = time.monotonic() + limit_s
        while self.running() and time.monotonic() < end \
                and "Connected to Ray cluster" not in self.said():
            time.sleep(0.1)

    def stop_all(self) -> None:
        """Whatever driver is still running (the run failed): killed with its group."""
        for proc in (self.proc, *self.paused):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)

    # -- the faults --------------------------------------------------------------------------

    def inject(self, kind: str) -> Fault:
        fault = Fault(kind, time.monotonic() - self.t0)
        if kind in WRITES:  # a job held at its last shard (_pace) would write nothing more
            self.gate.unlink(missing_ok=True)
        getattr(self, "_" + kind.replace("-", "_"))(fault)
        if fault.injected:
            self.faults.append(fault)
        if len(self.faults) < self.args.faults:
            self.gate.touch()
        print(f"chaos: {fault.at_s:7.1f} s {kind:18s} {fault.detail} -> {fault.outcome}",
              flush=True)
        return fault

    def _driver_pause(self, fault: Fault) -> None:
        """The driver stopped (SIGSTOP: a frozen VM, a long GC) while a second one starts.
        On a local disk its lock still holds, so the second start must be refused; on S3 its
        lease goes stale, the second driver takes it over, and the first, let go, must stop
        before its next write."""
        old = self.proc
        os.killpg(old.pid, signal.SIGSTOP)
        from tests.helpers.runs import state

        end = time.monotonic() + 2.0
        while state(old.pid) not in ("T", "Z", "") and time.monotonic() < end:
            time.sleep(0.02)  # a signal is delivered, not obeyed at once
        if state(old.pid) != "T":  # it had just ended: nothing to pause
            os.killpg(old.pid, signal.SIGCONT)
            fault.injected, fault.outcome = False, "the driver had exited: not injected"
            return
        self.paused.append(old)
        s3 = self.out.startswith("s3://")
        pause = self.ttl_s + 2 if s3 else self.picks.uniform(2, 5)
        fault.detail = f"stopped {pause:.1f} s"
        time.sleep(pause)
        second = self.start()
        second_log = self.log
        if not s3:
            code = second.wait(60)
            refused = code == 2 and "is in use by" in self.said(second_log)
            self.proc = old
            os.killpg(old.pid, signal.SIGCONT)
            self.paused.remove(old)
            fault.outcome = "second start refused" if refused else f"second start exit {code}"
            fault.survived = refused and old.poll() in (None, 0)
            return
        end = time.monotonic() + 120
        while "taking over the stale lease" not in self.said(second_log):
            if second.poll() is not None or time.monotonic() > end:
                break
            time.sleep(0.2)
        took = "taking over the stale lease" in self.said(second_log)
        os.killpg(old.pid, signal.SIGCONT)
        self.paused.remove(old)
        try:
            code = old.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(old.pid, signal.SIGKILL)
            code = old.wait(30)
        stopped = code != 0 and ("was taken over by" in self.said(self._log_of(old))
                                 or "could not be renewed" in self.said(self._log_of(old)))
        fault.outcome = (f"{'taken over' if took else 'not taken over'}; the first driver "
                         f"exit {code}{' (stopped writing)' if stopped else ''}")
        fault.survived = took and stopped

    def _log_of(self, proc: subprocess.Popen) -> Path:
        return self.logs / f"{self.job.stem}-{self.pid_start[proc.pid]:03d}.log"

    def _driver_kill(self, fault: Fault) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait(60)
        fault.outcome, fault.survived = f"exit {code}", code == -signal.SIGKILL

    def _driver_term(self, fault: Fault) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(60)
            fault.outcome = "did not stop within 90 s: killed"
            return
        fault.outcome, fault.survived = f"exit {code}", code in (143, 0)

    def _lease_holder_kill(self, fault: Fault) -> None:
        """SIGKILL the driver in the middle of a write, holding the output's lock or lease:
        its next write stops after its first byte (the hook), and the harness kills it
        there."""
        self.hold.unlink(missing_ok=True)
        marker = Path(str(self.hold) + ".writing")
        marker.unlink(missing_ok=True)
        self.hold.touch()
        end = time.monotonic() + 60
        while time.monotonic() < end and self.running() and not marker.exists():
            time.sleep(0.02)
        self.hold.unlink(missing_ok=True)
        if not self.running():
            fault.injected, fault.outcome = False, "the driver had exited: not injected"
            return
        fault.detail = "mid-write" if marker.exists() else "no write within 60 s"
        self._driver_kill(fault)
        marker.unlink(missing_ok=True)

    def _disk_full(self, fault: Fault) -> None:
        self.arm.touch()
        try:
            code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            fault.outcome = "no write failed within 90 s"
            self.arm.unlink(missing_ok=True)
            return
        said = self.said()
        errors = [ln for ln in said.splitlines() if ln.startswith("specrej-ray: error:")]
        one_line = (len(errors) == 1 and "No space left on device" in errors[0]
                    and "Traceback" not in said)
        fault.outcome = f"exit {code}" + ("" if one_line else " (no one-line error)")
        fault.survived = code == 2 and one_line or code == 0

    def _targets(self, title: str, limit_s: float = 60.0) -> list[int]:
        """The actor processes of this title, waiting for them while the driver starts its
        actors (none when the driver ended first)."""
        end = time.monotonic() + limit_s
        while not (pids := ray_processes(title, self.cluster)) and self.running() \
                and time.monotonic() < end:
            time.sleep(0.1)
        return pids

    def _actor_kill(self, fault: Fault, title: str) -> None:
        pids = self._targets(title)
        if not pids:
            fault.injected, fault.outcome = False, "no such actor: not injected"
            return
        pid = self.picks.choice(pids)
        fault.detail = f"pid {pid}"
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        fault.outcome = "driver running" if self.running() else f"driver exit {self.proc.poll()}"
        fault.survived = self.running() or self.finished()

    def _generator_kill(self, fault: Fault) -> None:
        self._actor_kill(fault, "ray::GeneratorActor")

    def _reward_kill(self, fault: Fault) -> None:
        self._actor_kill(fault, "ray::RewardActor")

    def _node_removal(self, fault: Fault) -> None:
        workers = [n for n in self.cluster.list_all_nodes() if not n.head]
        node = self.picks.choice(workers)
        self.cluster.remove_node(node)
        self.cluster.add_node(**NODE)
        fault.detail = "a worker node replaced"
        fault.outcome = "driver running" if self.running() else f"driver exit {self.proc.poll()}"
        fault.survived = self.running() or self.finished()

    def _slow_reward(self, fault: Fault) -> None:
        pids = self._targets("ray::RewardActor")
        if not pids:
            fault.injected, fault.outcome = False, "no such actor: not injected"
            return
        pid, pause = self.picks.choice(pids), self.picks.uniform(3, 8)
        fault.detail = f"pid {pid} stopped {pause:.1f} s"
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        threading.Timer(pause, lambda: _cont(pid)).start()
        fault.outcome = "driver running" if self.running() else f"driver exit {self.proc.poll()}"
        fault.survived = self.running() or self.finished()


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


# -- the output --------------------------------------------------------------------------------


_FS: dict[str, object] = {}


def _fs(url: str, env: dict):
    """The harness's own view of the output (one filesystem per store, reused)."""
    import fsspec

    if url.startswith("s3://"):
        if "s3" not in _FS:
            from tests.helpers.s3 import s3_fs

            _FS["s3"] = s3_fs(env["AWS_ENDPOINT_URL_S3"])
        return _FS["s3"], url.removeprefix("s3://")
    return fsspec.filesystem("file"), url


def list_output(url: str, env: dict) -> list[str]:
    fs, root = _fs(url, env)
    try:
        fs.invalidate_cache()
        return [p.removeprefix(root.rstrip("/") + "/") for p in fs.find(root, withdirs=True)]
    except FileNotFoundError:
        return []


def shards_written(url: str, env: dict) -> int:
    """Shards the job has finished: their records (shards/shard-*.json) in the output."""
    return sum(n.startswith("shards/") and n.endswith(".json") for n in list_output(url, env))


def read_output(url: str, env: dict) -> dict[str, list[dict]]:
    """Every parquet file of the output, as rows, without the wall-clock column."""
    import pyarrow.parquet as pq

    fs, root = _fs(url, env)
    tables = {}
    for name in sorted(n for n in list_output(url, env) if n.endswith(".parquet")
                       and not n.startswith("shards/")):
        with fs.open(f"{root.rstrip('/')}/{name}", "rb") as f:
            tables[name] = [{k: v for k, v in r.items() if k != "seconds"}
                            for r in pq.read_table(f).to_pylist()]
    return tables


def first_difference(a, b, where: str = "", tol: float = 1e-5) -> str | None:
    """Where two nested values first differ (floats within `tol`), or None."""
    if isinstance(a, float) and isinstance(b, float):
        same = (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol
        return None if same else f"{where}: {a!r} != {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a.keys() ^ b.keys())}"
        for k in a:
            if (d := first_difference(a[k], b[k], f"{where}.{k}", tol)) is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} rows != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (d := first_difference(x, y, f"{where}[{i}]", tol)) is not None:
                return d
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def check(clean: str, chaos: str, env: dict, ids: list[str]) -> dict:
    want, got = read_output(clean, env), read_output(chaos, env)
    best = [r["id"] for r in got.get("best.parquet", [])]
    listed = list_output(chaos, env)
    leftovers = [n for n in listed if ".tmp-" in n or n.rsplit("/", 1)[-1]
                 in (".specrej-lock", ".specrej-lease.json")]
    return {
        "prompts": len(best), "missing": len(set(ids) - set(best)),
        "duplicated": len(best) - len(set(best)), "files_compared": sorted(want),
        "first_difference": first_difference(want, got, "output"),
        "leftovers": leftovers,
    }


# -- the run -----------------------------------------------------------------------------------


def run_clean(chaos: Chaos) -> float:
    t0 = time.monotonic()
    chaos.start()
    code = chaos.proc.wait(chaos.args.limit_s)
    if code != 0:
        raise SystemExit(f"the clean run failed ({code}):\n{chaos.said()}")
    return time.monotonic() - t0


def run_chaos(chaos: Chaos) -> float:
    a = chaos.args
    chaos.t0 = time.monotonic()
    chaos.gate.touch()  # the job's last shard waits for the faults (_pace)
    chaos.start()
    chaos.settle()  # the first fault, like every other, finds a driver that holds the output
    kinds = [k for k in KINDS if k not in a.skip]
    shards = math.ceil(a.prompts / SHARD_SIZE)
    while len(chaos.faults) < a.faults:
        # A random gap, cut short when the job has got ahead of the faults: fault i is due
        # by the time i/faults of --due-by of the shards are written, so they land while
        # the job runs; one that got ahead all the same waits at its last shard (_pace).
        due = (len(chaos.faults) + 1) * a.due_by * shards / a.faults
        until = time.monotonic() + chaos.rng.uniform(a.gap[0], a.gap[1])
        while time.monotonic() < until and not chaos.finished() \
                and shards_written(chaos.out, chaos.env) < due:
            time.sleep(0.5)
        if chaos.finished():
            print("chaos: the job finished before every fault was injected", flush=True)
            break
        chaos.restart_if_down(fault=False)
        if not chaos.running():
            continue
        chaos.inject(chaos.rng.choice(kinds))
        chaos.restart_if_down()
    chaos.gate.unlink(missing_ok=True)
    end = time.monotonic() + a.limit_s
    while not chaos.finished():  # the rest of the job, restarting the driver as needed
        try:
            chaos.proc.wait(max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the job did not end within {a.limit_s:.0f} s of the last "
                             f"fault:\n{chaos.said()}") from None
        chaos.restart_if_down(fault=False)
    return time.monotonic() - chaos.t0


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "driver":
        return driver(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--faults", type=int, default=30)
    ap.add_argument("--nodes", type=int, default=2, help="worker nodes beside the head")
    ap.add_argument("--gap", type=float, nargs=2, default=(1.5, 4.5),
                    help="seconds between faults: drawn uniformly in this range")
    ap.add_argument("--due-by", type=float, default=0.9,
                    help="every fault lands before this share of the shards is written")
    ap.add_argument("--store", choices=("local", "s3"), default="local")
    ap.add_argument("--skip", nargs="*", default=[], choices=KINDS, help="fault kinds left out")
    ap.add_argument("--limit-s", type=float, default=1800,
                    help="the most the job may take after its last fault")
    ap.add_argument("--root", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--fork-drivers", action="store_true",
                    help="start the drivers as forks of the test suite's zygote "
                         "(tests/helpers/zygote.py), not as fresh interpreters: for the tests")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import ray
    from ray.cluster_utils import Cluster

    from tests.tiny import save_tiny_lm

    if ray.is_initialized():
        # Its nodes would take that Ray's node address (loopback for a run's own Ray), while
        # the address the drivers are given is the routable one: they never connect.
        raise SystemExit("bench/chaos.py starts a cluster of its own: call it where Ray is "
                         "not initialized (ray.shutdown() first)")

    root = args.root or Path(tempfile.mkdtemp(prefix="specrej-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not model.exists():
        save_tiny_lm(model)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    launch = subprocess.Popen
    if args.fork_drivers:
        from tests.helpers.zygote import launch
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    server = cluster = clean = chaos = None
    try:
        if args.store == "s3":
            from tests.helpers.s3 import MotoServer

            server = MotoServer().start()
            env.update(server.env())
            server.make_bucket("chaos")
        base = f"s3://chaos/seed-{args.seed}" if server else str(root / f"seed-{args.seed}")
        cluster = Cluster(initialize_head=True,
                          head_node_args={**NODE, "include_dashboard": False})
        for _ in range(args.nodes):
            cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        env[CLUSTER_ENV] = cluster.address
        arm, hold, gate = root / "disk-full.arm", root / "mid-write.arm", root / "last-shard.gate"
        env[ARM_ENV], env[HOLD_ENV], env[GATE_ENV] = str(arm), str(hold), str(gate)
        clean_job = make_job(root, "clean", args.prompts, f"{base}/clean", model)
        chaos_job = make_job(root, "chaos", args.prompts, f"{base}/chaos", model)
        clean = Chaos(args, clean_job, f"{base}/clean", env, logs, cluster,
                      random.Random(args.seed), launch=launch)
        print(f"chaos: the clean run ({args.prompts} prompts) ...", flush=True)
        clean_s = run_clean(clean)
        print(f"chaos: clean run {clean_s:.1f} s", flush=True)
        chaos = Chaos(args, chaos_job, f"{base}/chaos", env, logs, cluster,
                      random.Random(args.seed), arm=arm, hold=hold, gate=gate,
                      picks=random.Random(args.seed + 1), launch=launch)
        chaos_s = run_chaos(chaos)
        ids = [f"c{i:04d}" for i in range(args.prompts)]
        result = check(clean.out, chaos.out, env, ids)
    finally:
        for run in (clean, chaos):
            if run is not None:
                run.stop_all()
        if cluster is not None:
            cluster.shutdown()
        if server is not None:
            server.stop()
    counts: dict[str, int] = {}
    for f in chaos.faults:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    identical = (result["first_difference"] is None and not result["missing"]
                 and not result["duplicated"] and not result["leftovers"])
    said = [chaos.said(log) for log in sorted(logs.glob("chaos-*.log"))]  # every driver's
    report = {
        "seed": args.seed, "store": args.store, "prompts": args.prompts, "nodes": args.nodes + 1,
        "faults_injected": len(chaos.faults),
        "faults_survived": sum(f.survived for f in chaos.faults) if identical else 0,
        "by_kind": counts, "restarts": chaos.restarts, "refused_starts": chaos.refused_starts,
        "lease_takeovers": sum("taking over the stale lease" in text for text in said),
        "held_at_last_shard": sum(HELD in text for text in said),
        "clean_s": round(clean_s, 1), "chaos_s": round(chaos_s, 1),
        "identical": identical, **result, "faults": [asdict(f) for f in chaos.faults],
    }
    print(f"chaos: seed {args.seed}: {report['faults_injected']} faults injected "
          f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}), "
          f"{report['faults_survived']} survived, {chaos.restarts} restarts "
          f"({chaos.refused_starts} starts refused while a killed holder's lease was fresh); "
          f"{report['held_at_last_shard']} driver(s) held at the last shard for the faults; "
          f"{chaos_s:.0f} s against the clean run's {clean_s:.0f} s; {args.prompts} prompts, "
          f"{result['missing']} missing, {result['duplicated']} duplicated; leftovers "
          f"{result['leftovers'] or 'none'}; first difference: "
          f"{result['first_difference'] or 'none'}", flush=True)
    save(args.json, report)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
