"""Packed linear layers on CPU (engine.cpu_linear): faster, and a row's bits never depend
on the rows beside it; outside the engine the model's own layers run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specrej_ray.engine.hf import cpu_linear


@pytest.fixture
def layer():
    torch.manual_seed(0)
    m = nn.Linear(96, 200)
    if not cpu_linear.available(m):
        pytest.skip("oneDNN's packed linear is not in this torch build")
    cpu_linear.pack_linears(m)
    return m


def test_packed_rows_do_not_depend_on_the_batch(layer):
    x = torch.randn(64, 96)
    with torch.inference_mode(), cpu_linear.packed():
        alone = layer(x[:1])
        for rows in (2, 3, 4, 7, 64):
            assert torch.equal(layer(x[:rows])[:1], alone), rows


def test_packed_layers_match_the_plain_product(layer):
    x = torch.randn(5, 1, 96)
    plain = layer(x)  # outside the engine: the module's own weights
    assert torch.equal(plain, nn.functional.linear(x, layer.weight, layer.bias))
    with torch.inference_mode(), cpu_linear.packed():
        assert torch.allclose(layer(x), plain, atol=1e-5)


def test_packing_twice_is_a_no_op(layer):
    assert cpu_linear.pack_linears(layer) == 0
