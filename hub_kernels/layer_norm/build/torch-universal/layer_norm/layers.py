"""Normalization layers: the math once, as plain torch; `forward` runs the kernels generated from it.

State comes from the replaced module: `weight`, `bias` (LayerNorm), and the epsilon from
`variance_epsilon` (Llama, Qwen2, Mistral), `eps` (Gemma, torch) or `epsilon`.
"""

from __future__ import annotations

import torch
from torch import nn

from kernelize import hub


def _up(x: torch.Tensor) -> torch.Tensor:
    """`x` in its compute dtype: f32 for 16-bit floats and f32; f64 stays f64 (so gradcheck sees the math)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---- the math (plain torch; traced into kernels) ---------------------------------------------------------
def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) in f32 (f64 for f64), cast back to x's dtype (Llama)."""
    xf = _up(x)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm_math(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """(1 + weight) * (x / sqrt(mean(x^2) + eps)), all in f32 (f64 for f64), cast back at the end (Gemma)."""
    xf = _up(x)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + _up(weight))
    return out.to(x.dtype)


def layer_norm_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance), in f32."""
    xf = _up(x)
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    var = (centered * centered).mean(-1, keepdim=True)
    out = centered * torch.rsqrt(var + eps) * _up(weight) + _up(bias)
    return out.to(x.dtype)


def layer_norm_nobias_math(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    xf = _up(x)
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    var = (centered * centered).mean(-1, keepdim=True)
    return (centered * torch.rsqrt(var + eps) * _up(weight)).to(x.dtype)


def layer_norm_plain_math(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    xf = _up(x)
    centered = xf - xf.mean(-1, keepdim=True)
    var = (centered * centered).mean(-1, keepdim=True)
    return (centered * torch.rsqrt(var + eps)).to(x.dtype)


def fused_add_rms_norm_math(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the next layer's norm in one pass."""
    total = x + residual
    return rms_norm_math(total, weight, eps=eps), total


def fused_add_gemma_rms_norm_math(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemma_rms_norm(x + residual), x + residual): Gemma's `(1 + w)` norm after the residual add."""
    total = x + residual
    return gemma_rms_norm_math(total, weight, eps=eps), total


# norm layer name -> its residual-add + norm math (for decoder layers that fuse the two)
FUSED_ADD_MATH = {"RMSNorm": fused_add_rms_norm_math, "GemmaRMSNorm": fused_add_gemma_rms_norm_math}


def _eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, int | float):
            return float(value)
    raise AttributeError(
        f"{type(module).__name__} has no epsilon attribute (variance_epsilon, eps or epsilon) for the norm "
        "kernel; add one or map this layer to another kernel."
    )


eps_of = _eps  # public: decoder layers that fuse a norm read its epsilon the same way


# ---- functional API --------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return hub.run(None, rms_norm_math, [x], [weight], eps=float(eps))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return hub.run(None, layer_norm_math, [x], [weight, bias], eps=float(eps))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    return hub.run(None, fused_add_rms_norm_math, [x, residual], [weight], eps=float(eps))


# ---- kernel layers ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Llama RMSNorm: `weight * normalize(x)`; reads `self.weight` and `self.variance_epsilon` or `eps`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hub.run(self, rms_norm_math, [hidden_states], [self.weight], eps=_eps(self))


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: `(1 + weight) * normalize(x)`; reads `self.weight` and `self.eps`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hub.run(self, gemma_rms_norm_math, [x], [self.weight], eps=_eps(self))


class LayerNorm(nn.Module):
    """LayerNorm over the last axis; reads `self.weight`, `self.bias` (either may be None) and `self.eps`.

    Like `torch.nn.LayerNorm` with one normalized axis and an affine weight.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return hub.run(self, layer_norm_plain_math, [input], eps=_eps(self))
        if self.bias is None:
            return hub.run(self, layer_norm_nobias_math, [input], [self.weight], eps=_eps(self))
        return hub.run(self, layer_norm_math, [input], [self.weight, self.bias], eps=_eps(self))


class FusedAddRMSNorm(nn.Module):
    """`(rms_norm(x + residual), x + residual)`; reads `self.weight` and the epsilon."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hub.run(self, fused_add_rms_norm_math, [x, residual], [self.weight], eps=_eps(self))
