"""The engine's self-check (engine.hf.self_check): a correct engine passes in float32, float16
and bfloat16, also where bfloat16's rounding grows with depth past a fixed tolerance, and
planted defects are refused in all three. Defects are planted in the engine's attention as
transformers calls it (its registered attention function), never in the cache's internals.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import (
    AttentionInterface,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from specrej_ray.engine.hf import attention, cpu_linear, self_check
from specrej_ray.engine.hf.attention import UnsupportedModel
from specrej_ray.engine.hf.model_runner import ModelRunner, measure_self_check

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCAB = 64


def llama(dtype: torch.dtype, *, std: float = 0.2, layers: int = 2, hidden: int = 32,
          heads: int = 4, kv_heads: int = 2) -> LlamaForCausalLM:
    """A tiny random Llama. Weights of std 0.2 (not 0.02) make attention scores large enough
    that attention matters: at 0.02 every token attends near uniformly, and a position or a
    head mapped wrong changes nothing a check could see."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=64,
                         initializer_range=std, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype).eval()


def gemma2(dtype: torch.dtype, softcap: float = 1.0) -> Gemma2ForCausalLM:
    """A tiny random Gemma 2 whose attention logit soft-cap binds (scores reach past it); its
    sliding window is longer than the check's context, which the engine serves."""
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, query_pre_attn_scalar=16, sliding_window=4096,
                          attn_logit_softcapping=softcap, final_logit_softcapping=30.0,
                          max_position_embeddings=64, initializer_range=0.2)
    return Gemma2ForCausalLM(config).to(dtype).eval()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models' products are tiny: one thread runs them up to 10x faster than two that
    wait on each other (measured on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _packing(monkeypatch):
    """Without AVX-512 oneDNN cannot pack bfloat16 linear layers, and cpu_linear.available
    does not ask (the runner fails before its check): there the engine runs them unpacked,
    as on GPU. Where they pack, the check allows for their rounding (`linears`)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16), 64)
    except RuntimeError:
        real = cpu_linear.available
        monkeypatch.setattr(cpu_linear, "available",
                            lambda m: real(m) and next(m.parameters()).dtype != torch.bfloat16)


# -- planted defects -------------------------------------------------------------------------


def _rotate(x: torch.Tensor, inv_freq: torch.Tensor, by: int) -> torch.Tensor:
    """Rotary embedding moved on by `by` positions (rotations compose: R(p + by) = R(by) R(p))."""
    angle = (by * inv_freq.float()).to(x.device)
    cos, sin = torch.cat([angle, angle]).cos(), torch.cat([angle, angle]).sin()
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


def _wrong_kv_heads(real, module, query, key, *args, **kwargs):
    """Query head h attends with K/V head h % kv_heads instead of h // (heads / kv_heads):
    the heads reordered so that the engine's own grouping pairs them that way."""
    heads, kv_heads = query.shape[1], key.shape[1]
    order = sorted(range(heads), key=lambda h: (h % kv_heads, h))
    out, weights = real(module, query[:, order], key, *args, **kwargs)
    back = torch.empty_like(out)
    back[:, :, order] = out  # out is [rows, tokens, heads, dim]
    return back, weights


@contextlib.contextmanager
def planted(defect: str, model):
    """The engine's attention with `defect`, for the forwards inside the block."""
    attention.install(model)  # registers the engine's attention, so the defect replaces it
    inv_freq = next(m.inv_freq for m in model.modules() if hasattr(m, "inv_freq"))
    real = attention._attention

    def wrong(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              specrej_kv=None, specrej_plan=None, **kwargs):
        args = (value, attention_mask, scaling, dropout, specrej_kv, specrej_plan)
        if specrej_kv is not None:
            if defect == "rotary" and query.shape[2] == 1:  # a decode step: one new token
                query, key = _rotate(query, inv_freq, 1), _rotate(key, inv_freq, 1)
            elif defect == "kv_heads":
                return _wrong_kv_heads(real, module, query, key, *args, **kwargs)
            elif defect == "softcap":
                kwargs.pop("softcap", None)  # silently, where attention.py refuses it
        return real(module, query, key, *args, **kwargs)

    mapping = AttentionInterface._global_mapping
    mapping[attention.NAME] = wrong
    try:
        yield
    finally:
        mapping[attention.NAME] = real


def _refused(model) -> self_check.Result:
    with pytest.raises(UnsupportedModel, match="differ from the model's own") as refused:
        ModelRunner(model)
    return refused.value.self_check


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_correct_engine_passes_within_the_models_own_spread(dtype):
    runner = ModelRunner(llama(dtype))
    result = runner.check_result
    assert result.passes and runner.check_error == result.error
    assert result.spread > 0 and result.bound == self_check.bound(result.spread, dtype)


def test_bfloat16_rounding_that_grows_with_depth_passes():
    """Llama-3-8B's case in miniature: a deep model that amplifies rounding, where a correct
    engine in bfloat16 is past the old fixed tolerance (5e-2, which refused it) and within
    what the model's own rounding moves its logits."""
    runner = ModelRunner(llama(torch.bfloat16, std=0.3, layers=24))
    assert runner.check_error > 5e-2
    assert runner.check_result.passes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("defect", ["rotary", "kv_heads"])
def test_a_planted_attention_defect_is_refused(defect, dtype):
    model = llama(dtype)
    with planted(defect, model):
        result = _refused(model)
    assert result.error > result.bound


@pytest.mark.parametrize(("dtype", "std", "tolerance"),
                         [(torch.float32, 0.02, 1e-3), (torch.float16, 0.07, 5e-2)], ids=str)
def test_a_defect_under_a_fixed_tolerance_is_refused(dtype, std, tolerance):
    """A position off by one on a model where it moves the logits less than the old fixed
    tolerance of the dtype, yet far more than rounding does: refused."""
    model = llama(dtype, std=std)
    with planted("rotary", model):
        result = _refused(model)
    assert result.bound < result.error < tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_ignored_softcap_is_refused(dtype):
    """The reference must be the model's eager attention: SDPA drops `softcap` as silently as
    the planted defect does, and a check against it passes the defect."""
    model = gemma2(dtype)
    with planted("softcap", model):
        result = _refused(model)
    assert result.error > result.bound


def test_measure_reports_without_raising():
    model = llama(torch.float32)
    with planted("rotary", model):
        bad = measure_self_check(model)
    assert not bad["passes"] and bad["error"] > bad["bound"] and "differ" in bad["message"]
    good = measure_self_check(llama(torch.float32))
    assert good["passes"] and set(good) >= {"error", "spread", "bound", "dtype"}
