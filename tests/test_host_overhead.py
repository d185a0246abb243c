"""bench/host_overhead.py's split of a decode step (issue 30): its parts fit inside the step, and
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
    # The parts do not overlap (a prefill's linears inside the scheduler would count twice):
    # they leave a positive rest, the model's other operations and its Python.
    assert 0 < ms["rest"] < ms["step"]
    # The engine packs the linear layers once (their own forward stays); the timers are gone.
    for m in model.modules():
        if isinstance(m, nn.Linear):
            own = m.__dict__.get("forward")
            assert own is None or getattr(own, "__func__", None) is cpu_linear._forward
