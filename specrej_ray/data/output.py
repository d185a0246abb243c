"""OutputDir: the one writer of an output location (prepare -> write shard -> finish).

Layout under output.path:
- `manifest.json`: that the directory is ours (format marker, layout), which spec the results
  belong to (fingerprint and spec) and every top-level name the runs wrote (`files`): see
  output_guard.py. Written with the first results, updated before each new name is written.
  `card_sha256`: the card's digest as written, so that a README.md edited since is kept
  (write_card; docs/outputs.md, "Your own README.md").
- `shards/<id>.best.parquet`, `shards/<id>.candidates.parquet`: a finished shard's rows.
- `shards/<id>.json`: the shard's record, written last, so a shard counts as finished only
  once its files are whole. It ties each prompt id to a hash of the prompt's text and of the
  chat-formatted input the generator saw, and records the files' sizes.
- the final files (the assembled datasets, `errors.jsonl`, the card), rebuilt from the
  shards at the end as one set: all staged, then moved into place, `run.json` saying which
  set the files are before and after (final_set.py).

Results are keyed by prompt and content, not by shard: a resume reuses every finished prompt
whose text and input are unchanged, whatever the shard size, and regenerates (and reports)
a prompt whose content changed. A shard whose files do not match its record (truncated,
missing) is dropped and its prompts regenerated. Every file appears whole (temp name, then a
rename), and the whole location is held by one run at a time (output_lock). A run that
finishes no prompt on a location that held no results leaves nothing there (close).

`--overwrite` (output.if_exists: overwrite) removes what the earlier runs listed, and only at
this run's first write: after the spec, the models, the prompt file and its rows have all
been checked, so a run refused for its inputs leaves the old dataset whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from specrej_ray.data import dataset
from specrej_ray.data.card import CARD, CARD_ASIDE
from specrej_ray.data.content_keys import ContentKeys, content_key
from specrej_ray.data.dataset import Location, best_schema, candidate_schema
from specrej_ray.data.final_set import COMPLETE, PUBLISHING, Card, Staging, failure_record
from specrej_ray.data.output_guard import (
    FORMAT,
    LAYOUT,
    MANIFEST,
    SHARDS,
    Survey,
    inside,
    is_shard_file,
    is_temp,
    remove_owned,
    survey,
)
from specrej_ray.data.output_lock import OutputInUse, OutputLock, check_free, take_lock
from specrej_ray.data.output_place import check_filesystem, check_not_nested
from specrej_ray.data.prompts import RowProblem
from specrej_ray.errors import OutputError
from specrej_ray.spec import JobSpec, OutputSpec
from specrej_ray.spec.job import fingerprinted

CALIBRATION = "calibration.json"  # schedule: auto's choice and its evidence
# manifest.json: each card of ours -> sha256 of the bytes written (two while one is being
# replaced), so that a README.md edited since is told from ours and kept.
CARD_DIGESTS = "card_sha256"
# Why a README.md is kept (OutputDir.card_state), said in one line.
_KEPT = {"edited": "was edited since specrej-ray wrote it",
         "unknown": "was written by a specrej-ray that kept no digest of it, so edits cannot "
                    "be ruled out",
         "foreign": "is not the card specrej-ray wrote"}
_KINDS = ("best", "candidates")
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
        self.manifest: dict[str, Any] = {}  # manifest.json as this run keeps it
        self._header_pending = True  # manifest.json not yet written by this run
        self._discard: set[str] | None = None  # --overwrite: the earlier runs' names
        self._leftovers: list[str] = []  # a killed run's partial files, removed at first write
        self._created = False  # this run made the directory
        self._supplied: Supplied | None = None  # the run's prompts, once resume() has them
        self._fresh = False  # no run's results here when this one took it
        self._recorded = False  # this run wrote run.json
        self._journal: dict[str, Any] | None = None  # run.json while a set is being moved
        self.draws = False  # search.draws: the rows carry each prompt's stop (dataset)
        self.branch = False  # search.branch: the candidate rows carry their parents

    # --- prepare ---

    @classmethod
    def open(cls, url: str, policy: str, fingerprint: str, spec: dict[str, Any],
             label: str = "", echo=print, lease_ttl_s: float = 60.0) -> OutputDir:
        """Take the location (refusing one held by another run, or one that is neither
        empty nor ours), apply output.if_exists and load what finished before. A refusal
        leaves the location as it was."""
        out = dataset.locate(url)
        check_not_nested(out)
        created = not survey(out).names and not out.fs.exists(out.root)
        try:
            out.fs.makedirs(out.root, exist_ok=True)
        except OSError as e:
            raise OutputError(f"output.path: cannot create {out} ({_why(e)}); "
                              "choose a writable location") from None
        try:
            lock = take_lock(out, label, echo, ttl_s=lease_ttl_s)
        except OutputInUse:
            # Another run holds it: a directory both runs saw missing may be that run's now,
            # still empty between its lock and its first write. Removing it there failed the
            # holder ("No such file or directory"): test_racing_writers_never_mix_rows.
            raise
        except BaseException:
            _remove_if_empty(out, created)
            raise
        self = cls(out, lock, fingerprint)
        self._created = created
        search = spec.get("search") or {}
        self.draws, self.branch = bool(search.get("draws")), bool(search.get("branch"))
        try:
            self._prepare(policy, spec, echo)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def for_spec(cls, spec: JobSpec, echo=print) -> OutputDir:
        """The job's output.path, taken for this run (see open)."""
        check_prompts_outside(spec.prompts.path, spec.output.path)
        return cls.open(spec.output.path, spec.output.if_exists, spec.fingerprint(),
                        spec.model_dump(mode="json"), label=spec.name, echo=echo,
                        lease_ttl_s=spec.output.lease_ttl_s)

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        leave_nothing = self.leaves_nothing
        if leave_nothing and not self._header_pending:
            self._remove_written()  # under the lock still: no run sees it half gone
        self.lock.release()
        # A run that wrote nothing into the directory it made leaves no directory either.
        _remove_if_empty(self.out, self._created and leave_nothing)

    @property
    def leaves_nothing(self) -> bool:
        """This run finished no prompt on a location that held no results: it leaves the
        location as it found it (its manifest.json and empty shards/ go, and the folder it
        made)."""
        return (self._fresh or self._header_pending) and not self.records \
            and not self._recorded and self._discard is None

    def _remove_written(self) -> None:
        """What this run wrote on a location that held no results, when it finished no
        prompt: manifest.json, shards/ and the temporaries of a write that failed (a full
        disk). Nothing else was there (or it is not ours, and stays)."""
        fs = self.out.fs
        with contextlib.suppress(OSError, OutputError):
            fs.invalidate_cache(self.out.root)
            names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(self.out.root,
                                                                     detail=False)}
            remove_owned(self.out, names & (set(self.manifest["files"]) - {MANIFEST})
                         | {n for n in names if is_temp(n)})
            remove_owned(self.out, names & {MANIFEST})  # last: till then the folder is ours

    def _prepare(self, policy: str, spec: dict[str, Any], echo) -> None:
        found = survey(self.out)  # again, now that no other run can change it
        self.manifest = {"format": FORMAT, "layout": LAYOUT, "fingerprint": self.fingerprint,
                         "spec": spec, "files": [MANIFEST, SHARDS]}
        check_earlier(self.out, found, policy, self.fingerprint, spec)
        if found.ours and policy == "overwrite":
            # Removed at the first write, after every check; a README.md that is not as we
            # wrote it holds the user's words and stays.
            kept = {CARD} if self.card_state(found.manifest or {}) in _KEPT else set()
            self._discard = found.owned() - kept
            return
        # Every check first: a refused run must not change anything it finds.
        header = self._check_manifest(found, echo)
        leftovers = self._load_records()
        # Nothing but what a run writes before its first result (a killed one's manifest).
        self._fresh = not self.records and not found.owned() - {MANIFEST, SHARDS}
        foreign = sorted({r["fingerprint"] for r in self.records.values()} - {self.fingerprint})
        if foreign:
            raise OutputError(f"output.path: {self.out} holds shards of another spec "
                              f"(fingerprint {foreign[0]}); pass --overwrite or use another "
                              "output.path")
        # Writes cut short by a killed run, and shards it killed before their record: gone
        # at this run's first write (a run refused before it changes nothing).
        self._leftovers = leftovers + [self.out.path(n) for n in found.names if is_temp(n)]
        if header is not None or found.torn:
            # Its names stay ours: a manifest of before the `files` list owns what such a
            # run could have written here.
            self.manifest["files"] = sorted(found.owned() | set(self.manifest["files"]))
            if digests := _card_digests(header or {}):
                self.manifest[CARD_DIGESTS] = digests
            self._header_pending = (header is None or header.get("format") != FORMAT
                                    or "files" not in header)
        # Otherwise written with the first results, so a run that stops before any (a bad
        # prompt file, a model that does not load) leaves nothing a later run takes for ours.

    def _first_write(self) -> None:
        """Before this run's first write (every input has been checked by now): the
        leftovers of a killed run go; an --overwrite removes what the earlier runs wrote;
        the manifest says the directory is ours and what it holds."""
        with self._failing_write("the earlier results"):
            for path in self._leftovers:
                self.out.fs.rm(inside(self.out, path))
            self._leftovers = []
            if self._discard is not None:
                # The old names stay listed until they are gone (a removal cut short leaves
                # them ours for the next --overwrite), and the manifest is replaced by a
                # rename: the directory never looks unowned to a run surveying it meanwhile.
                files = self.manifest["files"]
                self._write_json(MANIFEST, {**self.manifest, "files": sorted(
                    {*files, *self._discard})})
                # run.json first: no moment where it claims a set that is half removed.
                remove_owned(self.out, self._discard & {"run.json"})
                remove_owned(self.out, self._discard - {MANIFEST, "run.json"})
                self._discard = None
        self._write_json(MANIFEST, self.manifest)
        self.out.fs.makedirs(self.out.path(SHARDS), exist_ok=True)
        self._header_pending = False

    def _own(self, *names: str) -> None:
        """These top-level names are about to be written: the manifest lists them first, so
        that an --overwrite later removes them (and nothing else)."""
        new = not set(names) <= set(self.manifest["files"])
        self.manifest["files"] = sorted({*self.manifest["files"], *names})
        if self._header_pending or self._leftovers:
            self._first_write()
        elif new:
            self._write_json(MANIFEST, self.manifest)

    @property
    def holds_nothing(self) -> bool:
        """No run's results here, this one's included (no shard finished, no record): a run
        that stops now leaves the location as it found it."""
        return self.leaves_nothing

    @property
    def replacing(self) -> bool:
        """An --overwrite that has not written yet: the earlier dataset is still whole."""
        return self._discard is not None

    def _check_manifest(self, found: Survey, echo) -> dict[str, Any] | None:
        """The earlier runs' manifest (checked by check_earlier; None: nothing there yet, or
        a torn one, rebuilt from the shard records, which carry the fingerprint)."""
        if found.torn:
            echo(f"[specrej] {self.out.url_of(MANIFEST)} is unreadable; rebuilding it from "
                 "the shard records")
            return None
        return found.manifest

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
        # Only names of ours: anything else a user put there stays.
        return [f"{root}/{name}" for name in sorted(set(sizes) - kept) if is_shard_file(name)]

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
        self._own(SHARDS)
        sizes = {}
        for kind, rows, schema in (
                ("candidates", candidates, candidate_schema(self.draws, self.branch)),
                ("best", best, best_schema(self.draws))):
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
        finished before stays, and the half-written temp file is gone (dataset.py). A run
        that no longer holds its output (a lease taken over) writes nothing more."""
        self.lock.check()
        try:
            yield
        except OSError as e:
            where = self.out.url_of(name) if "/" in name or "." in name else name
            raise OutputError(f"output.path: cannot write {where} ({_why(e)}); "
                              "finished shards are kept: free space or fix access, then run "
                              "again to resume") from None

    # --- finish ---

    # The final files are one set (final_set.py): `staging()` holds it while assemble,
    # write_errors and write_card stage their files `into` it, and `publish` makes it
    # visible with run.json. Without `into` (tests, tools), each moves its own files into
    # place at once, with no run.json.

    @contextlib.contextmanager
    def staging(self) -> Iterator[Staging]:
        """This run's final files, staged; whatever was not moved into place when the block
        ends (a failure on the way) is removed."""
        final = Staging(self.out)
        try:
            yield final
        finally:
            final.discard()

    @contextlib.contextmanager
    def _staged(self, into: Staging | None) -> Iterator[Staging]:
        if into is not None:
            yield into
            return
        with self.staging() as final:
            yield final
            self._move(final)

    def publish(self, final: Staging, record: Callable[[dict[str, Any]], dict[str, Any]]
                ) -> dict[str, Any]:
        """The staged set made visible: run.json says `publishing` and names it, the files
        move into place, run.json says `complete`. `record(set)`: the run.json to write,
        with that `set`. Returns the run.json written last."""
        self._own("run.json")
        journal = record(final.listing(PUBLISHING))
        self._write_run_json(journal)
        self._journal = journal
        self._move(final)
        done = record(final.listing(COMPLETE))
        self._write_run_json(done)
        self._journal = None
        return done

    def _move(self, final: Staging) -> None:
        """The staged files into place and the names the set dropped gone; the manifest
        holds both card digests while the card is replaced, and stops listing the names
        removed."""
        card = final.card
        if card is not None:
            self._card_written(card.name, [d for d in (self._sha256(card.name), card.sha256)
                                           if d])
        with self._failing_write("the final files"):
            final.move_into_place()
        for name in final.remove:
            self._disown(name)
        if card is not None:
            self._card_written(card.name, [card.sha256])
        elif final.remove:
            self._write_json(MANIFEST, self.manifest)

    def record_failure(self, info: dict[str, Any]) -> None:
        """run.json after a write failed, `info` being this invocation's record (its failure
        last in `invocations`): the final files described as they are now
        (final_set.failure_record). A run that leaves nothing behind records nothing, nor
        does an --overwrite whose removal of the earlier files was cut short (no run.json
        then: no set is claimed). A write that fails too (the disk still full, the lease
        lost) leaves the run.json standing, which describes the files as they are."""
        if self.leaves_nothing or self._discard is not None:
            return
        standing = self._journal
        if standing is None:
            with contextlib.suppress(OSError, ValueError):
                standing = dataset.read_run_info(self.out)
        with contextlib.suppress(OutputError):
            self._own("run.json")
            self._write_run_json(failure_record(info, standing))

    def assemble(self, keys: Keys, output: OutputSpec, prov: dict[str, str],
                 into: Staging | None = None) -> dataset.Assembled:
        """The final files from the shards: for each current prompt (id -> content key, in
        prompt order) the rows made from that very content, in prompt order. A result whose
        prompt changed since is never taken. Read and written WINDOW prompts at a time.
        Format files an earlier run wrote and this one no longer asks for go with the set."""
        supplied = self._supply(keys)
        self._own(*dataset.output_files(output))
        windows = (self._window(pids, shards) for pids, shards in _windows(supplied))
        with self._staged(into) as final, self._failing_write("the assembled datasets"):
            made = dataset.assemble(final.writing, windows, output, prov, self.draws,
                                    self.branch)
            final.remove |= dataset.stale_files(self.out, made.files,
                                                set(self.manifest["files"]))
        return made

    def _window(self, pids: list[str], shards: list[str]) -> tuple[pa.Table, pa.Table]:
        """The best and candidate rows of these prompts (each from its shard), in their
        order (a shard may supply several windows: each reads only its rows)."""
        by_shard: dict[str, list[str]] = {}
        for pid, shard in zip(pids, shards, strict=True):
            by_shard.setdefault(shard, []).append(pid)
        return (self._rows(by_shard, "best", "id", pids, best_schema(self.draws)),
                self._rows(by_shard, "candidates", "prompt_id", pids,
                           candidate_schema(self.draws, self.branch)))

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
                     failures: list[dict[str, Any]], into: Staging | None = None) -> None:
        self._own("errors.jsonl")
        with self._staged(into) as final, self._failing_write("errors.jsonl"):
            final.put("errors.jsonl", dataset.errors_jsonl(source, problems, failures))

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
        if self._discard is not None or not self.out.fs.exists(name):
            return None
        data = json.loads(self.out.fs.cat_file(name))
        return data if data.get("fingerprint") == self.fingerprint else None

    def write_calibration(self, data: dict[str, Any]) -> None:
        """Written once the calibration prompts are done: a resume reuses the choice."""
        self._own(CALIBRATION)
        self._write_json(CALIBRATION, {**data, "fingerprint": self.fingerprint})

    def previous_run_info(self) -> dict[str, Any] | None:
        """The run.json an earlier invocation wrote here (None when this run overwrites)."""
        return None if self._discard is not None else dataset.read_run_info(self.out)

    def write_run_info(self, info: dict[str, Any]) -> None:
        self._own("run.json")
        self._write_run_json(info)

    def _write_run_json(self, info: dict[str, Any]) -> None:
        with self._failing_write("run.json"):
            dataset.write_run_info(self.out, info, durable=True)
        self._recorded = True

    def table_stats(self, names: list[str], staged: Staging | None = None
                    ) -> dict[str, dict[str, Any]]:
        """Rows, uncompressed bytes, file bytes and a content digest of each parquet file
        in `names` (in `staged`, when given), from the footers (no row is read: the footer's
        per-chunk statistics and sizes stand for the content, at any file size)."""
        stats = {}
        for name in (n for n in names if n.endswith(".parquet")):
            path = staged.path(name) if staged is not None else self.out.path(name)
            size = self.out.fs.size(path)
            with self.out.fs.open(path, "rb") as fh:
                meta = pq.ParquetFile(fh).metadata
                fh.seek(size - 8)
                footer_len = int.from_bytes(fh.read(4), "little")
                fh.seek(size - 8 - footer_len)
                footer = fh.read(footer_len)
            stats[name.removesuffix(".parquet")] = {
                "rows": meta.num_rows, "file_bytes": size,
                "bytes": sum(meta.row_group(i).total_byte_size
                             for i in range(meta.num_row_groups)),
                "digest": hashlib.sha256(footer + size.to_bytes(8, "little")).hexdigest()[:16]}
        return stats

    def write_card(self, text: str, echo=print, into: Staging | None = None) -> None:
        """The dataset card, whole or not at all: README.md while that is absent or as our
        runs wrote it; otherwise the user's README.md stays (no longer ours, so no
        --overwrite removes it) and the card is README.specrej.md, said in one line. The
        manifest holds the card's sha256 from before it is moved into place (the old one
        too, until the new card is there: a run killed in between still knows its card)."""
        data = text.encode()
        state = self.card_state(self.manifest)
        if state in _KEPT:
            echo(f"[specrej] {self.out.url_of(CARD)} {_KEPT[state]}: kept; the new card is "
                 f"{self.out.url_of(CARD_ASIDE)}")
            self._disown(CARD)
        name = CARD_ASIDE if state in _KEPT else CARD
        self._own(name)
        with self._staged(into) as final, self._failing_write(name):
            if name == CARD and CARD_ASIDE in self.manifest["files"]:
                final.remove.add(CARD_ASIDE)  # README.md is the card again: no second card
            final.put(name, data)
            final.card = Card(name, final.files[name].sha256)

    def card_state(self, manifest: dict[str, Any]) -> str:
        """README.md by `manifest`: absent; ours (listed, and its bytes as written); edited
        (listed, bytes changed); unknown (listed by a run that recorded no digest); foreign
        (not listed: the user's own, or kept before as edited)."""
        current = self._sha256(CARD)
        if current is None:
            return "absent"
        if CARD not in (manifest.get("files") or []):
            return "foreign"
        digests = _card_digests(manifest).get(CARD)
        if not digests:
            return "unknown"
        return "ours" if current in digests else "edited"

    def _card_written(self, name: str, digests: list[str]) -> None:
        self.manifest[CARD_DIGESTS] = {**_card_digests(self.manifest), name: digests}
        self._write_json(MANIFEST, self.manifest)

    def _disown(self, name: str) -> None:
        """`name` is the user's from now on: not listed, no digest (written with the card)."""
        self.manifest["files"] = [n for n in self.manifest["files"] if n != name]
        digests = _card_digests(self.manifest)
        digests.pop(name, None)
        self.manifest[CARD_DIGESTS] = digests

    def _sha256(self, name: str) -> str | None:
        """sha256 of the file `name` (None: there is none; a folder there matches nothing)."""
        path = self.out.path(name)
        fs = self.out.fs
        fs.invalidate_cache(self.out.root)
        if not fs.exists(path):
            return None
        return hashlib.sha256(fs.cat_file(path)).hexdigest() if fs.isfile(path) else "folder"


def _windows(supplied: Supplied) -> Iterator[tuple[list[str], list[str]]]:
    """The prompts that have rows, in prompt order, WINDOW at a time, with their shards."""
    at = np.flatnonzero(supplied.mask)
    for start in range(0, len(at), WINDOW):
        part = at[start : start + WINDOW]
        pids = supplied.table.ids.take(pa.array(part, pa.int64())).to_pylist()
        yield pids, [supplied.shards[i] for i in supplied.owner[part]]


def _card_digests(manifest: dict[str, Any]) -> dict[str, list[str]]:
    """The manifest's card digests (anything malformed there counts as none)."""
    found = manifest.get(CARD_DIGESTS)
    if not isinstance(found, dict):
        return {}
    return {name: [d for d in ds if isinstance(d, str)] for name, ds in found.items()
            if isinstance(ds, list)}


def _same(a: ContentKeys, b: ContentKeys) -> bool:
    return a is b or (len(a) == len(b) and a.ids.equals(b.ids)
                      and bool(np.array_equal(a.digests, b.digests)))


def _split(record: dict[str, Any]) -> tuple[dict[str, Any], ContentKeys]:
    """A shard record as kept in memory (its prompts counted) and its prompts' content keys
    as a ContentKeys table (a dict per prompt would not fit a job of millions)."""
    keys = ContentKeys.of(record["prompts"], indexed=False)
    return {**record, "prompts": len(keys)}, keys


def check_earlier(out: Location, found: Survey, policy: str, fingerprint: str,
                  spec: dict[str, Any]) -> None:
    """What output.if_exists and the earlier runs' manifest refuse of the results `found`
    at `out`: results at all (refuse), or, unless they are to be overwritten, results of
    another layout or of a different spec. (The shard records are read under the lock
    only, by OutputDir.open: there may be thousands.)"""
    if found.ours and policy == "refuse":
        raise OutputError(f"output.path: {out} already has results; set "
                          "output.if_exists to resume or overwrite (or pass --overwrite)")
    header = found.manifest
    if policy == "overwrite" or header is None:
        return
    layout = header.get("layout", 1)
    if isinstance(layout, int) and layout > LAYOUT:
        raise OutputError(f"output.path: {out} was written by a newer specrej-ray "
                          f"(manifest layout {layout}); use that version or another "
                          "output.path")
    if layout != LAYOUT:
        raise OutputError(f"output.path: {out} was written by an older specrej-ray "
                          f"(manifest layout {layout}); pass --overwrite or use another "
                          "output.path")
    if header.get("fingerprint") != fingerprint:
        # Only what the fingerprint hashes blocks a resume: a copied output's new
        # output.path (or a new shard size) is no change of results.
        changed = ", ".join(_changed_keys(fingerprinted(header.get("spec") or {}),
                                          fingerprinted(spec))) or "the spec"
        raise OutputError(f"output.path: {out} holds results of a different spec "
                          f"(changed: {changed}); pass --overwrite or use another "
                          "output.path")


def check_output(url: str, spec: JobSpec | None = None) -> None:
    """What a run would refuse of output.path, told without writing anything or taking it
    (`validate`, and the checks before a run): a place it could create or use (not on a
    kernel filesystem, not inside or around another output, empty or ours, no links; a
    local path: its nearest existing folder is a writable folder), held by no other run;
    with the spec, also the prompts not inside it and the results there (check_earlier)."""
    out = dataset.locate(url)
    local = isinstance(out.fs, LocalFileSystem)
    if local:
        path = Path(out.root)
        existing = next(p for p in (path, *path.parents) if p.exists())
        check_filesystem(str(existing), out)
    check_not_nested(out)
    found = survey(out)
    if local:
        if not existing.is_dir():
            raise OutputError(f"output.path: cannot create {out}: {existing} is a file, not "
                              "a folder; choose another location")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise OutputError(f"output.path: cannot write to {existing} (permission denied); "
                              "choose a writable location")
    # An object store: only a write can tell whether it may be written, and this writes
    # nothing; its lease says whether another run holds it.
    check_free(out, spec.output.lease_ttl_s if spec is not None else 60.0)
    if spec is not None:
        check_prompts_outside(spec.prompts.path, url)
        check_earlier(out, found, spec.output.if_exists, spec.fingerprint(),
                      spec.model_dump(mode="json"))


def check_prompts_outside(prompts_path: str, url: str) -> None:
    """A run never reads its prompts from inside its own output: the file could be replaced
    (or, with --overwrite, removed) while it is read."""
    out = dataset.locate(url)
    if not isinstance(out.fs, LocalFileSystem):
        return
    root = os.path.realpath(out.root)
    source = os.path.realpath(os.path.expanduser(prompts_path))
    if os.path.commonpath([root, source]) == root:
        raise OutputError(f"prompts.path: '{prompts_path}' is inside output.path ({url}), "
                          "which the run writes; copy the prompts elsewhere first")


def _remove_if_empty(out: Location, created: bool) -> None:
    """The directory a run made, if nothing was written into it (a refused run)."""
    if not created or not isinstance(out.fs, LocalFileSystem):
        return
    with contextlib.suppress(OSError):
        os.rmdir(out.root)


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

