"""Loading a finished run's output into plain Python structures.

Files are opened through fsspec so OUTPUT may be a URL (file://, s3://, memory://) as well as
a local path. Only the columns the report uses are read: the candidate texts are the bulk of
candidates.parquet and later versions add columns we do not need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from specrej_ray.data.dataset import locate
from specrej_ray.errors import OutputError

BEST_COLUMNS = ("id", "reward", "finish_reason", "tokens_generated")
OPTIONAL_BEST_COLUMNS = ("tokens_discarded",)  # outputs of earlier versions lack it
CANDIDATE_COLUMNS = (
    "prompt_id",
    "candidate",
    "status",
    "finish_reason",
    "rejected_round",
    "num_tokens",
    "final_score",
    "partial_scores",
    "is_best",
)
# run.json and these two are what every finished run has; errors.jsonl may be absent.
REQUIRED = ("run.json", "best.parquet", "candidates.parquet")


class ReportError(Exception):
    """OUTPUT is not a readable specrej-ray output directory (one line, names the path)."""


@dataclass
class RunData:
    location: str  # OUTPUT as the user gave it
    info: dict[str, Any]  # run.json
    best: list[dict[str, Any]]
    candidates: list[dict[str, Any]]
    errors: list[dict[str, Any]] = field(default_factory=list)


def load_run(location: str) -> RunData:
    try:
        out = locate(location)
    except OutputError as e:
        raise ReportError(f"{location}: {str(e).removeprefix('output.path: ')}") from None
    fs = out.fs
    if fs.isfile(out.root):
        raise ReportError(f"{location}: is a file; give the run's output folder (its "
                          f"output.path, which holds run.json){_folder_hint(location, out)}")
    if not fs.isdir(out.root):
        raise ReportError(f"{location}: no such directory; give the run's output folder "
                          "(its output.path, which holds run.json)")
    missing = [name for name in REQUIRED if not fs.exists(out.path(name))]
    if missing:
        raise ReportError(
            f"{location}: not a finished specrej-ray output (missing {', '.join(missing)})"
        )
    info = _reading(location, "run.json", lambda p: json.loads(_read_bytes(fs, p)), out)
    best = _reading(location, "best.parquet",
                    lambda p: _read_parquet(fs, p, BEST_COLUMNS, OPTIONAL_BEST_COLUMNS), out)
    candidates = _reading(location, "candidates.parquet",
                          lambda p: _read_parquet(fs, p, CANDIDATE_COLUMNS), out)
    errors = _reading(location, "errors.jsonl", lambda p: _read_errors(fs, p), out)
    if not isinstance(info, dict) or "spec" not in info:
        raise ReportError(f"{location}: run.json has no 'spec'; not a specrej-ray run")
    return RunData(location, info, best, candidates, errors)


def _folder_hint(location: str, out) -> str:
    """', e.g. FOLDER' when the file is one of a run's own (its folder holds run.json)."""
    folder = out.root.rstrip("/").rpartition("/")[0]
    shown = location.rstrip("/").rpartition("/")[0]
    return f", e.g. {shown}" if folder and out.fs.exists(f"{folder}/run.json") else ""


def _reading(location: str, name: str, read, out) -> Any:
    """read(path of `name`), or a ReportError naming the file that could not be read."""
    try:
        return read(out.path(name))
    except (OSError, ValueError) as e:  # ArrowInvalid and JSONDecodeError are ValueErrors
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ReportError(f"{location}: cannot read {name}: {why}; the file is damaged: run "
                          "the job again to rebuild it from its shards") from None


def _read_bytes(fs, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read()


def _read_parquet(fs, path: str, columns: tuple[str, ...],
                  optional: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        have = set(pf.schema_arrow.names)
        missing = [c for c in columns if c not in have]
        if missing:
            raise ValueError(f"{path.rsplit('/', 1)[-1]} lacks column(s) {', '.join(missing)}")
        return pf.read(columns=[*columns, *(c for c in optional if c in have)]).to_pylist()


def _read_errors(fs, path: str) -> list[dict[str, Any]]:
    if not fs.exists(path):
        return []
    text = _read_bytes(fs, path).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
