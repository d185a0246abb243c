"""bench/host_overhead.py's split of a decode step (issue 30): its parts add up to the step, and
the model it times is left as it was (the next spread runs on the same model)."""

from __future__ import annotations

import torch
from torch import nn

from bench.gpu_suite import random_llama
from bench.host_overhead import NEGLIGIBLE, split_row
from specrej_ray.engine.hf import cpu_linear


def test_a_steps_parts_add_up_and_the_model_is_left_unwrapped():
    model, tok = random_llama({**NEGLIGIBLE, "num_hidden_layers": 2}, "cpu", torch.float32)
    row = split_row(model, tok, prompts=2, rows=4, max_new=6)
    ms = row["ms"]
    assert row["steps"] >= 4  # the decode steps that prefilled nothing
    parts = ("attention", "linears", "sampling", "scheduler")
    assert all(ms[p] > 0 for p in parts)
    assert abs(ms["step"] - sum(ms[p] for p in parts) - ms["rest"]) < 0.02
    # The engine packs the linear layers once (their own forward stays); the timers are gone.
    for m in model.modules():
        if isinstance(m, nn.Linear):
            own = m.__dict__.get("forward")
            assert own is None or getattr(own, "__func__", None) is cpu_linear._forward
