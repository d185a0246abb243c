"""Every private part of torch the hf engine reaches, checked at first use.

- oneDNN's prepacked linear kernel, which torch runs for its own inference passes but offers
  only as private operators: `torch.ops.mkldnn._reorder_linear_weight` (a weight packed once
  for a batch size) and `torch.ops.mkldnn._linear_pointwise` (a product with it), used by
  engine.hf.cpu_linear (`reorder_linear_weight`, `packed_linear`);
- that a module's forward set on the instance is what calling the module runs
  (`replace_forward`): nn.Module.__call__ looks `forward` up on the instance.

`onednn_linear()` says whether this torch build has oneDNN at all (a build without it runs
the layers as before); where it has, a missing operator, or one that no longer computes the
plain product, fails with one line naming torch's version and the operator (LibraryChanged).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn

from specrej_ray.errors import LibraryChanged

SUPPORTED = "torch>=2.6"  # pyproject.toml's bound (tests/test_library_seams.py)
OPERATORS = ("_reorder_linear_weight", "_linear_pointwise")


def changed(what: str) -> LibraryChanged:
    return LibraryChanged("torch", torch.__version__, what, SUPPORTED)


@functools.cache
def onednn_linear() -> bool:
    """oneDNN's packed linear kernel is in this torch build, and behaves as assumed (checked
    once a process: a packed product of a small float32 layer equals the plain one)."""
    if not torch.backends.mkldnn.is_available():
        return False
    for name in OPERATORS:
        if not hasattr(torch.ops.mkldnn, name):
            raise changed(f"torch.ops.mkldnn.{name} is missing")
    layer = nn.Linear(8, 4)
    x = torch.arange(16, dtype=torch.float32).reshape(2, 8) / 16
    with torch.no_grad():
        packed = packed_linear(x, reorder_linear_weight(layer.weight, 2), layer.bias)
        if not torch.allclose(packed, nn.functional.linear(x, layer.weight, layer.bias),
                              atol=1e-5):
            raise changed("torch.ops.mkldnn._linear_pointwise no longer computes the plain "
                          "linear product")
    _check_forward_replacement()
    return True


def _check_forward_replacement() -> None:
    layer = nn.Linear(1, 1)
    replace_forward(layer, lambda self, x: "replaced")
    if layer(torch.zeros(1)) != "replaced":
        raise changed("a module's forward set on the instance is no longer what calling "
                      "the module runs")


def reorder_linear_weight(weight: torch.Tensor, batch_size: int) -> torch.Tensor:
    """`weight` packed for oneDNN's linear kernel (RuntimeError where this CPU has no kernel
    for its dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def replace_forward(module: nn.Module, forward: Callable) -> None:
    """`forward(module, ...)` runs where calling `module` ran its own forward."""
    module.forward = types.MethodType(forward, module)
