"""Linear layers through oneDNN's prepacked kernels on CPU, inside the engine's forwards.

MKL's sgemm rounds a row differently depending on how many rows share the product (1, 2-3,
4 and more: measured), and is slow for the few-row products of decoding. oneDNN's kernel on
a weight reordered once gives a row the same bits whatever the rows beside it (1 to 256:
measured), and is faster, most on a large vocabulary head. Outside the engine's own
forwards (model.generate, a reward pass on the same model) the layers run as before.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from specrej_ray.engine.hf import torch_internals

_ACTIVE = contextvars.ContextVar("specrej_packed_linears", default=False)
_DTYPES = (torch.float32, torch.bfloat16)


def available(model: nn.Module) -> bool:
    weight = next(model.parameters())
    return (weight.device.type == "cpu" and weight.dtype in _DTYPES
            and torch_internals.onednn_linear())


def pack_linears(model) -> int:
    """Reorder every linear layer's weight for oneDNN (a copy kept beside it, made once per
    model: a second runner on the same model finds them); returns how many layers are packed,
    0 where this CPU has no oneDNN kernel for the dtype (bfloat16 needs AVX-512 or
    AVX-NE-CONVERT), and the layers then run as before."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        for module in linears:
            if not hasattr(module, "_specrej_packed"):
                module._specrej_packed = torch_internals.reorder_linear_weight(
                    module.weight.detach(), 64)
                torch_internals.replace_forward(module, _forward)
    except RuntimeError:
        return 0  # not one layer was packed: the first reorder is the one that fails
    return len(linears)


@contextlib.contextmanager
def packed():
    """The engine's forwards: packed layers take the oneDNN path."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _ACTIVE.get():
        return nn.functional.linear(x, self.weight, self.bias)
    bias = None if self.bias is None else self.bias.detach()
    return torch_internals.packed_linear(x, self._specrej_packed, bias)
