"""Every private or version-specific part of transformers the hf engine reaches, checked when
this module is imported.

- A model's attention layers call `ALL_ATTENTION_FUNCTIONS.get_interface(name, default)` with
  the name of the model's attention implementation (its config's private
  `_attn_implementation`: `attention_of`), and pass the function the layer's query, key and
  value and the model call's extra keyword arguments. A function registered on
  AttentionInterface (a class-wide registry) under a name is what they get
  (`register_attention`); the masks likewise (AttentionMaskInterface).
- transformers' own SDPA attention and mask functions, which the engine's attention stands on
  outside the engine's forwards; they live in transformers' integrations and masking
  modules, not its top level (`sdpa_attention`, `sdpa_mask`).

A transformers without one of them, or where one no longer behaves so, fails the import with
one line naming transformers' version and the part (LibraryChanged).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import transformers
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from specrej_ray.errors import LibraryChanged

__all__ = ["SUPPORTED", "attention_of", "changed", "check", "register_attention",
           "sdpa_attention", "sdpa_mask"]

SUPPORTED = "transformers>=5.19,<5.20"  # pyproject.toml's bound (tests/test_library_seams.py)


def changed(what: str) -> LibraryChanged:
    return LibraryChanged("transformers", transformers.__version__, what, SUPPORTED)


try:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa_attention
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as e:
    raise changed(f"{e.name}: {e}") from None


def check() -> None:
    """What this module reaches is there and behaves as assumed; raises LibraryChanged."""
    for registry in (AttentionInterface, type(ALL_MASK_ATTENTION_FUNCTIONS)):
        if not isinstance(inspect.getattr_static(registry, "register", None), classmethod):
            raise changed(f"{registry.__name__}.register is no longer a class-wide registration")
    if not isinstance(inspect.getattr_static(PretrainedConfig, "_attn_implementation", None),
                      property):
        raise changed("PretrainedConfig._attn_implementation is missing")
    if not callable(getattr(PreTrainedModel, "set_attn_implementation", None)):
        raise changed("PreTrainedModel.set_attn_implementation is missing")
    get = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if get is None or get("sdpa", None) is not sdpa_attention:
        raise changed("ALL_ATTENTION_FUNCTIONS.get_interface('sdpa') is no longer "
                      "integrations.sdpa_attention.sdpa_attention_forward")


check()


def register_attention(name: str, attention: Callable, mask: Callable) -> None:
    """`attention` (and `mask`) under `name` for every model, unless a function is registered
    under it already (the engine's, or one a test put in its place)."""
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)


def attention_of(model) -> str | dict | None:
    """The name of the attention implementation the model's layers call."""
    return model.config._attn_implementation
