"""Packed linear layers on CPU (engine.cpu_linear): faster, and a row's bits never depend
on the rows beside it; outside the engine the model's own layers run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specrej_ray.engine.hf import cpu_linear, torch_internals


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


def test_packing_twice_keeps_the_packed_copy_and_says_it_is_packed(layer):
    """A second runner on the same model must still take the packed path (it once got 0
    and ran MKL's products, whose rows depend on the batch)."""
    first = layer._specrej_packed
    assert cpu_linear.pack_linears(layer) == 1
    assert layer._specrej_packed is first


def test_a_dtype_this_cpu_cannot_pack_leaves_the_layers_as_they_were(monkeypatch):
    m = nn.Linear(8, 4)

    def unsupported(*_):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(torch_internals, "reorder_linear_weight", unsupported)
    assert cpu_linear.pack_linears(m) == 0
    assert not hasattr(m, "_specrej_packed") and "forward" not in vars(m)
