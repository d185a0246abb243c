"""OutputDir: the one writer of an output location (prepare -> write shard -> finish).

Layout under output.path:
- `manifest.json`: which spec the results belong to (fingerprint and spec), written once.
- `shards/<id>.best.parquet`, `shards/<id>.candidates.parquet`: a finished shard's rows.
- `shards/<id>.json`: the shard's record, written last, so a shard counts as finished only
  once its files are whole. It ties each prompt id to a hash of the prompt's text and of the
  chat-formatted input the generator saw, and records the files' sizes.
- the assembled datasets, `run.json` and `errors.jsonl`, rebuilt from the shards at the end.

Results are keyed by prompt and content, not by shard: a resume reuses every finished prompt
whose text and input are unchanged, whatever the shard size, and regenerates (and reports)
a prompt whose content changed. A shard whose files do not match its record (truncated,
missing) is dropped and its prompts regenerated. Every file appears whole (temp name, then a
rename), and the whole location is held by one run at a time (output_lock).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from fsspec.implementations.local import LocalFileSystem

from specrej_ray import dataset
from specrej_ray.content_keys import ContentKeys, content_key
from specrej_ray.dataset import BEST_SCHEMA, CANDIDATE_SCHEMA, Location, OutputError
from specrej_ray.output_lock import LEASE_FILE, LOCK_FILE, OutputLock, take_lock
from specrej_ray.prompts import RowProblem
from specrej_ray.spec import JobSpec, OutputSpec

MANIFEST = "manifest.json"
LAYOUT = 2  # manifest layout: 2 = per-shard records keyed by prompt content
SHARDS = "shards"
CALIBRATION = "calibration.json"  # schedule: auto's choice and its evidence
_KINDS = ("best", "candidates")
_LOCKS = {LOCK_FILE, LEASE_FILE}
# Prompts assembled at a time: assembly's working memory grows with this (and the shard
# size); per prompt it keeps only which shard supplies it (BENCHMARKS.md).
WINDOW = 2048
__all__ = ["OutputDir", "Resume", "Supplied", "check_output", "content_key"]
Keys = Mapping[str, Any] | ContentKeys  # prompt id -> content key, in prompt order


def _shard_file(shard_id: str, kind: str) -> str:
    return f"{SHARDS}/{shard_id}.{kind}.parquet"


class Supplied(Mapping[str, str]):
    """Current prompt id -> the shard holding its rows for its current content, kept as a
    shard number per prompt position (4 bytes a prompt): `mask` says which positions are
    supplied."""

    def __init__(self, keys: ContentKeys, owner: np.ndarray, shards: list[str]) -> None:
        self.table, self.owner, self.shards = keys, owner, shards

    @property
    def mask(self) -> np.ndarray:
        return self.owner >= 0

    def claim(self, held: ContentKeys, shard: int) -> np.ndarray:
        """Shard number `shard` holds rows of these prompts: it supplies those it made from
        their current content that no shard supplies yet (a prompt is never taken twice).
        Returns the positions of all of them here, whatever their content."""
        at = self.table.positions(held.ids)
        hit = at >= 0
        at = at[hit]
        same = at[self.table.digests[at] == held.digests[hit]]
        self.owner[same[self.owner[same] < 0]] = shard
        return at

    def __getitem__(self, pid: str) -> str:
        at = self.table.position(pid)
        if at < 0 or self.owner[at] < 0:
            raise KeyError(pid)
        return self.shards[self.owner[at]]

    def __iter__(self) -> Iterator[str]:
        for pid, supplied in zip(self.table, self.mask, strict=True):
            if supplied:
                yield pid

    def __len__(self) -> int:
        return int(self.mask.sum())


@dataclass
class Resume:
    """What an output location already holds for the current prompts."""

    done: Mapping[str, str] = field(default_factory=dict)  # prompt id -> shard of its rows
    changed: list[str] = field(default_factory=list)  # finished before, content changed since
    dropped: list[str] = field(default_factory=list)  # shards dropped as unreadable, and why


class OutputDir:
    """The single writer of one output location; use as a context manager."""

    def __init__(self, out: Location, lock: OutputLock, fingerprint: str):
        self.out, self.lock, self.fingerprint = out, lock, fingerprint
        self.records: dict[str, dict[str, Any]] = {}  # shard id -> its record, prompts counted
        # shard id -> its prompts' content keys, until resume() binds the run's prompts
        self.shard_keys: dict[str, ContentKeys] = {}
        self.dropped: list[str] = []
        self._header: dict[str, Any] | None = None  # manifest.json, until first written
        self._supplied: Supplied | None = None  # the run's prompts, once resume() has them

    # --- prepare ---

    @classmethod
    def open(cls, url: str, policy: str, fingerprint: str, spec: dict[str, Any],
             label: str = "", echo=print) -> OutputDir:
        """Take the location (refusing one held by another run), apply output.if_exists and
        load what finished before."""
        out = dataset.locate(url)
        _check_is_ours_or_empty(out)
        try:
            out.fs.makedirs(out.root, exist_ok=True)
        except OSError as e:
            raise OutputError(f"output.path: cannot create {out} ({_why(e)}); "
                              "choose a writable location") from None
        lock = take_lock(out, label, echo)
        try:
            self = cls(out, lock, fingerprint)
            self._prepare(policy, spec, echo)
        except BaseException:
            lock.release()
            raise
        return self

    @classmethod
    def for_spec(cls, spec: JobSpec, echo=print) -> OutputDir:
        """The job's output.path, taken for this run (see open)."""
        return cls.open(spec.output.path, spec.output.if_exists, spec.fingerprint(),
                        spec.model_dump(mode="json"), label=spec.name, echo=echo)

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.lock.release()

    def _prepare(self, policy: str, spec: dict[str, Any], echo) -> None:
        names = _names(self.out) - _LOCKS
        has_ours = bool(names & set(dataset.OUR_FILES))
        if has_ours and policy == "refuse":
            raise OutputError(f"output.path: {self.out} already has results; set "
                              "output.if_exists to resume or overwrite (or pass --overwrite)")
        if has_ours and policy == "overwrite":
            for name in names & set(dataset.OUR_FILES):
                self.out.fs.rm(self.out.path(name), recursive=True)
            names = set()
        # Every check first: a refused run must not change anything it finds.
        header = self._read_manifest(echo) if MANIFEST in names else None
        if header is not None and header.get("fingerprint") != self.fingerprint:
            changed = ", ".join(_changed_keys(header.get("spec") or {}, spec)) or "the spec"
            raise OutputError(f"output.path: {self.out} holds results of a different spec "
                              f"(changed: {changed}); pass --overwrite or use another "
                              "output.path")
        leftovers = self._load_records()
        foreign = sorted({r["fingerprint"] for r in self.records.values()} - {self.fingerprint})
        if foreign:
            raise OutputError(f"output.path: {self.out} holds shards of another spec "
                              f"(fingerprint {foreign[0]}); pass --overwrite or use another "
                              "output.path")
        # Writes cut short by a killed run, and shards it killed before their record.
        for path in leftovers + [self.out.path(n) for n in names
                                 if n.startswith(".") and ".tmp-" in n]:
            self.out.fs.rm(path)
        # Written with the first results, so a run that stops before any (a bad prompt
        # file, a model that does not load) leaves nothing a later run would take for ours.
        self._header = None if header else {"layout": LAYOUT, "fingerprint": self.fingerprint,
                                            "spec": spec}

    def _write_header(self) -> None:
        if self._header is not None:
            self.out.fs.makedirs(self.out.path(SHARDS), exist_ok=True)
            self._write_json(MANIFEST, self._header)
            self._header = None

    def _read_manifest(self, echo) -> dict[str, Any] | None:
        try:
            header = json.loads(self.out.fs.cat_file(self.out.path(MANIFEST)))
        except (ValueError, UnicodeDecodeError):
            # A torn manifest (a copy cut short): the shard records carry the fingerprint,
            # so the manifest is rebuilt from them (a foreign shard is refused below).
            echo(f"[specrej] {self.out.url_of(MANIFEST)} is unreadable; rebuilding it from "
                 "the shard records")
            return None
        if not isinstance(header, dict) or header.get("layout") != LAYOUT:
            raise OutputError(f"output.path: {self.out} was written by an older specrej-ray "
                              "(manifest layout 1); pass --overwrite or use another "
                              "output.path")
        return header

    def _load_records(self) -> list[str]:
        """Read every shard record whose files are whole; return the paths no record covers
        (temp files, files of a shard killed before its record, a dropped shard's files)."""
        fs = self.out.fs
        root = self.out.path(SHARDS)
        if not fs.exists(root):
            return []
        fs.invalidate_cache(root)
        sizes = {i["name"].rstrip("/").rsplit("/", 1)[-1]: int(i.get("size") or 0)
                 for i in fs.ls(root, detail=True)}
        kept: set[str] = set()
        for name in sorted(n for n in sizes if n.endswith(".json") and not n.startswith(".")):
            shard_id = name.removesuffix(".json")
            record, why = self._read_record(shard_id, sizes)
            if record is None:
                self.dropped.append(f"{shard_id}: {why}")
                continue
            self.records[shard_id], self.shard_keys[shard_id] = _split(record)
            kept |= {name, *(f"{shard_id}.{k}.parquet" for k in _KINDS)}
        return [f"{root}/{name}" for name in sorted(set(sizes) - kept)]

    def _read_record(self, shard_id: str, sizes: dict[str, int]):
        try:
            record = json.loads(self.out.fs.cat_file(self.out.path(SHARDS, f"{shard_id}.json")))
            files = record["files"]
            record["fingerprint"]  # noqa: B018 - it must be there
            if not isinstance(record["prompts"], dict):
                raise TypeError("prompts")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None, "its record is unreadable"
        for kind in _KINDS:
            name = f"{shard_id}.{kind}.parquet"
            if sizes.get(name) != files.get(kind):
                return None, f"{name} is {'missing' if name not in sizes else 'truncated'}"
        return record, ""

    def resume(self, keys: Keys) -> Resume:
        """Which current prompts (id -> content key) are finished, which changed since."""
        if self._supplied is not None:
            raise ValueError("OutputDir.resume: called once per run")
        keys = ContentKeys.of(keys)
        done, recorded = self._supplying(keys)
        changed = np.flatnonzero(recorded & ~done.mask)
        ids = keys.ids.take(pa.array(changed, pa.int64())).to_pylist() if len(changed) else []
        # From here on this output serves these prompts: write_shard keeps which shard
        # supplies each one, and the shards' copies of the prompts' keys (a million prompts'
        # worth) are dropped: nothing needs them any more.
        self._supplied = Supplied(keys, done.owner.copy(), list(done.shards))
        self.shard_keys = {}
        return Resume(done=done, changed=sorted(ids), dropped=list(self.dropped))

    def _supply(self, keys: Keys) -> Supplied:
        """Which shard supplies each of these prompts: kept since resume() for its prompts,
        worked out from the records for any others (an OutputDir used without resume)."""
        bound = self._supplied
        if bound is None:
            return self._supplying(ContentKeys.of(keys))[0]
        if not _same(bound.table, ContentKeys.of(keys, indexed=False)):
            raise ValueError("OutputDir: these prompts are not the ones resume() was given")
        return bound

    def _supplying(self, keys: ContentKeys) -> tuple[Supplied, np.ndarray]:
        """Which shard holds each current prompt's rows for its current content (the first
        such shard in id order, so a prompt is never taken twice), and which prompts any
        shard holds rows of (whatever their content)."""
        shards = sorted(self.shard_keys)
        supplied = Supplied(keys, np.full(len(keys), -1, np.int32), shards)
        recorded = np.zeros(len(keys), bool)
        for i, shard_id in enumerate(shards):
            recorded[supplied.claim(self.shard_keys[shard_id], i)] = True
        return supplied, recorded

    # --- write shard ---

    def write_shard(self, shard_id: str, keys: Mapping[str, Any], best: list[dict],
                    candidates: list[dict], **extra: Any) -> None:
        """The shard's two files, then its record: finished only once all three are whole.
        `extra` goes into the record: `run`, how it ran (attempts, seconds, actor), so that a
        driver killed before it writes run.json loses nothing; `calibration`, the prompts'
        calibration data (schedule: auto); `audit`, its audited prompts' records."""
        self.lock.check()
        self._write_header()
        sizes = {}
        for kind, rows, schema in (("candidates", candidates, CANDIDATE_SCHEMA),
                                   ("best", best, BEST_SCHEMA)):
            name = _shard_file(shard_id, kind)
            with self._failing_write(name):
                dataset.write_table(self.out, name, rows, schema)
            sizes[kind] = int(self.out.fs.info(self.out.path(name))["size"])
        record = {"fingerprint": self.fingerprint, "prompts": dict(keys), "files": sizes,
                  **{k: v for k, v in extra.items() if v is not None}}
        self._write_json(f"{SHARDS}/{shard_id}.json", record)
        self.records[shard_id], held = _split(record)
        if self._supplied is None:
            self.shard_keys[shard_id] = held
            return
        if shard_id not in self._supplied.shards:
            self._supplied.shards.append(shard_id)
        self._supplied.claim(held, self._supplied.shards.index(shard_id))

    def _write_json(self, name: str, data: dict[str, Any]) -> None:
        with self._failing_write(name):
            dataset.write_atomic(self.out, name, json.dumps(data, indent=1).encode())

    @contextlib.contextmanager
    def _failing_write(self, name: str) -> Iterator[None]:
        """A write that fails (disk full, access lost) stops the run with one line; what
        finished before stays, and the half-written temp file is gone (dataset.py)."""
        try:
            yield
        except OSError as e:
            where = self.out.url_of(name) if "/" in name or "." in name else name
            raise OutputError(f"output.path: cannot write {where} ({_why(e)}); "
                              "finished shards are kept: free space or fix access, then run "
                              "again to resume") from None

    # --- finish ---

    def assemble(self, keys: Keys, output: OutputSpec,
                 prov: dict[str, str]) -> dataset.Assembled:
        """The final files from the shards: for each current prompt (id -> content key, in
        prompt order) the rows made from that very content, in prompt order. A result whose
        prompt changed since is never taken. Read and written WINDOW prompts at a time."""
        self._write_header()
        supplied = self._supply(keys)
        windows = (self._window(pids, shards) for pids, shards in _windows(supplied))
        with self._failing_write("the assembled datasets"):
            return dataset.assemble(self.out, windows, output, prov)

    def _window(self, pids: list[str], shards: list[str]) -> tuple[pa.Table, pa.Table]:
        """The best and candidate rows of these prompts (each from its shard), in their
        order (a shard may supply several windows: each reads only its rows)."""
        by_shard: dict[str, list[str]] = {}
        for pid, shard in zip(pids, shards, strict=True):
            by_shard.setdefault(shard, []).append(pid)
        return (self._rows(by_shard, "best", "id", pids, BEST_SCHEMA),
                self._rows(by_shard, "candidates", "prompt_id", pids, CANDIDATE_SCHEMA))

    def _rows(self, by_shard: dict[str, list[str]], kind: str, column: str, pids: list[str],
              schema: pa.Schema) -> pa.Table:
        """Rows of `pids` from each shard, ordered by prompt (then as written)."""
        parts = [dataset.read_table(self.out, _shard_file(s, kind), schema,
                                    where=pc.field(column).isin(ids))
                 for s, ids in by_shard.items()]
        table = pa.concat_tables([schema.empty_table(), *parts])
        position = pc.index_in(table.column(column), value_set=pa.array(pids, pa.string()))
        return table.take(pc.sort_indices(position))  # a stable sort

    def write_errors(self, source: str, problems: list[RowProblem],
                     failures: list[dict[str, Any]]) -> None:
        with self._failing_write("errors.jsonl"):
            dataset.write_errors(self.out, source, problems, failures)

    def audits(self, keys: Keys) -> list[dict[str, Any]]:
        """The audit records (audit.record) of the current prompts, from the shards that
        supply their rows, in prompt order."""
        supplied = self._supply(keys)
        found: dict[int, dict[str, Any]] = {}
        for i, shard_id in enumerate(supplied.shards):
            audits = self.records[shard_id].get("audit") or []
            if not audits:
                continue
            at = supplied.table.positions(pa.array([a["prompt_id"] for a in audits], pa.string()))
            found.update((int(p), a) for p, a in zip(at, audits, strict=True)
                         if p >= 0 and supplied.owner[p] == i)
        return [found[p] for p in sorted(found)]

    def calibration(self) -> dict[str, Any] | None:
        """The choice `schedule: auto` made for this spec in an earlier invocation, if any."""
        name = self.out.path(CALIBRATION)
        if not self.out.fs.exists(name):
            return None
        data = json.loads(self.out.fs.cat_file(name))
        return data if data.get("fingerprint") == self.fingerprint else None

    def write_calibration(self, data: dict[str, Any]) -> None:
        """Written once the calibration prompts are done: a resume reuses the choice."""
        self.lock.check()
        self._write_json(CALIBRATION, {**data, "fingerprint": self.fingerprint})

    def write_run_info(self, info: dict[str, Any]) -> None:
        with self._failing_write("run.json"):
            dataset.write_run_info(self.out, info)


def _windows(supplied: Supplied) -> Iterator[tuple[list[str], list[str]]]:
    """The prompts that have rows, in prompt order, WINDOW at a time, with their shards."""
    at = np.flatnonzero(supplied.mask)
    for start in range(0, len(at), WINDOW):
        part = at[start : start + WINDOW]
        pids = supplied.table.ids.take(pa.array(part, pa.int64())).to_pylist()
        yield pids, [supplied.shards[i] for i in supplied.owner[part]]


def _same(a: ContentKeys, b: ContentKeys) -> bool:
    return a is b or (len(a) == len(b) and a.ids.equals(b.ids)
                      and bool(np.array_equal(a.digests, b.digests)))


def _split(record: dict[str, Any]) -> tuple[dict[str, Any], ContentKeys]:
    """A shard record as kept in memory (its prompts counted) and its prompts' content keys
    as a ContentKeys table (a dict per prompt would not fit a job of millions)."""
    keys = ContentKeys.of(record["prompts"], indexed=False)
    return {**record, "prompts": len(keys)}, keys


def check_output(url: str) -> None:
    """What `validate` can tell without writing anything: output.path names a place this run
    could create or use (a local path: its nearest existing folder is a writable folder)."""
    out = dataset.locate(url)
    _check_is_ours_or_empty(out)
    if not isinstance(out.fs, LocalFileSystem):
        return  # an object store: only a write can tell, and validate writes nothing
    path = Path(out.root)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise OutputError(f"output.path: cannot create {out}: {existing} is a file, not a "
                          "folder; choose another location")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"output.path: cannot write to {existing} (permission denied); "
                          "choose a writable location")


def _check_is_ours_or_empty(out: Location) -> None:
    fs = out.fs
    if not fs.exists(out.root):
        return
    if not fs.isdir(out.root):
        raise OutputError(f"output.path: {out} exists and is not a directory")
    names = _names(out) - _LOCKS
    if names and not names & set(dataset.OUR_FILES):
        raise OutputError(f"output.path: {out} is a non-empty directory that is not a "
                          "specrej-ray output; choose a new or empty path")


def _names(out: Location) -> set[str]:
    """Names directly under the root (object stores list keys; any key counts)."""
    out.fs.invalidate_cache(out.root)
    return {p.rstrip("/").rsplit("/", 1)[-1] for p in out.fs.ls(out.root, detail=False)}


def _changed_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _changed_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__

