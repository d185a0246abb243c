"""Output files: per-shard results written atomically, a manifest, and the final dataset.

Everything goes through fsspec, so output.path may be a local path or any fsspec URL
(`s3://`, `gs://`, `file://`, `memory://`).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from specrej_ray.data import formats
from specrej_ray.data.prompts import Prompt, RowProblem, chat_messages
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.errors import OutputError
from specrej_ray.spec import OutputSpec

# Every name a run may write at the top of output.path. What a run owns is what its
# manifest lists (output_guard.py); this is what a manifest of before that list owns.
_FORMAT_STEMS = [stem for stems in formats.FILES.values() for stem in stems]
OUR_FILES = (
    "shards",
    "manifest.json",
    "best.parquet",
    "best.jsonl",
    "candidates.parquet",
    "candidates.jsonl",
    "run.json",
    "calibration.json",
    "errors.jsonl",
    *(f"{stem}.{ext}" for stem in _FORMAT_STEMS for ext in ("parquet", "jsonl")),
)

_PARTIAL = pa.list_(pa.struct([("tokens", pa.int64()), ("score", pa.float64())]))
_VERDICTS = pa.list_(pa.struct([("reward", pa.string()), ("id", pa.string()),
                                ("followed", pa.bool_())]))
CANDIDATE_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("candidate", pa.int64()),
        ("status", pa.string()),
        ("finish_reason", pa.string()),
        ("rejected_round", pa.int64()),
        ("text", pa.string()),
        ("num_tokens", pa.int64()),
        ("final_score", pa.float64()),
        ("partial_scores", _PARTIAL),
        ("is_best", pa.bool_()),
        # Final score per reward model of an ensemble (empty with a single reward).
        ("component_scores", pa.list_(pa.struct([("name", pa.string()), ("score", pa.float64())]))),
        # reward.instructions: each instruction's verdict on the final response.
        ("instructions", _VERDICTS),
    ]
)
BEST_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("system", pa.string()),
        ("response", pa.string()),
        ("reward", pa.float64()),
        ("messages", formats.MESSAGES),
        ("finish_reason", pa.string()),
        ("n", pa.int64()),
        ("n0", pa.int64()),
        ("waves", pa.int64()),
        ("rounds", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("tokens_generated", pa.int64()),
        # Decoded past a decision (scores out) by candidates it then rejected, then cut.
        ("tokens_discarded", pa.int64()),
        ("candidates_finished", pa.int64()),
        ("candidates_rejected", pa.int64()),
        ("candidates_pruned", pa.int64()),  # stopped by bounds (search.bounds)
        ("seconds", pa.float64()),
    ]
)


# With search.draws (per-prompt budgets, engine.draws): why each prompt stopped drawing and its
# draws, on its best row and on each of its candidates' rows. Without, the files are as
# before (no such columns).
DRAW_FIELDS = [("stop_reason", pa.string()), ("draws", pa.int64())]
# With search.branch: the candidate each one continues, and from how many of its tokens (null
# for the prompt's own candidates).
BRANCH_FIELDS = [("parent", pa.int64()), ("forked_at", pa.int64())]


def best_schema(draws: bool = False) -> pa.Schema:
    return pa.schema([*BEST_SCHEMA, *DRAW_FIELDS]) if draws else BEST_SCHEMA


def candidate_schema(draws: bool = False, branch: bool = False) -> pa.Schema:
    if not (draws or branch):
        return CANDIDATE_SCHEMA
    return pa.schema([*CANDIDATE_SCHEMA, *(DRAW_FIELDS if draws else []),
                      *(BRANCH_FIELDS if branch else [])])


@dataclass(frozen=True)
class Location:
    """output.path resolved: the filesystem, the root on it, and the URL as the user wrote it."""

    url: str
    fs: AbstractFileSystem
    root: str

    def __str__(self) -> str:
        return self.url

    def path(self, *names: str) -> str:
        return "/".join([self.root.rstrip("/"), *names])

    def url_of(self, name: str) -> str:
        """A file's address for messages, in the user's own spelling."""
        return f"{self.url.rstrip('/')}/{name}"


def locate(url: str | Path) -> Location:
    """A local path (`~` expanded) or an fsspec URL; never a pathlib.Path of a URL, which
    would fold `memory://x` into `memory:/x`."""
    try:
        fs, root = fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]  # e.g. "Install s3fs to access S3"
        raise OutputError(f"output.path: cannot open {url} ({why})") from None
    return Location(str(url), fs, root)


def result_rows(prompt: Prompt, result: PromptResult) -> tuple[dict, list[dict]]:
    """One best-of-N row and one row per candidate for a finished prompt."""
    best = result.candidates[result.best] if result.best is not None else None
    cands = [
        {
            "prompt_id": prompt.id,
            "candidate": c.index,
            "status": c.status.value,
            "finish_reason": c.finish_reason,
            "rejected_round": c.rejected_round,
            "text": c.text,
            "num_tokens": len(c.tokens),
            "final_score": c.final_score,
            "partial_scores": [{"tokens": t, "score": s} for t, s in c.partial_scores],
            "is_best": c is best,
            "component_scores": [
                {"name": name, "score": score} for name, score in sorted(c.components.items())
            ],
            "instructions": [{"reward": reward, **v} for reward, verdicts in
                             sorted(c.details.items()) for v in verdicts],
        }
        for c in result.candidates
    ]
    response = best.text if best else ""
    row = {
        "id": prompt.id,
        "prompt": prompt.text,
        "system": prompt.system,
        "response": response,
        "reward": best.final_score if best else None,
        "messages": chat_messages(prompt, response),
        "finish_reason": best.finish_reason if best else None,
        "n": len(result.candidates),
        "n0": result.n0,
        "waves": result.waves,
        "rounds": result.rounds,
        "prompt_tokens": result.prompt_tokens,
        "tokens_generated": result.tokens_generated,
        "tokens_discarded": result.discarded_tokens,
        "candidates_finished": result.finished,
        "candidates_rejected": result.rejected,
        "candidates_pruned": result.pruned,
        "seconds": result.seconds,
    }
    if result.stop_reason is not None:
        drawn = {"stop_reason": result.stop_reason, "draws": result.draws}
        row.update(drawn)
        for c in cands:
            c.update(drawn)
    if result.branched:
        for c, cand in zip(cands, result.candidates, strict=True):
            c.update(parent=cand.parent, forked_at=cand.forked_at)
    return row, cands


@dataclass
class Assembled:
    counts: dict[str, int]  # prompts and candidates in the final files
    filters: dict[str, Any]  # what each filter removed (formats.derive)
    files: list[str]  # names written under output.path


def output_files(output: OutputSpec) -> list[str]:
    """The names assemble() writes for this output section."""
    return list(_file_schemas(output, {}))


def assemble(open_file: Callable[[str], AbstractContextManager[BinaryIO]],
             windows: Iterable[tuple[pa.Table, pa.Table]], output: OutputSpec,
             prov: dict[str, str], draws: bool = False, branch: bool = False) -> Assembled:
    """Write the final files from the selected shard rows, then derive the training formats
    from them. Deriving here, from the shards, means a rerun with other formats or filters
    rebuilds them without generating anything.

    `windows`: (best, candidates) tables of a few thousand prompts at a time, in prompt order,
    each prompt's candidates in the same window as its best row. Every file is appended to
    window by window through `open_file(name)` (final_set.Staging.writing: a temp name, made
    visible with the rest of the set), so the rows in memory are one window's however many
    prompts the job has."""
    schemas = _file_schemas(output, prov, draws, branch)
    counts = {"prompts": 0, "candidates": 0, "tokens_generated": 0, "tokens_discarded": 0}
    filters = formats.derive([], [], output, prov).filters  # every count at zero
    with contextlib.ExitStack() as files:
        sinks = {name: files.enter_context(_appending(open_file(name), schema))
                 for name, schema in schemas.items()}
        for best, cands in windows:
            _add_counts(filters, _write_window(sinks, best, cands, output, prov))
            counts["prompts"] += best.num_rows
            counts["candidates"] += cands.num_rows
            for column in ("tokens_generated", "tokens_discarded"):  # null in older shards
                counts[column] += pc.sum(best.column(column)).as_py() or 0
    return Assembled(counts, filters, list(schemas))


def _file_schemas(output: OutputSpec, prov: dict[str, str], draws: bool = False,
                  branch: bool = False) -> dict[str, pa.Schema | None]:
    """Every file this output writes, in the order run.json lists them (None: jsonl)."""
    files: dict[str, pa.Schema | None] = {
        "best.parquet": _with_provenance(best_schema(draws).empty_table(), prov).schema,
        "best.jsonl": None,
        "candidates.parquet": _with_provenance(candidate_schema(draws, branch).empty_table(),
                                               prov).schema,
    }
    if output.jsonl:
        files["candidates.jsonl"] = None
    for stem in (stem for f in output.formats for stem in formats.FILES[f]):
        files[f"{stem}.parquet"] = formats.SCHEMAS[stem]
        if output.jsonl:
            files[f"{stem}.jsonl"] = None
    return files


def _write_window(sinks: dict[str, Any], best: pa.Table, cands: pa.Table, output: OutputSpec,
                  prov: dict[str, str]) -> dict[str, Any]:
    """One window's rows appended to every file; what the filters removed in it."""
    best_rows = best.to_pylist()
    sinks["best.parquet"](_with_provenance(best, prov))
    sinks["candidates.parquet"](_with_provenance(cands, prov))
    sinks["best.jsonl"]([{**r, **prov} for r in best_rows])
    if output.jsonl:
        sinks["candidates.jsonl"]([{**r, **prov} for r in cands.to_pylist()])
    # derive reads a few scalar columns: converting only those keeps this fast.
    derived = formats.derive(best_rows, cands.select(formats.CANDIDATE_FIELDS).to_pylist(),
                             output, prov)
    for stem, rows in derived.files.items():
        sinks[f"{stem}.parquet"](pa.Table.from_pylist(rows, schema=formats.SCHEMAS[stem]))
        if output.jsonl:
            sinks[f"{stem}.jsonl"](rows)
    return derived.filters


def _add_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Sum formats.derive's filter counts (nested dicts of ints) into total."""
    for key, value in part.items():
        if isinstance(value, dict):
            _add_counts(total[key], value)
        else:
            total[key] += value


@contextlib.contextmanager
def _appending(opened: AbstractContextManager[BinaryIO],
               schema: pa.Schema | None) -> Iterator[Any]:
    """A function that appends to the file `opened` (a table to parquet, rows to jsonl when
    schema is None)."""
    with opened as f:
        if schema is None:
            yield lambda rows: f.write(_jsonl(rows))
            return
        with pq.ParquetWriter(f, schema) as writer:

            def append(table: pa.Table) -> None:
                # No row group of 0 rows (a window without a pair): `datasets` reads a file
                # in batches of its first row group's size and fails on 0 ("BatchSize must
                # be greater than 0"), even when later row groups hold rows.
                if table.num_rows:
                    writer.write_table(table)

            yield append


def stale_files(out: Location, written: list[str], owned: set[str]) -> set[str]:
    """Format files of an earlier run that this run's output.formats / jsonl no longer ask
    for: they would be mistaken for current ones (only ours: a user's file of that name
    stays)."""
    optional = {"candidates.jsonl"} | {
        f"{stem}.{ext}" for stem in _FORMAT_STEMS for ext in ("parquet", "jsonl")
    }
    out.fs.invalidate_cache(out.root)
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in out.fs.ls(out.root, detail=False)}
    return (optional & names & owned) - set(written)


def _with_provenance(table: pa.Table, prov: dict[str, str]) -> pa.Table:
    for name, value in prov.items():
        table = table.append_column(name, pa.array([value] * table.num_rows, pa.string()))
    return table


def errors_jsonl(source: str, problems: list[RowProblem], failures: list[dict[str, Any]]
                 ) -> bytes:
    """errors.jsonl: the skipped prompt rows, then the failed shards."""
    rows = [{"row": p.row, "id": p.id, "source": source, "reason": p.reason} for p in problems]
    return _jsonl(rows + failures)


def write_run_info(out: Location, info: dict[str, Any], durable: bool = False) -> None:
    write_atomic(out, "run.json", json.dumps(info, indent=1, default=str).encode(), durable)


def read_run_info(out: Location) -> dict[str, Any] | None:
    """The run.json an earlier invocation wrote here, or None."""
    path = out.path("run.json")
    if not out.fs.exists(path):
        return None
    return json.loads(out.fs.cat_file(path))


def read_table(out: Location, name: str, schema: pa.Schema | None = None,
               where: pc.Expression | None = None) -> pa.Table:
    """A parquet file's rows (those matching `where`, if given)."""
    with out.fs.open(out.path(name), "rb") as f:
        return pq.read_table(f, schema=schema, filters=where)


def write_table(out: Location, name: str, rows: list[dict], schema: pa.Schema) -> None:
    _write_parquet_atomic(out, name, pa.Table.from_pylist(rows, schema=schema))


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def tmp_name(out: Location, name: str) -> str:
    folder, _, base = name.rpartition("/")
    tmp = f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return out.path(folder, tmp) if folder else out.path(tmp)


def _write_parquet_atomic(out: Location, name: str, table: pa.Table) -> None:
    def write(tmp: str) -> None:
        with out.fs.open(tmp, "wb") as f:
            pq.write_table(table, f)

    _publish(out, name, write)


def write_atomic(out: Location, name: str, data: bytes, durable: bool = False) -> None:
    _publish(out, name, lambda tmp: out.fs.pipe_file(tmp, data), durable)


def _publish(out: Location, name: str, write, durable: bool = False) -> None:
    """`write(tmp)` writes the whole file; see _publishing."""
    with _publishing(out, name, durable) as tmp:
        write(tmp)


@contextlib.contextmanager
def _publishing(out: Location, name: str, durable: bool = False) -> Iterator[str]:
    """A temporary name to write, then a move: a rename on local disks (atomic); object
    stores only ever show whole objects, so a reader never sees half a file either way. A
    write or a move that fails (a full disk) leaves no temporary file behind. `durable`: on a local
    disk the file is synced before the rename and the folder after, so that what comes
    next (final_set.py's renames after run.json says `publishing`) is never on the disk
    before it."""
    tmp = tmp_name(out, name)
    try:
        yield tmp
        if durable:
            sync(out, tmp)
        out.fs.mv(tmp, out.path(name))
    except BaseException:
        with contextlib.suppress(Exception):
            out.fs.rm(tmp)
        raise
    if durable:
        sync(out, out.path(name).rpartition("/")[0] or out.root)


def sync(out: Location, path: str) -> None:
    """A file's bytes, or a folder's names, on the disk (local disks; an object store
    acknowledges a write once it is durable)."""
    if not isinstance(out.fs, LocalFileSystem):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
