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
is older than its ttl is stale and is taken over, with a message. Two runs that write a lease
in the same instant both read it back after `settle_s` and only the one whose id is there goes
on; a run that finds its lease taken stops before writing anything more.
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
from datetime import UTC, datetime
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from specrej_ray.data.dataset import Location, OutputError

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

    def release(self) -> None:  # pragma: no cover - overridden
        pass

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FileLock(OutputLock):
    def __init__(self, out: Location, label: str):
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
            return os.open(self.info_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise OutputError(f"output.path: cannot write to {out} ({e.strerror}); "
                              "choose a writable location") from None

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
        # Never through a link: it could point anywhere.
        fd = os.open(self.info_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

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


class Lease(OutputLock):
    """A lease object with a heartbeat, for filesystems without locks."""

    def __init__(self, out: Location, label: str, ttl_s: float = 60.0, settle_s: float = 2.0,
                 clock: Callable[[], float] = time.time, echo=print, heartbeat: bool = True):
        self.out, self.ttl_s, self.clock = out, ttl_s, clock
        self.path = out.path(LEASE_FILE)
        self.me = _owner(label)
        self.lost: dict[str, Any] | None = None
        current = self._read()
        if current and current.get("id") != self.me["id"]:
            age = clock() - float(current.get("heartbeat", 0))
            if age < ttl_s:
                raise _in_use(out, current, f" (lease renewed {age:.0f} s ago)")
            echo(f"[specrej] taking over the stale lease of {_holder_text(current)} on {out} "
                 f"(no heartbeat for {age:.0f} s, ttl {ttl_s:.0f} s)")
        self._write()
        time.sleep(settle_s)
        winner = self._read()
        if winner.get("id") != self.me["id"]:
            raise _in_use(out, winner, " (it took the lease at the same moment)")
        self._stop = threading.Event()
        self._thread = None
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name="specrej-lease")
            self._thread.start()

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self.out.fs.cat_file(self.path))
        except FileNotFoundError:
            return {}
        except ValueError:  # a torn or foreign object: no valid holder
            return {}

    def _write(self) -> None:
        self.out.fs.pipe_file(self.path, json.dumps({**self.me, "heartbeat": self.clock(),
                                                     "ttl_s": self.ttl_s}).encode())

    def renew(self) -> None:
        """Renew the heartbeat unless another run took the lease (then remember who)."""
        current = self._read()
        if current.get("id") != self.me["id"]:
            self.lost = current
            return
        self._write()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            with contextlib.suppress(Exception):  # a passing store error: try next beat
                self.renew()

    def check(self) -> None:
        if self.lost is not None:
            raise OutputInUse(f"output.path: {self.out} was taken over by "
                              f"{_holder_text(self.lost)}; this run stops writing there")

    def release(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        with contextlib.suppress(Exception):
            if self._read().get("id") == self.me["id"]:
                self.out.fs.rm(self.path)


def take_lock(out: Location, label: str, echo=print) -> OutputLock:
    """The exclusive hold on `out` for this run (the directory must exist)."""
    if isinstance(out.fs, LocalFileSystem):
        return FileLock(out, label)
    # memory:// lives in this process alone: no other run can race for it.
    settle = 0.0 if "memory" in _protocols(out) else 2.0
    return Lease(out, label, settle_s=settle, echo=echo)


def _protocols(out: Location) -> set[str]:
    proto = out.fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)
