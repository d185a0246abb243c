"""One writer per output location: an OS file lock on local disks, a lease object elsewhere.

A second run on a held output is refused at once with one line naming the holder. The local
lock is `flock` on the output directory itself: the kernel drops it when its process dies
(even by SIGKILL), so a crashed run never leaves a stale lock, and a run leaves no lock file
behind (a refused run leaves the directory as it found it). The holder's name is written to
`.specrej-lock` while it holds the lock, for the refusal to name it, and removed at release.
Where a directory cannot be locked (some network filesystems), the lock is `flock` on
`.specrej-lock` instead, and that file is never deleted: unlinking a lock file lets two later
runs lock two different files.

Object stores (s3://, gs://, ...) have no locks: a lease object `.specrej-lease.json` records
its owner, host, pid and a heartbeat that a background thread renews. A lease whose heartbeat
is older than its ttl is stale and is taken over, with a message. On S3 and GCS each write of
the lease is conditional (lease_object.py), so of two runs that race exactly one holds it;
elsewhere two runs that write a lease in the same instant both read it back after `settle_s`
and only the one whose id is there goes on. A run that finds its lease taken, or could not
renew it for most of its ttl, stops before writing anything more.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from specrej_ray.data.dataset import Location, write_atomic
from specrej_ray.data.lease_object import Conflict, Version, lease_object, protocols
from specrej_ray.errors import OutputError

LOCK_FILE = ".specrej-lock"
LEASE_FILE = ".specrej-lease.json"


class OutputInUse(OutputError):
    """Another run holds the output location (str(): one line naming it)."""


def _owner(label: str) -> dict[str, Any]:
    return {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
            "run": label, "since": datetime.now(UTC).isoformat(timespec="seconds")}


def _holder_text(info: dict[str, Any]) -> str:
    if not info:
        return "another run"
    who = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
    run = f" ('{info['run']}')" if info.get("run") else ""
    since = f" since {info['since']}" if info.get("since") else ""
    return f"{who}{run}{since}"


def _in_use(out: Location, info: dict[str, Any], extra: str = "") -> OutputInUse:
    return OutputInUse(
        f"output.path: {out} is in use by {_holder_text(info)}{extra}; wait for that run to "
        "end (or stop it), or choose another output.path"
    )


class OutputLock:
    """Held for the whole run; `check()` raises if the hold was lost (leases only)."""

    def check(self) -> None:  # pragma: no cover - overridden
        pass

    def report(self) -> dict[str, Any] | None:
        """What run.json says of the hold (a lease's renewals); None for an OS lock."""
        return None

    def release(self) -> None:  # pragma: no cover - overridden
        pass

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FileLock(OutputLock):
    def __init__(self, out: Location, label: str):
        self._out = out
        self.info_path = out.path(LOCK_FILE)
        self._fd: int | None = None
        self._keep_file = False  # locking the file itself: it must outlive the run
        try:
            self._fd = os.open(out.root, os.O_RDONLY | os.O_DIRECTORY)
            self._flock(out)
        except _NoDirLock:
            self._keep_file = True
            self._fd = self._open_info(out)
            self._flock(out)
        except OSError as e:
            raise OutputError(f"output.path: cannot open {out} ({e.strerror}); "
                              "choose a readable location") from None
        try:
            self._write_info(json.dumps(_owner(label)).encode())
        except OSError as e:
            self.release()
            raise OutputError(f"output.path: cannot write to {out} ({e.strerror}); "
                              "choose a writable location") from None

    def _open_info(self, out: Location) -> int:
        try:
            fd = os.open(self.info_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise OutputError(f"output.path: cannot write to {out} ({e.strerror}); "
                              "choose a writable location") from None
        if os.fstat(fd).st_nlink > 1:  # written in place below: never into a file elsewhere
            os.close(fd)
            raise OutputError(f"output.path: {self.info_path} is hard-linked to a file "
                              "elsewhere; remove it (specrej-ray keeps its lock there)")
        return fd

    def _flock(self, out: Location) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise _in_use(out, _read_json(self.info_path)) from None
        except OSError:
            if self._keep_file:
                raise
            os.close(self._fd)
            self._fd = None
            raise _NoDirLock() from None

    def _write_info(self, data: bytes) -> None:
        if self._keep_file:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
            return
        # A new file renamed over the name: never written through a link, symbolic or hard
        # (a hard link's other name could be anywhere). The directory's flock is ours.
        write_atomic(self._out, LOCK_FILE, data)

    def release(self) -> None:
        if self._fd is None:
            return
        if self._keep_file:  # the file stays (see the module doc); emptied, it names no one
            os.ftruncate(self._fd, 0)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.info_path)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


class _NoDirLock(Exception):
    """This filesystem cannot flock a directory."""


def _read_json(path: str) -> dict[str, Any]:
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            return json.loads(f.read(4096) or b"{}")
    except (OSError, ValueError):
        return {}


@dataclass
class LeaseStats:
    """How the heartbeat kept up (run.json `lease`): renewals made, renewals that failed (a
    store error), and the longest time between two successful ones. A renewal is missed when
    it failed or came over half a period late."""

    interval_s: float
    renewals: int = 0
    failures: int = 0
    late: int = 0
    max_gap_s: float = 0.0

    @property
    def missed(self) -> int:
        return self.failures + self.late

    def as_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "renewals": self.renewals,
                "failures": self.failures, "late": self.late, "missed": self.missed,
                "max_gap_s": round(self.max_gap_s, 3)}


class Lease(OutputLock):
    """A lease object with a heartbeat, for stores without locks.

    On S3 and GCS every write of it is conditional (lease_object): it is created only if
    absent, renewed or taken over only if it is still the version this run last saw, so of
    two runs that race exactly one holds it, and a run whose lease was taken over learns it
    at its next renewal. Elsewhere the lease is written, and read back `settle_s` later."""

    def __init__(self, out: Location, label: str, ttl_s: float = 60.0, settle_s: float = 2.0,
                 clock: Callable[[], float] = time.time, echo=print, heartbeat: bool = True,
                 store: Any = None):
        self.out, self.ttl_s, self.clock = out, ttl_s, clock
        self.obj = store if store is not None else lease_object(out, LEASE_FILE)
        self.path = out.path(LEASE_FILE)
        self.me = _owner(label)
        self.lost: dict[str, Any] | None = None
        self.tag: str | None = None  # the version of the lease this run wrote last
        self.stats = LeaseStats(ttl_s / 4)
        self._mutex = threading.Lock()  # one renewal (or the release) at a time
        self._released = False
        started = time.monotonic()
        try:
            self._take(echo, settle_s)
        except OutputError:
            raise
        except Exception as e:  # the store refused: access, a missing bucket, no network
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise OutputError(f"output.path: cannot take the lease on {out} "
                              f"({type(e).__name__}: {why}); check access to the store") \
                from None
        self._renewed = started  # the heartbeat it wrote is at least this recent
        self._stop = threading.Event()
        self._thread = None
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name="specrej-lease")
            self._thread.start()

    def _body(self) -> bytes:
        return json.dumps({**self.me, "heartbeat": self.clock(), "ttl_s": self.ttl_s}).encode()

    def _mine(self, now: Version | None) -> bool:
        """Whether the lease as read holds this run's own write (one whose answer was lost
        and that the store's client retried reads as a conflict)."""
        return now is not None and now.data.get("id") == self.me["id"]

    def _take(self, echo, settle_s: float) -> None:
        current = self.obj.read()
        held = current.data if current is not None else {}
        if held.get("id"):  # a torn or foreign object names no holder: taken as stale
            age, ttl = _lease_age(held, self.ttl_s, self.clock())
            if age < ttl:
                raise _in_use(self.out, held, f" (lease renewed {age:.0f} s ago)")
            echo(f"[specrej] taking over the stale lease of {_holder_text(held)} on "
                 f"{self.out} (no heartbeat for {age:.0f} s, ttl {ttl:.0f} s)")
        if self.obj.conditional:
            try:
                self.tag = (self.obj.create(self._body()) if current is None
                            else self.obj.replace(self._body(), current.tag))
            except Conflict:
                if not self._mine(now := self.obj.read()):
                    raise _in_use(self.out, now.data if now else {},
                                  " (it took the lease at the same moment)") from None
                self.tag = now.tag
            return
        self.obj.create(self._body())
        time.sleep(settle_s)
        if not self._mine(now := self.obj.read()):
            raise _in_use(self.out, now.data if now else {},
                          " (it took the lease at the same moment)")

    def renew(self, wait: bool = True) -> None:
        """Renew the heartbeat unless another run took the lease (then remember who).
        With wait=False, return at once if a renewal is already under way."""
        if not self._mutex.acquire(blocking=wait):
            return
        try:
            if self.lost is not None or self._released:
                return
            started = time.monotonic()
            if self.obj.conditional:
                try:
                    self.tag = self.obj.replace(self._body(), self.tag)
                except Conflict:
                    if not self._mine(now := self.obj.read()):
                        self.lost = now.data if now is not None else {}
                        return
                    self.tag = now.tag  # our write landed; its answer was lost
            else:
                if not self._mine(now := self.obj.read()):
                    self.lost = now.data if now is not None else {}
                    return
                self.obj.create(self._body())
            gap = started - self._renewed
            self._renewed = started
            self.stats.renewals += 1
            self.stats.max_gap_s = max(self.stats.max_gap_s, gap)
            self.stats.late += gap > 1.5 * self.stats.interval_s
        finally:
            self._mutex.release()

    def _beat(self) -> None:
        while not self._stop.wait(self.stats.interval_s):
            try:
                self.renew()
            except Exception:  # a passing store error: counted, tried again next beat
                self.stats.failures += 1

    def check(self) -> None:
        """Before a write: raise if the lease was taken over, or if it has not been renewed
        for so long that another run may take it (a paused process, a store that does not
        answer); a heartbeat that fell behind is renewed here first (not waiting for one
        that hangs)."""
        if self.lost is None and time.monotonic() - self._renewed > self.ttl_s / 2:
            with contextlib.suppress(Exception):
                self.renew(wait=False)
        if self.lost is not None:
            raise OutputInUse(f"output.path: {self.out} was taken over by "
                              f"{_holder_text(self.lost)}; this run stops writing there")
        quiet = time.monotonic() - self._renewed
        if quiet > 0.75 * self.ttl_s:
            raise OutputInUse(f"output.path: the lease on {self.out} could not be renewed for "
                              f"{quiet:.0f} s (ttl {self.ttl_s:.0f} s); this run stops writing "
                              "there: check access to the store, then run again to resume")

    def report(self) -> dict[str, Any] | None:
        return {"kind": "conditional" if self.obj.conditional else "write-and-read-back",
                "ttl_s": self.ttl_s, **self.stats.as_dict()}

    def release(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        with self._mutex:  # after any renewal under way: the delete sees its version
            self._released = True
            if self.lost is not None:
                return  # not ours any more: left alone
            with contextlib.suppress(Exception):
                if self.obj.conditional:
                    try:
                        self.obj.delete(self.tag)
                    except Conflict:
                        if self._mine(now := self.obj.read()):
                            self.obj.delete(now.tag)
                elif self._mine(self.obj.read()):
                    self.obj.delete(None)


def _lease_age(held: dict[str, Any], ttl_s: float, now: float) -> tuple[float, float]:
    """(seconds since the lease's heartbeat, the ttl it is live for: the longer of ours and
    the holder's own promise)."""
    return now - _number(held.get("heartbeat")), max(ttl_s, _number(held.get("ttl_s")))


def _number(value: Any) -> float:
    """A lease field as a number (0 for anything else: a foreign or torn object)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def take_lock(out: Location, label: str, echo=print, ttl_s: float = 60.0) -> OutputLock:
    """The exclusive hold on `out` for this run (the directory must exist)."""
    if isinstance(out.fs, LocalFileSystem):
        return FileLock(out, label)
    # memory:// lives in this process alone: no other run can race for it.
    settle = 0.0 if "memory" in protocols(out) else 2.0
    return Lease(out, label, ttl_s=ttl_s, settle_s=settle, echo=echo)



def check_free(out: Location, ttl_s: float = 60.0) -> None:
    """OutputInUse, naming the holder, if another run holds `out` now; takes nothing and
    writes nothing (what `validate` and the checks before a run ask). A local lock is asked
    for a moment, shared: two checks do not refuse each other; a run that takes the output in
    that moment is refused as by any holder, and its next try succeeds. A lease is read."""
    if isinstance(out.fs, LocalFileSystem):
        _check_file_lock(out)
        return
    try:
        current = lease_object(out, LEASE_FILE).read()
    except Exception as e:  # the store refused: as Lease says it when a run takes it
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise OutputError(f"output.path: cannot read the lease on {out} "
                          f"({type(e).__name__}: {why}); check access to the store") from None
    held = current.data if current is not None else {}
    if held.get("id"):
        age, ttl = _lease_age(held, ttl_s, time.time())
        if age < ttl:
            raise _in_use(out, held, f" (lease renewed {age:.0f} s ago)")


def _check_file_lock(out: Location) -> None:
    """The directory's flock (or, where directories cannot be locked, .specrej-lock's)."""
    info = out.path(LOCK_FILE)
    try:
        held = _locked(out.root, os.O_DIRECTORY)
    except _NoDirLock:
        try:
            held = _locked(info, os.O_NOFOLLOW)
        except _NoDirLock:
            held = False  # nothing here can be locked: taking the output will say so
    if held:
        raise _in_use(out, _read_json(info))


def _locked(path: str, flags: int) -> bool:
    """Whether another open file holds `path`'s exclusive flock (False: no such path)."""
    try:
        fd = os.open(path, os.O_RDONLY | flags)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # dropped with the descriptor
    except BlockingIOError:
        return True
    except OSError:
        raise _NoDirLock() from None
    finally:
        os.close(fd)
    return False
