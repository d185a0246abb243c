"""How a transformers forward pass takes and returns its KV cache.

transformers 5.24 renamed the argument and the output field `past_key_values` to `cache`
and deprecates the old name, to be removed at 5.40; versions before 5.24 know only the old
one. pyproject holds transformers at the tested 5.19 (vLLM 0.32 needs it below 5.20); the
name is read from the model's own forward signature, once per model class, so that lifting
the bound needs no change here. A public signature, not a private part: it needs no seam.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _class_takes_cache(cls: type) -> bool:
    return "cache" in inspect.signature(cls.forward).parameters


def _takes_cache(model: Any) -> bool:
    # The class whose forward runs (a wrapper that hands attributes on names the model's).
    return _class_takes_cache(type(getattr(model.forward, "__self__", model)))


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to this model's forward."""
    return {"cache": cache} if _takes_cache(model) else {"past_key_values": cache}


def returned_cache(model: Any, out: Any) -> Any:
    """The cache a forward of this model returned."""
    return out.cache if _takes_cache(model) else out.past_key_values
