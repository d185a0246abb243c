"""Every module, file, attribute and spec field the docs name exists: a rename that leaves the
docs behind fails here, not in a reader's hands (issue 45). Names are what the docs put in
backticks: paths (`engine/decisions.py`, `bench/chaos.py:40`), dotted modules and their
attributes (`engine.decisions.Decisions`), spec fields (`search.bounds_every`). A bare file
name (`scheduler.py`) is left alone: it may be another project's (Ray's `default_worker.py`)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specrej_ray"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
ROOMS = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
         if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__"}
TOP = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
CODE = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"^[\w./-]+\.(?:py|sh|yaml|yml|jsonl|json|md|toml)(?::\d+(?:,\d+)*)?$")
DATA_SUFFIXES = {"png", "parquet", "json", "jsonl", "html", "md", "py", "yaml", "txt", "log",
                 "arrow", "gguf", "safetensors", "csv"}
DOTTED = re.compile(r"^(?:specrej_ray\.)?([a-z_]+)(?:\.[A-Za-z_]\w*)+(?:\(\))?$")


def _named(doc: Path) -> list[str]:
    return [m.group(1).strip() for m in CODE.finditer(doc.read_text())]


def _file_problem(name: str) -> str | None:
    path = name.split(":")[0]
    first = path.split("/")[0]
    if first in ROOMS:  # a path inside the package, as the docs often write it
        return None if (PACKAGE / path).exists() else f"no file specrej_ray/{path}"
    if first in TOP or first in {"specrej_ray"}:
        return None if (ROOT / path).exists() else f"no file {path}"
    return None  # another project's file (Ray's dashboard/agent.py, ...)


def _spec_field(parts: list[str]) -> bool:
    """Whether the dotted name is a field of the job spec (search.bounds_every, ...)."""
    from typing import get_args

    from pydantic import BaseModel

    from specrej_ray.spec import JobSpec

    model: type | None = JobSpec
    for part in parts:
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        kinds = [fields[part].annotation, *get_args(fields[part].annotation)]
        kinds += [a for k in kinds for a in get_args(k)]  # list[RewardSpec], X | None
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)),
                     None)
    return True


def _dotted_problem(name: str) -> str | None:
    name = name.removesuffix("()")
    if name.rsplit(".", 1)[-1] in DATA_SUFFIXES:
        return None  # a file a run writes (tune.png, best.parquet)
    parts = name.removeprefix("specrej_ray.").split(".")
    if not name.startswith("specrej_ray.") and _spec_field(parts):
        return None
    if parts[0] not in ROOMS:
        return None  # another library's name (torch.ops..., vllm....)
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        module = "specrej_ray." + ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and not module.startswith(e.name) and e.name.startswith("specrej_ray"):
                return f"{module} imports a missing {e.name}"
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{module} has no {'.'.join(parts[cut:])}"
            obj = getattr(obj, attr)
        return None
    return f"no module specrej_ray.{parts[0]}"


def _problems(doc: Path) -> list[str]:
    out = []
    for name in _named(doc):
        if FILE.match(name):
            why = _file_problem(name)
        elif DOTTED.match(name):
            why = _dotted_problem(name)
        else:
            why = None
        if why:
            out.append(f"{doc.name}: `{name}`: {why}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_module_and_file_the_docs_name_exists(doc):
    assert _problems(doc) == []


def test_the_check_finds_a_stale_name(tmp_path):
    stale = tmp_path / "stale.md"
    stale.write_text("See `engine/hf/nowhere.py`, `engine.decisions.Nope` and "
                     "`specrej_ray.engine.decisions.Decisions`; Ray's `dashboard/agent.py`.")
    assert [p.split(": ", 1)[1] for p in _problems(stale)] == [
        "`engine/hf/nowhere.py`: no file specrej_ray/engine/hf/nowhere.py",
        "`engine.decisions.Nope`: specrej_ray.engine.decisions has no Nope"]
