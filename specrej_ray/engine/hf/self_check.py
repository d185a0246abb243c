"""The engine's start-up self-check: its logits against the model's own, within a bound that
the model's own arithmetic in its dtype sets.

A fixed tolerance cannot tell rounding from a defect: in bfloat16 two correct computations of
a deep model drift apart as rounding differences grow layer by layer (random weights in
Llama-3-8B's shape: 0.02 relative at 4 layers, 0.06 at 32), up to where a tolerance that
still catches a defect refuses a correct engine. So the check measures that drift on the model
at hand: `spread` is how far the model's own reference forward moves when what the engine
computes its own way rounds differently (every attention output, and the linear layers'
where the engine packs them, moved by up to one unit of rounding; the tokens run in one
forward instead of one a step, which changes the kernels' shapes); the
engine may differ from the reference by K times that, plus a floor of a few units of the
dtype's rounding. A defect (a position off by one, query heads on the wrong K/V head, a
soft-cap ignored) changes what is computed, not how it rounds, and lands far above
(bench/self_check_depth.py, tests/test_self_check.py).

The reference runs the model's eager attention, its own definition: SDPA (transformers'
default, and what the engine's attention falls back to) ignores arguments such as `softcap`,
so a reference through it would share that defect with the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from specrej_ray.engine.hf.attention import UnsupportedModel
from specrej_ray.models.cache_arg import cache_kwargs, returned_cache

PROMPT_TOKENS = 7
STEPS = 3
# The engine's error may be K times the spread. Measured (bench/self_check_depth.py, random
# weights at Llama-3-8B's width, 4 to 32 layers, all three dtypes, H100 and CPU): a correct
# engine 0.4 to 1.0 times the spread (tiny test models up to 1.5), a decode position off by
# one 14 to 25 times it and query heads on the wrong K/V head 23 to 75 times it in bfloat16.
K = 4.0
# ... plus this many units of the dtype's rounding (eps, relative to the largest logit): a
# spread near zero (a model that barely amplifies rounding) must not refuse an engine whose
# last layers round differently.
FLOOR_EPS = 4.0
REFERENCE = "eager"
SEED = 0  # of the rounding moves: the check is deterministic
# Rows of the reference rounded differently (one forward): the spread is the largest, so one
# draw that happens to move the logits little does not make the bound tight (16 seeds on 5
# tiny models: a correct engine up to 2.4 times one draw's spread, 1.5 times two draws').
DRAWS = 2


@dataclass(frozen=True)
class Result:
    error: float  # the engine's logits against the reference (see `relative`)
    spread: float  # the reference against itself rounded differently
    bound: float  # what `error` may be: K x spread + the floor
    dtype: str

    @property
    def passes(self) -> bool:
        return self.error <= self.bound

    def as_dict(self) -> dict:
        return {**asdict(self), "passes": self.passes}


def probe(vocab: int, steps: int = STEPS) -> tuple[list[int], list[int]]:
    """The check's prompt, and the tokens it then feeds one a step."""
    ids = [(7 + 5 * i) % vocab for i in range(PROMPT_TOKENS)]
    feed = [(3 + 11 * i) % vocab for i in range(steps)]
    return ids, feed


def relative(want: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> float:
    """Worst over the steps of max |got - want| / max |want| (a denominator at least 1)."""
    return max(float((w.float() - g.float()).abs().max() / w.float().abs().max().clamp(min=1))
               for w, g in zip(want, got, strict=True))


def bound(spread: float, dtype: torch.dtype) -> float:
    return K * spread + FLOOR_EPS * torch.finfo(dtype).eps


def judge(model, ids: list[int], feed: list[int], got: Sequence[torch.Tensor],
          linears: bool = False) -> Result:
    """The engine's logits `got` (after the prompt, then after each fed token) judged against
    the model's own; `linears`: the engine runs its own linear layers (cpu_linear), which
    round differently too."""
    want, moved = reference(model, ids, feed, linears)
    dtype = next(model.parameters()).dtype
    spread = max(relative(want, m) for m in moved)
    return Result(relative(want, got), spread, bound(spread, dtype),
                  str(dtype).removeprefix("torch."))


def refusal(result: Result) -> UnsupportedModel:
    """The error a failed check raises; it carries the result (see
    model_runner.measure_self_check)."""
    error = UnsupportedModel(
        f"the engine's logits differ from the model's own by {result.error:.2g} (relative), "
        f"more than {result.bound:.2g} ({K:g} x the {result.spread:.2g} that rounding alone "
        f"moves them in {result.dtype}, plus {FLOOR_EPS:g} eps)")
    error.self_check = result
    return error


@torch.inference_mode()
def reference(model, ids: list[int], feed: list[int], linears: bool = False
              ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The model's own next-token logits after the prompt and after each fed token: computed
    as the engine does (prompt, then a token a step over a cache), and DRAWS times with other
    rounding (in one forward, every attention output, and with `linears` every linear
    layer's, moved by up to one unit of rounding, differently in each row)."""
    device = model.device
    with _attention(model, REFERENCE):
        out = model(input_ids=torch.tensor([ids], device=device),
                    **cache_kwargs(model, DynamicCache()), use_cache=True)
        want, cache = [out.logits[0, -1]], returned_cache(model, out)
        for i, t in enumerate(feed):
            out = model(input_ids=torch.tensor([[t]], device=device),
                        position_ids=torch.tensor([[len(ids) + i]], device=device),
                        **cache_kwargs(model, cache), use_cache=True)
            want.append(out.logits[0, -1])
        with _rounded_differently(model, linears):
            whole = model(input_ids=torch.tensor([ids + feed] * DRAWS, device=device),
                          use_cache=False)
    return want, [list(row[len(ids) - 1 :]) for row in whole.logits]


@contextlib.contextmanager
def _attention(model, name: str):
    """The model's forwards under attention implementation `name`, then as before."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def _rounded_differently(model, linears: bool):
    """Every attention layer's output (and with `linears` every linear layer's) moved, element
    by element, by up to one unit of its dtype's rounding (seeded): the model as an
    implementation of those parts that rounds differently computes it, which is what a
    correct engine is."""
    gen = torch.Generator().manual_seed(SEED)

    def hook(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        eps = torch.finfo(first.dtype).eps
        r = torch.rand(first.shape, generator=gen).to(first.device) * 2 - 1
        moved = (first.float() * (1 + eps * r)).to(first.dtype)
        return (moved, *output[1:]) if isinstance(output, tuple) else moved

    # transformers' attention modules (LlamaAttention, Gemma2Attention, ...) know their layer.
    handles = [m.register_forward_hook(hook) for m in model.modules()
               if (type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx"))
               or (linears and isinstance(m, torch.nn.Linear))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
