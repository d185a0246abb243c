"""Loading prompts (jsonl/json/parquet/csv/HF dataset dir), stable ids and chat templates."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specrej_ray.data.content_keys import hash64
from specrej_ray.spec import PromptsSpec

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# datasets' builder for the formats we do not parse ourselves.
_BUILDERS = {"parquet": "parquet", "csv": "csv"}
_BATCH = 10_000
# A prompt row of JSON Lines: past this, one line is a row problem, not a MemoryError (a
# file with no newline at all, say); a prompt is text, a few KB.
MAX_LINE_BYTES = 1 << 20


class PromptError(Exception):
    """The prompt source as a whole is unusable; str() is one line naming file and field."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    system: str | None
    row: int  # 1-based record number in the source (CSV: not counting the header; JSONL: line)
    # The row's columns a reward reads (reward.row_fields), as canonical JSON; None: none.
    extra: str | None = None


@dataclass(frozen=True)
class PromptTask:
    prompt_id: str
    text: str  # the raw user prompt, as the reward sees it
    input_ids: list[int]  # the generator's rendered and tokenized prompt
    # input_ids are exactly the context a reward on the generator's own likelihood scores
    # a response in: the engine scores that reward itself (job.prepare.self_likelihood).
    self_scored: bool = False
    extra: str | None = None  # Prompt.extra: the row's columns its rewards read


@dataclass(frozen=True)
class RowProblem:
    row: int
    id: str | None
    reason: str

    def line(self, source: str) -> str:
        who = f" (id {self.id!r})" if self.id is not None else ""  # repr: one line
        return f"{source} row {self.row}{who}: {self.reason}; row skipped"


@dataclass
class PromptSet:
    prompts: list[Prompt]
    problems: list[RowProblem] = field(default_factory=list)
    source: str = ""


def prompt_id(text: str, system: str | None) -> str:
    """Content hash: the same prompt gets the same id in every file and format."""
    blob = f"{system or ''}\x00{text}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def infer_format(path: Path) -> str:
    if path.is_dir():
        return "hf"
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        accepted = ", ".join(FORMATS) + " or a datasets save_to_disk directory"
        raise PromptError(
            f"prompts.path: cannot tell the format of '{path}' from its extension; use {accepted}"
            ", or set prompts.format"
        )
    return fmt


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence datasets' progress bars and info logs for the duration, then restore them."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars_off = datasets.are_progress_bars_disabled()
    level = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if not bars_off:
            datasets.enable_progress_bars()


def _read(path: Path, fmt: str):
    import datasets

    with _quiet_datasets():
        try:
            if fmt == "hf":
                ds = datasets.load_from_disk(str(path), keep_in_memory=True)
                if isinstance(ds, datasets.DatasetDict):
                    ds = _pick_split(ds, path)
                return ds
            # A throwaway cache dir: nothing is written next to the user's file or into
            # ~/.cache, and keep_in_memory keeps the table alive after the dir is gone.
            with tempfile.TemporaryDirectory(prefix="specrej-prompts-") as cache:
                return datasets.load_dataset(
                    _BUILDERS[fmt], data_files=str(path), split="train",
                    cache_dir=cache, keep_in_memory=True,
                )
        except PromptError:
            raise
        except Exception as e:  # datasets raises many types for a bad file; all are fatal
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise PromptError(f"prompts.path: cannot read '{path}' as {fmt}: {reason}") from None


def _pick_split(dd: Any, path: Path):
    if "train" in dd:
        return dd["train"]
    if len(dd) == 1:
        return next(iter(dd.values()))
    raise PromptError(
        f"prompts.path: '{path}' has splits {', '.join(dd)} and none is 'train'; "
        "save the split you want with save_to_disk"
    )


def _check_columns(columns: list[str], spec: PromptsSpec, extra: Extra = ()) -> None:
    named = [(f"prompts.{key}", getattr(spec, key))
             for key in ("prompt_field", "id_field", "system_field")] + list(extra)
    for key, name in named:
        if name is not None and name not in columns:
            raise PromptError(
                f"{key}: no column '{name}' in '{spec.path}' "
                f"(columns: {', '.join(map(repr, columns)) or 'none'})"
            )


def _rows(ds, columns: list[str]) -> Iterator[dict[str, Any]]:
    # Batches of plain columns: fast on millions of rows and stops early under `limit`.
    for batch in ds.select_columns(columns).iter(batch_size=_BATCH):
        n = len(batch[columns[0]])
        for i in range(n):
            yield {c: batch[c][i] for c in columns}


def _text_problem(value: Any, name: str) -> str | None:
    if value is None:
        return f"{name} is missing"
    if not isinstance(value, str):
        return f"{name} is a {type(value).__name__}, not a string"
    if not value.strip():
        return f"{name} is empty"
    return _char_problem(value, name)


def _char_problem(value: str, name: str) -> str | None:
    # Neither survives tokenizing and writing the dataset: refuse them at the row.
    if "\x00" in value:
        return f"{name} contains a NUL character; remove it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{name} contains a lone surrogate ({value[e.start]!r}); fix the text"
    return None


# A record from a file we parse ourselves: a row's fields, or why the row is unusable.
Record = tuple[int, dict[str, Any] | str]
# Columns the rewards read from each row, with the spec key that names each (for errors):
# (("reward.instructions_field", "instruction_id_list"), ...).
Extra = tuple[tuple[str, str], ...]


def _json_row(row: int, value: Any) -> Record:
    if isinstance(value, dict):
        return row, value
    return row, f"row is a JSON {type(value).__name__}, not an object"


def _jsonl_records(path: Path) -> Iterator[Record]:
    """Line by line, so one bad line is one row problem (datasets rejects the whole file),
    and streamed: a file of millions of prompts is never held whole, nor one huge line."""
    with open(path, "rb") as f:
        for row, raw in enumerate(_lines(f), start=1):
            if raw is None:
                limit = _size(MAX_LINE_BYTES)
                yield row, f"line is over the {limit} limit of a prompt row; shorten it"
                continue
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8-sig" if row == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield row, f"byte {e.start + 1} of the line is not UTF-8"
                continue
            try:
                yield _json_row(row, json.loads(text))
            except json.JSONDecodeError as e:
                yield row, f"not valid JSON ({e.msg} at column {e.colno})"
            except (ValueError, RecursionError) as e:
                yield row, f"not valid JSON ({type(e).__name__})"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def _lines(f) -> Iterator[bytes | None]:
    """The file's lines, each read at most MAX_LINE_BYTES at a time: None for a longer one,
    whose rest is read past without being kept."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
            pass
        yield None


def _json_records(path: Path) -> Iterator[Record]:
    """A .json file: one list of objects, or JSON Lines under a .json name.

    Never handed to datasets: its JSON reader (pyarrow) can crash the process on stray bytes.
    """
    raw = path.read_bytes()
    if raw.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] != b"[":
        _refuse_one_object(path, raw)
        yield from _jsonl_records(path)
        return
    try:
        items = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PromptError(
            f"prompts.path: '{path}' is not valid JSON ({e.msg} at line {e.lineno} column "
            f"{e.colno}); fix it, or write JSON Lines (.jsonl) so a bad row is only skipped"
        ) from None
    except (ValueError, RecursionError) as e:
        raise PromptError(f"prompts.path: cannot read '{path}' as json: {type(e).__name__}; "
                          "fix it, or write JSON Lines (.jsonl)") from None
    for row, item in enumerate(items, start=1):
        yield _json_row(row, item)


def _refuse_one_object(path: Path, raw: bytes) -> None:
    """A pretty-printed object over many lines would read as one bad row per line."""
    if len([line for line in raw.splitlines() if line.strip()]) < 2:
        return
    try:
        whole = json.loads(raw)
    except (ValueError, RecursionError):
        return  # not one document: JSON Lines, bad lines and all
    if isinstance(whole, dict):
        raise PromptError(f"prompts.path: '{path}' holds one JSON object; give a list of "
                          "objects, or JSON Lines (one object per line)")


class _Source:
    """Every record of the source, streamed. The named columns are checked before the first
    row (files datasets reads: their schema) or, for JSON, over the rows read (check())."""

    def __init__(self, path: Path, fmt: str, spec: PromptsSpec, extra: Extra = ()) -> None:
        self.spec, self.fmt, self.columns, self.extra = spec, fmt, {}, extra
        if fmt in ("jsonl", "json"):
            self.records = (_jsonl_records if fmt == "jsonl" else _json_records)(path)
        else:
            _check_unread(path, fmt, spec, extra)
            ds = _read(path, fmt)
            _check_columns(list(ds.column_names), spec, extra)
            self.records = enumerate(_rows(ds, _wanted(spec, extra)), start=1)

    def __iter__(self) -> Iterator[Record]:
        wanted = _wanted(self.spec, self.extra)
        for row, rec in self.records:
            if isinstance(rec, dict) and self.fmt in ("jsonl", "json"):
                self.columns.update(dict.fromkeys(rec))
                rec = _pick(rec, wanted)
            yield row, rec

    def check(self) -> None:
        """With no object at all, the row problems say more than "no column"."""
        if self.fmt in ("jsonl", "json") and self.columns:
            _check_columns(list(self.columns), self.spec, self.extra)


def _check_unread(path: Path, fmt: str, spec: PromptsSpec, extra: Extra = ()) -> None:
    """What datasets would refuse of a source, found before it is imported (seconds): a
    folder save_to_disk did not write, a CSV header or a parquet schema without a named
    column, an empty CSV. What cannot be read here is left to datasets."""
    if fmt == "hf":
        if not ((path / "dataset_info.json").is_file() and (path / "state.json").is_file()
                or (path / "dataset_dict.json").is_file()):
            raise PromptError(f"prompts.path: '{spec.path}' is a folder that datasets' "
                              "save_to_disk did not write (no dataset_info.json and "
                              "state.json, nor dataset_dict.json); give a prompt file or such "
                              "a folder")
    elif fmt == "csv":
        header = _csv_header(path, spec)
        if header is not None:
            _check_columns(header, spec, extra)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise PromptError(f"prompts.path: cannot read '{path}' as parquet: {reason}"
                              ) from None
        _check_columns(names, spec, extra)


def _csv_header(path: Path, spec: PromptsSpec) -> list[str] | None:
    """A CSV file's column names (None where the csv module cannot tell them as pandas
    would: datasets decides)."""
    import csv

    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            if not f.read(MAX_LINE_BYTES).strip():
                raise PromptError(f"prompts.path: '{spec.path}' holds no prompts; add some rows")
            f.seek(0)
            return next(csv.reader(f))
    except UnicodeDecodeError:
        raise PromptError(f"prompts.path: cannot read '{path}' as csv: it is not UTF-8 text; "
                          "save it as UTF-8") from None
    except (csv.Error, StopIteration, OSError):
        return None


def _wanted(spec: PromptsSpec, extra: Extra = ()) -> list[str]:
    named = (spec.prompt_field, spec.id_field, spec.system_field, *(c for _, c in extra))
    return list(dict.fromkeys(c for c in named if c))


def _pick(rec: dict[str, Any] | str, columns: list[str]) -> dict[str, Any] | str:
    return rec if isinstance(rec, str) else {c: rec.get(c) for c in columns}


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # an over-long name: no such file either
        return False


def _check_kind(path: Path, shown: str) -> None:
    """A regular file or a dataset folder (links followed): a device, a FIFO or a socket
    would be read forever (/dev/zero) or block."""
    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise PromptError(f"prompts.path: '{shown}' is not a regular file (a device, FIFO or "
                          "socket); give a prompt file or a datasets save_to_disk folder")


def load_prompts(spec: PromptsSpec) -> PromptSet:
    """Read every valid prompt; a bad row becomes a RowProblem, a bad source a PromptError."""
    prompts: list[Prompt] = []
    problems: list[RowProblem] = []
    for got in iter_prompts(spec):
        (prompts if isinstance(got, Prompt) else problems).append(got)
    return PromptSet(prompts=prompts, problems=problems, source=spec.path)


def iter_prompts(spec: PromptsSpec, extra: Extra = ()) -> Iterator[Prompt | RowProblem]:
    """The source's prompts and row problems in row order, streamed (up to `limit` valid
    prompts); each prompt carries the `extra` columns (Prompt.extra). A bad source is a
    PromptError: before the first row, or (a JSON file without a named column in any row)
    once its rows are read."""
    path = Path(spec.path).expanduser()
    if not _exists(path):
        raise PromptError(f"prompts.path: '{spec.path}' does not exist; check the path")
    _check_kind(path, spec.path)
    fmt = spec.format or infer_format(path)
    source = _Source(path, fmt, spec, extra)
    seen = SeenIds()
    count = 0  # valid prompts seen, `offset` skipped ones included
    for row, rec in source:
        if spec.limit is not None and count >= spec.offset + spec.limit:
            break
        got = RowProblem(row, None, rec) if isinstance(rec, str) else \
            _row_prompt(row, rec, spec, extra)
        if isinstance(got, Prompt):
            first = seen.add(got.id, row)
            if first is not None:
                got = RowProblem(row, got.id, f"duplicate id {got.id!r} (first at row {first})")
            else:
                count += 1
        # Rows before the slice are another slice's: neither its prompts nor its problems.
        if count > spec.offset or (count == spec.offset and not isinstance(got, Prompt)):
            yield got
    source.check()


class SeenIds:
    """Which ids were seen, and at which row, in about 12 bytes an id: a dict for the latest
    ids, merged into sorted arrays of their 64-bit hashes. Two ids sharing a hash (about 3 in
    10^8 at a million ids) would report a false duplicate in errors.jsonl."""

    _FRESH = 65_536

    def __init__(self) -> None:
        self.fresh: dict[int, int] = {}
        self.hashes: list[np.ndarray] = []  # sorted uint64 arrays
        self.rows: list[np.ndarray] = []  # the row of each hash

    def add(self, pid: str, row: int) -> int | None:
        """The row where `pid` was first seen, or None (then it is recorded at `row`)."""
        h = hash64(pid)
        if h in self.fresh:
            return self.fresh[h]
        key = np.uint64(h)
        for hs, rows in zip(self.hashes, self.rows, strict=True):
            i = int(np.searchsorted(hs, key))
            if i < len(hs) and hs[i] == key:
                return int(rows[i])
        self.fresh[h] = row
        if len(self.fresh) >= self._FRESH:
            self._merge()
        return None

    def _merge(self) -> None:
        hs = np.fromiter(self.fresh.keys(), np.uint64, len(self.fresh))
        rows = np.fromiter(self.fresh.values(), np.int64, len(self.fresh))
        self.fresh = {}
        # Arrays of similar size merge, so there are O(log n) of them.
        while self.hashes and len(self.hashes[-1]) <= len(hs):
            hs = np.concatenate([self.hashes.pop(), hs])
            rows = np.concatenate([self.rows.pop(), rows])
        order = np.argsort(hs, kind="stable")
        self.hashes.append(hs[order])
        self.rows.append(rows[order])


def _row_prompt(row: int, rec: dict[str, Any], spec: PromptsSpec,
                extra: Extra = ()) -> Prompt | RowProblem:
    """One record as a prompt, or the first reason it cannot be one."""
    raw_id = rec[spec.id_field] if spec.id_field else None
    shown_id = None if raw_id is None or str(raw_id).strip() == "" else str(raw_id)
    reason = _char_problem(shown_id, spec.id_field or "id") if shown_id else None
    if reason:  # an id that cannot be written cannot be shown either
        return RowProblem(row, None, reason)
    text = rec[spec.prompt_field]
    reason = _text_problem(text, spec.prompt_field)
    if reason:
        return RowProblem(row, shown_id, reason)
    system = rec[spec.system_field] if spec.system_field else None
    if not (isinstance(system, str) and system.strip()):
        system = spec.system
    if spec.id_field and shown_id is None:
        return RowProblem(row, None, f"{spec.id_field} is missing or empty")
    reason = _char_problem(system, spec.system_field or "system") if system else None
    if reason:
        return RowProblem(row, shown_id, reason)
    pid = shown_id if spec.id_field and shown_id else prompt_id(text, system)
    fields = json.dumps({c: rec.get(c) for _, c in extra}, sort_keys=True, default=str) \
        if extra else None
    return Prompt(id=pid, text=text, system=system, row=row, extra=fields)


def _messages(prompt: Prompt) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": prompt.system}] if prompt.system else []
    return msgs + [{"role": "user", "content": prompt.text}]


def render_prompt(tokenizer, prompt: Prompt, use_chat_template: bool) -> str:
    """The text the generator continues: chat-templated with a generation prompt, or plain."""
    if use_chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise PromptError(
                "generator.chat_template is true but the model has no chat template; "
                "set generator.chat_template: false"
            )
        return tokenizer.apply_chat_template(
            _messages(prompt), tokenize=False, add_generation_prompt=True
        )
    return f"{prompt.system}\n\n{prompt.text}" if prompt.system else prompt.text


def chat_messages(prompt: Prompt, response: str) -> list[dict[str, str]]:
    """The conversational record TRL's SFTTrainer takes: [system], user, assistant."""
    return _messages(prompt) + [{"role": "assistant", "content": response}]


def check_lengths(
    prompts: list[Prompt], rendered_token_counts: list[int], max_new_tokens: int, context: int
) -> tuple[list[int], list[RowProblem]]:
    """Indices of prompts whose tokens plus max_new_tokens fit the context; problems for others."""
    if len(prompts) != len(rendered_token_counts):
        raise ValueError("one token count per prompt is needed")
    kept: list[int] = []
    problems: list[RowProblem] = []
    for i, (p, n) in enumerate(zip(prompts, rendered_token_counts, strict=True)):
        if n + max_new_tokens > context:
            problems.append(RowProblem(p.row, p.id, (
                f"prompt is {n} tokens; with max_new_tokens {max_new_tokens} "
                f"it exceeds the generator's context of {context}"
            )))
        else:
            kept.append(i)
    return kept, problems
