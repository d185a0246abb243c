"""vLLM's EngineArgs fields read from its source, without importing vLLM.

Importing vLLM takes 6 to 9 s here (torch, transformers and vLLM's own modules), so a mistake
in generator.vllm.engine_kwargs would be refused only after that. EngineArgs is a dataclass
whose fields are annotated in its class body: the installed vllm/engine/arg_utils.py is parsed
(about 50 ms) for their names and, where a field's type is plain (bool, int, float, str, or a
union of them and None), for its type. vLLM's own objects still check every value afterwards
(engine/vllm/preflight.py); what cannot be read here is left to them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

_PLAIN = {"bool": bool, "int": int, "float": float, "str": str, "None": type(None)}


@functools.cache
def engine_arg_annotations() -> dict[str, str] | None:
    """{field: its annotation as written}, or None where vLLM is not installed or its source
    does not hold a readable EngineArgs (callers then import vLLM)."""
    spec = importlib.util.find_spec("vllm")  # a top-level name: vLLM is not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs" and not node.bases:
            fields = {f.target.id: ast.unparse(f.annotation) for f in node.body
                      if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
                      and not ast.unparse(f.annotation).startswith(("ClassVar", "InitVar"))}
            return fields or None
    return None


def plain_types(annotation: str) -> tuple[type, ...] | None:
    """The types of an annotation made only of bool, int, float, str and None joined by `|`
    (or Optional[...]), else None."""
    text = annotation.strip().strip("'\"")
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional["):-1] + " | None"
    parts = [p.strip() for p in text.split("|")]
    if not all(p in _PLAIN for p in parts):
        return None
    return tuple(_PLAIN[p] for p in parts)


def type_name(types: tuple[type, ...]) -> str:
    """int | None, as vLLM writes it."""
    return " | ".join("None" if t is type(None) else t.__name__ for t in types)
