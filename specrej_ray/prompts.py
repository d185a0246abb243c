"""Loading prompts (jsonl/json/parquet/csv/HF dataset dir), stable ids and chat templates."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrej_ray.spec import PromptsSpec

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# datasets' builder for each file format (jsonl and json share one reader).
_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}
_BATCH = 10_000


class PromptError(Exception):
    """The prompt source as a whole is unusable; str() is one line naming file and field."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    system: str | None
    row: int  # 1-based record number in the source (CSV: not counting the header)


@dataclass(frozen=True)
class RowProblem:
    row: int
    id: str | None
    reason: str

    def line(self, source: str) -> str:
        who = f" (id '{self.id}')" if self.id is not None else ""
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


def _check_columns(columns: list[str], spec: PromptsSpec) -> None:
    for key in ("prompt_field", "id_field", "system_field"):
        name = getattr(spec, key)
        if name is not None and name not in columns:
            raise PromptError(
                f"prompts.{key}: no column '{name}' in '{spec.path}' "
                f"(columns: {', '.join(columns) or 'none'})"
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
    return None


def load_prompts(spec: PromptsSpec) -> PromptSet:
    """Read every valid prompt; a bad row becomes a RowProblem, a bad source a PromptError."""
    path = Path(spec.path).expanduser()
    if not path.exists():
        raise PromptError(f"prompts.path: '{spec.path}' does not exist; check the path")
    fmt = spec.format or infer_format(path)
    ds = _read(path, fmt)
    _check_columns(list(ds.column_names), spec)
    columns = [c for c in (spec.prompt_field, spec.id_field, spec.system_field) if c]
    columns = list(dict.fromkeys(columns))

    prompts: list[Prompt] = []
    problems: list[RowProblem] = []
    first_row: dict[str, int] = {}
    for row, rec in enumerate(_rows(ds, columns), start=1):
        if spec.limit is not None and len(prompts) >= spec.limit:
            break
        raw_id = rec[spec.id_field] if spec.id_field else None
        shown_id = None if raw_id is None or str(raw_id).strip() == "" else str(raw_id)
        text = rec[spec.prompt_field]
        reason = _text_problem(text, spec.prompt_field)
        if reason:
            problems.append(RowProblem(row, shown_id, reason))
            continue
        system = rec[spec.system_field] if spec.system_field else None
        if not (isinstance(system, str) and system.strip()):
            system = spec.system
        if spec.id_field:
            if shown_id is None:
                problems.append(RowProblem(row, None, f"{spec.id_field} is missing or empty"))
                continue
            pid = shown_id
        else:
            pid = prompt_id(text, system)
        if pid in first_row:
            problems.append(
                RowProblem(row, pid, f"duplicate id '{pid}' (first at row {first_row[pid]})")
            )
            continue
        first_row[pid] = row
        prompts.append(Prompt(id=pid, text=text, system=system, row=row))
    return PromptSet(prompts=prompts, problems=problems, source=spec.path)


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
