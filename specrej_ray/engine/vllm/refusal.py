"""vLLM's refusal of the settings made from a spec, as one line naming the spec key: shared by
the check before Ray (preflight.py) and the engine's own start (build.py)."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from specrej_ray.spec.vllm_kwargs import OWNED


def refusal(e: Exception, args: dict[str, Any]) -> str:
    """vLLM's refusal of `args` as one line: the spec key it is about, and vLLM's reason."""
    reason = vllm_reason(e, args)
    return f"{_key_named(reason, args)}: vLLM refuses it: {reason}"


def vllm_reason(e: Exception, names: Collection[str] = ()) -> str:
    """The sentence of a vLLM error that says why: pydantic's message without its prefix and
    without the input it dumps (every field of the config), else the first line. Of several
    errors, the first about a field in `names` (what the spec set)."""
    errors = getattr(e, "errors", None)
    text, field = "", ""
    if callable(errors):
        try:
            found = errors()
            # An error about a field the spec set, before one vLLM derived from it.
            first = next((x for x in found if x.get("loc") and x["loc"][-1] in names),
                         found[0])
            text = str(first["msg"])
            loc = first.get("loc") or ()
            if loc and isinstance(loc[-1], str):  # a field's own check: name it, and the value
                field = f"{loc[-1]}: "
                if isinstance(first.get("input"), int | float | str | bool):
                    text += f" (got {first['input']!r})"
        except (TypeError, KeyError, IndexError, AttributeError):
            text, field = "", ""
    text = (text or str(e).strip() or type(e).__name__).splitlines()[0]
    text = re.sub(r"^(Value|Assertion) error, ", "", text)
    return field + re.split(r"(?<=[.)])\s+(?=[A-Z])", text, maxsplit=1)[0]


def _key_named(message: str, args: dict[str, Any]) -> str:
    """The spec key of the first EngineArgs field that vLLM's message names."""
    text = message.lower()
    spoken = {"tensor_parallel_size": "tensor parallel"}
    # Only names that are not plain words ("model", "dtype"): those say nothing of a key.
    for name in sorted((n for n in args if "_" in n), key=len, reverse=True):
        if name in text or (name in spoken and spoken[name] in text):
            where = OWNED.get(name, f"generator.vllm.engine_kwargs.{name}")
            return where or "generator.vllm"
    return "generator.vllm"
