"""Softmax layers: the math once, as plain torch; `forward` runs the generated kernels.

The row length (the softmax axis) is a static dim of the kernel: a new key length compiles a new kernel
(cached), while batch, heads and query length stay symbolic.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from kernelize import hub


def _up(x: torch.Tensor) -> torch.Tensor:
    """`x` in its compute dtype: f32 for 16-bit floats and f32; f64 stays f64 (so gradcheck sees the math)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---- the math (plain torch; traced into kernels) ---------------------------------------------------------
def softmax_math(x: torch.Tensor, *, dim: int) -> torch.Tensor:
    """softmax over `dim`, computed in f32, returned in x's dtype."""
    return torch.softmax(_up(x), dim=dim).to(x.dtype)


def scaled_softmax_math(scores: torch.Tensor, *, scale: float) -> torch.Tensor:
    """softmax(scores * scale) over the last axis, in f32."""
    return torch.softmax(_up(scores) * scale, dim=-1).to(scores.dtype)


def scaled_masked_softmax_math(scores: torch.Tensor, mask: torch.Tensor, *, scale: float) -> torch.Tensor:
    """softmax(scores * scale + mask) over the last axis, in f32; `mask` is additive (0 or -inf)."""
    return torch.softmax(_up(scores) * scale + _up(mask), dim=-1).to(scores.dtype)


def scaled_bool_masked_softmax_math(
    scores: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """softmax(where(mask, scores * scale, -inf)) over the last axis; `mask` True = attend."""
    logits = torch.where(mask, _up(scores) * scale, float("-inf"))
    return torch.softmax(logits, dim=-1).to(scores.dtype)


# ---- functional API --------------------------------------------------------------------------------------
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    hub.require_float("softmax", x)
    if x.dim() == 0:  # torch's softmax of a scalar is 1; the kernels need an axis
        return torch.softmax(x, 0)
    return hub.run(None, softmax_math, [x], dim=dim % x.dim())


def scaled_masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    return _scaled(None, scores, mask, float(scale))


def _scaled(
    owner: nn.Module | None, scores: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    hub.require_float(type(owner).__name__ if owner is not None else "scaled_masked_softmax", scores)
    if mask is None:
        return hub.run(owner, scaled_softmax_math, [scores], scale=scale)
    if mask.dtype == torch.bool:
        return hub.run(owner, scaled_bool_masked_softmax_math, [scores, mask], scale=scale)
    return hub.run(owner, scaled_masked_softmax_math, [scores, mask], scale=scale)


# ---- kernel layers ----------------------------------------------------------------------------------------
def implicit_dim(ndim: int) -> int:
    """The axis `nn.Softmax(dim=None)` uses (torch's legacy rule): 0 for 0-, 1- and 3-d input, else 1."""
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(nn.Module):
    """Like `torch.nn.Softmax`: reads `self.dim`; None picks the axis by torch's legacy rule (`implicit_dim`),
    with torch's deprecation warning."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, input)
        dim = getattr(self, "dim", None)
        if dim is None:
            warnings.warn(
                "Implicit dimension choice for softmax has been deprecated. Change the call to include dim=X "
                "as an argument.",
                stacklevel=2,
            )
            dim = implicit_dim(input.dim())
        if input.dim() == 0:  # torch's softmax of a scalar is 1; the kernels need an axis
            return torch.softmax(input, 0)
        return hub.run(self, softmax_math, [input], dim=dim % input.dim())


class ScaledMaskedSoftmax(nn.Module):
    """`forward(scores, mask=None)`: softmax(scores * self.scale + mask) over the last axis, one kernel.

    `mask` is additive (float, broadcastable to `scores`) or boolean (True = attend).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return _scaled(self, scores, mask, float(getattr(self, "scale", 1.0)))
