"""The final files as one set: all staged whole, then moved into place, run.json last.

The final files (the assembled datasets, the training formats, errors.jsonl, the card) are
rebuilt at the end of every run. No store replaces several files at once, so they are
written in three steps, one mechanism on every store:

1. Staged: each file is written under a temporary name (`.<name>.tmp-<pid>-<hex>`, hidden,
   removed by the next run if this one dies) and its size and sha256 kept as it is
   written. A failure here (a full disk) removes the temporaries and leaves the final files
   as they were: nothing a reader sees has changed.
2. Published: run.json is replaced by one that says `set.state: publishing` and names the
   new set, then each file is moved into place (a rename on a local disk; a server-side
   copy on an object store, each object appearing whole), then the names the new set no
   longer has are removed.
3. Committed: run.json says `set.state: complete`.

run.json's `set` is what a reader goes by: `{"id", "state", "files": {name: {"bytes",
"sha256"}}}`; `id` is a digest of the files' names and digests.

- `complete`: every file `files` lists is in place, with that size and sha256: one set.
- `publishing`: the set `files` lists is being moved into place; a final file may still be
  the earlier set's until run.json says `complete`. A run that died here left that state
  (and its last invocation says `publishing`); the next run rebuilds the set.
- `none`: no final files: a run that failed before it had ever published a set, its
  failure recorded in `invocations`.

A run whose final write fails records the failure in run.json and keeps what the folder
holds described as it is: the earlier complete set (its run.json, with this failed
invocation added), or the set left half-moved (`publishing`), or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from specrej_ray.data.dataset import Location, sync, tmp_name
from specrej_ray.data.output_guard import inside

SET = "set"
COMPLETE, PUBLISHING, NONE = "complete", "publishing", "none"


class _Digesting:
    """A binary file being written that counts and hashes its bytes on the way (what
    pyarrow's ParquetWriter and a plain write need of a file)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(memoryview(data))
        return self.f.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self.f.closed


@dataclass(frozen=True)
class Staged:
    tmp: str  # where the file waits, whole
    size: int
    sha256: str


@dataclass
class Card:
    """The card staged in the set: its name and the sha256 of its bytes (manifest.json
    records it, the old one too until the new card is in place)."""

    name: str
    sha256: str


@dataclass
class Staging:
    """Final files written under temporary names, each with its size and sha256, until
    they are moved into place together."""

    out: Location
    files: dict[str, Staged] = field(default_factory=dict)  # name -> staged, in order
    remove: set[str] = field(default_factory=set)  # names of ours the set no longer has
    card: Card | None = None
    moved: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def writing(self, name: str) -> Iterator[_Digesting]:
        """A file to write `name` into; staged when the block ends without error."""
        with self._temporary(name) as tmp, self.out.fs.open(tmp, "wb") as f:
            sink = _Digesting(f)
            yield sink
        self.files[name] = Staged(tmp, sink.size, sink.sha256.hexdigest())

    def put(self, name: str, data: bytes) -> None:
        with self._temporary(name) as tmp:
            self.out.fs.pipe_file(tmp, data)
        self.files[name] = Staged(tmp, len(data), hashlib.sha256(data).hexdigest())

    @contextlib.contextmanager
    def _temporary(self, name: str) -> Iterator[str]:
        """The temporary name to stage `name` under, removed if the write fails."""
        tmp = tmp_name(self.out, name)
        try:
            yield tmp
        except BaseException:
            with contextlib.suppress(Exception):
                self.out.fs.rm(tmp)
            raise

    def path(self, name: str) -> str:
        """Where `name` is now: its staged copy, or (not in this set) the file in place."""
        staged = self.files.get(name)
        return staged.tmp if staged and name not in self.moved else self.out.path(name)

    def listing(self, state: str) -> dict[str, Any]:
        """run.json's `set` for these files in `state`."""
        files = {name: {"bytes": self.files[name].size, "sha256": self.files[name].sha256}
                 for name in sorted(self.files)}
        ident = hashlib.sha256(json.dumps(sorted((n, f["sha256"]) for n, f in files.items()))
                               .encode()).hexdigest()[:16]
        return {"id": ident, "state": state, "files": files}

    def move_into_place(self) -> None:
        """Every staged file to its name (made durable first on a local disk: a crash after
        a rename never finds an empty file), then the names the set dropped go."""
        for staged in self.files.values():
            sync(self.out, staged.tmp)
        for name in self.files:
            self.move(name)
        for name in sorted(self.remove - set(self.files)):
            self.drop(name)
        sync(self.out, self.out.root)

    def move(self, name: str) -> None:
        self.out.fs.mv(self.files[name].tmp, inside(self.out, self.out.path(name)))
        self.moved.add(name)

    def drop(self, name: str) -> None:
        path = inside(self.out, self.out.path(name))
        if self.out.fs.exists(path):
            self.out.fs.rm(path)

    def discard(self) -> None:
        """The staged files not moved into place (a failed or abandoned set)."""
        for name, staged in self.files.items():
            if name not in self.moved:
                with contextlib.suppress(Exception):
                    self.out.fs.rm(staged.tmp)


def state_of(record: dict[str, Any] | None) -> str:
    """What a run.json says of the final files (one written before sets were recorded
    came after its files: complete)."""
    if not isinstance(record, dict):
        return NONE
    listed = record.get(SET)
    if listed is None:
        return COMPLETE if record.get("files") else NONE
    return listed.get("state", NONE) if isinstance(listed, dict) else NONE


# What run.json says of the runs rather than of the final files: carried onto a standing
# set's record when a later invocation fails.
_HISTORY = ("invocations", "seconds_all_invocations", "shards")


def failure_record(info: dict[str, Any], standing: dict[str, Any] | None) -> dict[str, Any]:
    """run.json after a failed final write. `info`: this invocation's record, its failure
    last in `invocations`; `standing`: the run.json that describes the final files now (the
    earlier complete set, or this run's own `publishing` one). The files keep that
    description, with every invocation's history from `info`; with none standing (or one
    of another spec), no final files: `set.state: none`."""
    if (state_of(standing) == NONE or standing is None
            or standing.get("fingerprint") != info.get("fingerprint")):
        return {**info, "files": [], SET: {"id": None, "state": NONE, "files": {}}}
    return {**standing, **{k: info[k] for k in _HISTORY if k in info}}
