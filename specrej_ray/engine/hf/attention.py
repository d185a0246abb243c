"""The engine's KV cache inside a transformers model, as a registered attention implementation.

transformers calls the function registered under the model's attention implementation in every
attention layer, with the layer's query, key and value (rotary applied) and the model call's
extra keyword arguments (transformers_internals). The engine passes its cache and a plan of
the forward that way (`specrej_kv`, `specrej_plan`): the function stores the new K/V in the
engine's cache and attends over it. Called without them (model.generate, a reward pass on the
same model), it is SDPA, unchanged.

Architectures whose attention needs more than causal softmax attention over the whole context
(logit soft-capping, attention sinks, a sliding window shorter than the context) raise
UnsupportedModel; the model runner also compares the engine's logits with the model's own
before any work is done (engine.hf.self_check, run by ModelRunner when it is made).
"""

from __future__ import annotations

from specrej_ray.engine.hf.kv_pool import DecodePlan, KVPool, PrefillPlan
from specrej_ray.engine.hf.transformers_internals import (
    attention_of,
    register_attention,
    sdpa_attention,
    sdpa_mask,
)

NAME = "specrej"


class UnsupportedModel(Exception):
    """The generator's attention is not one the engine's cache implements."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: the hf engine cannot run this model; set generator.engine: "
                         "vllm (pip install 'specrej-ray[vllm]'), which serves it")


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               specrej_kv: KVPool | None = None, specrej_plan=None, **kwargs):
    if specrej_kv is None:
        return sdpa_attention(module, query, key, value, attention_mask, scaling=scaling,
                              dropout=dropout, **kwargs)
    unsupported = [k for k in ("softcap", "s_aux", "sinks") if kwargs.get(k) is not None]
    window = kwargs.get("sliding_window")
    if window is not None and _context(specrej_plan, key) > window:
        unsupported.append(f"sliding_window={window} (shorter than the context)")
    if unsupported:
        raise UnsupportedModel(f"attention with {', '.join(unsupported)}")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    if isinstance(specrej_plan, PrefillPlan):
        return specrej_kv.prefill(layer, specrej_plan, query, key, value, scaling), None
    return specrej_kv.decode(layer, specrej_plan, query, key, value, scaling), None


def _context(plan, key) -> int:
    """The longest context a row of this forward attends to, its new token included."""
    if isinstance(plan, DecodePlan):
        return plan.longest
    return key.shape[2]


def install(model) -> None:
    """Make the engine's attention the model's; other callers still get SDPA."""
    register_attention(NAME, _attention, sdpa_mask)
    model.set_attn_implementation(NAME)
    if attention_of(model) != NAME:
        raise UnsupportedModel(f"{type(model).__name__} does not use transformers' "
                               "attention interface")
