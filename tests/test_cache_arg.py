"""The KV cache keyword follows the model's forward: `cache` from transformers 5.24,
`past_key_values` before it (the vLLM extra's environment resolves to 5.19)."""

from __future__ import annotations

from types import SimpleNamespace

from specrej_ray.models.cache_arg import cache_kwargs, returned_cache


class Before524:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return SimpleNamespace(past_key_values=past_key_values)


class Since524:
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return SimpleNamespace(cache=cache)


class Wrapper:
    """A test double that hands every attribute on to the model it wraps."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_the_keyword_and_the_output_field_follow_the_forward_signature():
    for model, name in ((Before524(), "past_key_values"), (Since524(), "cache"),
                        (Wrapper(Since524()), "cache")):
        assert cache_kwargs(model, "kv") == {name: "kv"}
        out = model.forward(**cache_kwargs(model, "kv"))
        assert returned_cache(model, out) == "kv"


def test_the_installed_transformers_takes_what_we_pass(lm):
    """With the filter in pyproject, a deprecated keyword would fail here."""
    import torch
    from transformers import DynamicCache

    model, _ = lm
    out = model(input_ids=torch.tensor([[1, 2]]), **cache_kwargs(model, DynamicCache()),
                use_cache=True)
    assert returned_cache(model, out).get_seq_length() == 2
