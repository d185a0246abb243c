"""Output files: per-shard results written atomically, a manifest, and the final dataset."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specrej_ray.engine.sequence import PromptResult
from specrej_ray.prompts import Prompt, RowProblem, chat_messages

MANIFEST = "manifest.json"
OUR_FILES = (
    "shards",
    MANIFEST,
    "best.parquet",
    "best.jsonl",
    "candidates.parquet",
    "run.json",
    "errors.jsonl",
)

_PARTIAL = pa.list_(pa.struct([("tokens", pa.int64()), ("score", pa.float64())]))
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
    ]
)
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
BEST_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("system", pa.string()),
        ("response", pa.string()),
        ("reward", pa.float64()),
        ("messages", _MESSAGES),
        ("finish_reason", pa.string()),
        ("n", pa.int64()),
        ("n0", pa.int64()),
        ("waves", pa.int64()),
        ("rounds", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("tokens_generated", pa.int64()),
        ("candidates_finished", pa.int64()),
        ("candidates_rejected", pa.int64()),
        ("seconds", pa.float64()),
    ]
)


class OutputError(Exception):
    """The output directory cannot be used as asked (one line, names output.path)."""


@dataclass
class Manifest:
    fingerprint: str
    spec: dict[str, Any]
    shards: dict[str, list[str]] = field(default_factory=dict)  # finished shard -> prompt ids

    def save(self, out: Path) -> None:
        _write_atomic(out / MANIFEST, json.dumps(self.__dict__, indent=1).encode())

    @classmethod
    def load(cls, out: Path) -> Manifest | None:
        path = out / MANIFEST
        return cls(**json.loads(path.read_text())) if path.exists() else None


def prepare_output(out: Path, policy: str, fingerprint: str, spec: dict[str, Any]) -> Manifest:
    """Apply output.if_exists and return the manifest to continue from."""
    old = Manifest.load(out)
    has_ours = out.exists() and any((out / f).exists() for f in OUR_FILES)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output.path: {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not has_ours:
        raise OutputError(
            f"output.path: {out} is a non-empty directory that is not a "
            "specrej-ray output; choose a new or empty path"
        )
    if has_ours and policy == "refuse":
        raise OutputError(
            f"output.path: {out} already has results; set output.if_exists to "
            "resume or overwrite (or pass --overwrite)"
        )
    if has_ours and policy == "overwrite":
        for name in OUR_FILES:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        old = None
    if old is not None and old.fingerprint != fingerprint:
        changed = ", ".join(_changed_keys(old.spec, spec)) or "the spec"
        raise OutputError(
            f"output.path: {out} holds results of a different spec (changed: "
            f"{changed}); pass --overwrite or use another output.path"
        )
    (out / "shards").mkdir(parents=True, exist_ok=True)
    manifest = old or Manifest(fingerprint=fingerprint, spec=spec)
    manifest.save(out)
    return manifest


def _changed_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out: list[str] = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _changed_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def result_rows(prompt: Prompt, result: PromptResult, n: int) -> tuple[dict, list[dict]]:
    """One best-of-N row and one row per candidate for a finished prompt."""
    best = result.candidates[result.best] if result.best is not None else None
    cands = [
        {
            "prompt_id": prompt.id,
            "candidate": c.index,
            "status": "finished" if c.finished else "rejected",
            "finish_reason": c.finish_reason,
            "rejected_round": c.rejected_round,
            "text": c.text,
            "num_tokens": len(c.tokens),
            "final_score": c.final_score,
            "partial_scores": [{"tokens": t, "score": s} for t, s in c.partial_scores],
            "is_best": c is best,
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
        "n": n,
        "n0": result.n0,
        "waves": result.waves,
        "rounds": result.rounds,
        "prompt_tokens": result.prompt_tokens,
        "tokens_generated": result.tokens_generated,
        "candidates_finished": result.finished,
        "candidates_rejected": result.rejected,
        "seconds": result.seconds,
    }
    return row, cands


def write_shard(out: Path, shard_id: str, best: list[dict], candidates: list[dict]) -> None:
    """Both files go to temporary names, then are renamed: a shard is whole or absent."""
    shard_dir = out / "shards"
    _write_table(shard_dir / f"{shard_id}.candidates.parquet", candidates, CANDIDATE_SCHEMA)
    _write_table(shard_dir / f"{shard_id}.best.parquet", best, BEST_SCHEMA)


def assemble(out: Path, manifest: Manifest, order: list[str]) -> dict[str, int]:
    """Concatenate finished shards (in shard order) into the final files."""
    shard_dir = out / "shards"
    done = [s for s in order if s in manifest.shards]
    best = _concat([shard_dir / f"{s}.best.parquet" for s in done], BEST_SCHEMA)
    cands = _concat([shard_dir / f"{s}.candidates.parquet" for s in done], CANDIDATE_SCHEMA)
    _write_parquet_atomic(out / "best.parquet", best)
    _write_parquet_atomic(out / "candidates.parquet", cands)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in best.to_pylist())
    _write_atomic(out / "best.jsonl", lines.encode())
    return {"prompts": best.num_rows, "candidates": cands.num_rows}


def write_errors(
    out: Path, source: str, problems: list[RowProblem], failures: list[dict[str, Any]]
) -> None:
    rows = [{"row": p.row, "id": p.id, "source": source, "reason": p.reason} for p in problems]
    rows += failures
    _write_atomic(
        out / "errors.jsonl",
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode(),
    )


def write_run_info(out: Path, info: dict[str, Any]) -> None:
    _write_atomic(out / "run.json", json.dumps(info, indent=1, default=str).encode())


def _concat(paths: list[Path], schema: pa.Schema) -> pa.Table:
    if not paths:
        return schema.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=schema) for p in paths])


def _write_table(path: Path, rows: list[dict], schema: pa.Schema) -> None:
    _write_parquet_atomic(path, pa.Table.from_pylist(rows, schema=schema))


def _write_parquet_atomic(path: Path, table: pa.Table) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
