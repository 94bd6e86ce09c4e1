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


def rms_norm_plain_math(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in f32 (f64 for f64), cast back (torch's RMSNorm without a weight)."""
    xf = _up(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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


def layer_norm_bias_math(x: torch.Tensor, bias: torch.Tensor, *, eps: float) -> torch.Tensor:
    """A layer norm with a bias but no weight (as `F.layer_norm(x, shape, None, bias)`)."""
    return (_up(layer_norm_plain_math(x, eps=eps)) + _up(bias)).to(x.dtype)


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


# the gate activations of gated norms (`activation` of Qwen3-Next's and Qwen3.5's RMSNormGated)
GATE_ACT = {"silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu, "sigmoid": torch.sigmoid}


def gated_rms_norm_math(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float, act: str):
    """`rms_norm(x) * act(gate)`: Llama's norm (`weight * normalize(x)`, normalised in f32 and cast back
    before the weight), times the activation of the gate in f32, cast back to x's dtype (Qwen3-Next's and
    Qwen3.5's RMSNormGated: the norm before the gate)."""
    return (rms_norm_math(x, weight, eps=eps) * GATE_ACT[act](_up(gate))).to(x.dtype)


# norm layer name -> its math, and its residual-add + norm math (for decoder layers that fuse the norms)
NORM_MATH = {"RMSNorm": rms_norm_math, "GemmaRMSNorm": gemma_rms_norm_math}
# norm layer name -> its residual-add + norm math (for decoder layers that fuse the two)
FUSED_ADD_MATH = {"RMSNorm": fused_add_rms_norm_math, "GemmaRMSNorm": fused_add_gemma_rms_norm_math}
# LayerNorm's math by how many of (weight, bias) it has: both, the weight only, neither
LAYER_NORM_MATH = {2: layer_norm_math, 1: layer_norm_nobias_math, 0: layer_norm_plain_math}


# ---- a norm as a decoder layer's graphs take it: a style (a string, part of the graph's signature) and its
# parameters. "RMSNorm" / "GemmaRMSNorm": the weight; "RMSNorm:0": none (nanochat's); "LayerNorm:<k>": the
# first k of (weight, bias) (OLMo's has neither).
def norm_style(name: str, module: nn.Module) -> str | None:
    """The style of `module`, whose kernel layer is `name`; None where the graphs cannot take it (a
    LayerNorm with a bias but no weight, or over several axes)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if name in NORM_MATH:
        return name if weight is not None else "RMSNorm:0" if name == "RMSNorm" else None
    if name != "LayerNorm" or len(getattr(module, "normalized_shape", ())) != 1:
        return None
    if weight is None and bias is not None:
        return None
    return f"LayerNorm:{(weight is not None) + (bias is not None)}"


def norm_params(style: str, module: nn.Module) -> list[torch.Tensor]:
    """The parameters of `module` a style's math reads, in its order."""
    if style == "RMSNorm:0":
        return []
    if style.startswith("LayerNorm:"):
        return [p for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if p is not None]
    return [module.weight]


def styled_norm(x: torch.Tensor, params, style: str, eps: float) -> torch.Tensor:
    """`style`'s norm of `x`, taking its parameters from the iterator `params`."""
    if style.startswith("LayerNorm:"):
        k = int(style.split(":")[1])
        return LAYER_NORM_MATH[k](x, *(next(params) for _ in range(k)), eps=eps)
    if style == "RMSNorm:0":
        return rms_norm_plain_math(x, eps=eps)
    return NORM_MATH[style](x, next(params), eps=eps)


def fused_add_norm_math(x: torch.Tensor, residual: torch.Tensor, *params, style: str, eps: float):
    """`(norm(x + residual), x + residual)` for any style (the RMS styles: `FUSED_ADD_MATH`'s)."""
    if style in FUSED_ADD_MATH:
        return FUSED_ADD_MATH[style](x, residual, *params, eps=eps)
    total = x + residual
    return styled_norm(total, iter(params), style, eps), total


def _eps(module: nn.Module, x: torch.Tensor | None = None) -> float:
    # kernelize_eps: set by `kernelize_model` on a norm that keeps its epsilon in its forward (OLMo's)
    for name in ("variance_epsilon", "eps", "epsilon", "kernelize_eps"):
        value = getattr(module, name, None)
        if isinstance(value, int | float):
            return float(value)
    if _unset(module, "eps"):  # torch's RMSNorm(eps=None): the epsilon of the compute dtype
        dtype = torch.float32 if x is None else torch.promote_types(x.dtype, torch.float32)
        return float(torch.finfo(dtype).eps)
    raise AttributeError(
        f"{type(module).__name__} has no epsilon attribute (variance_epsilon, eps or epsilon) for the norm "
        "kernel; add one or map this layer to another kernel."
    )


def _unset(module: nn.Module, name: str) -> bool:
    return hasattr(module, name) and getattr(module, name) is None


def _flat(module: nn.Module, x: torch.Tensor, *params: torch.Tensor | None):
    """Normalizing over k trailing dims (torch's `normalized_shape`) is normalizing over their flattening:
    the kernels see one axis. Returns x, the params flattened alike, and the shape to restore."""
    shape = tuple(getattr(module, "normalized_shape", None) or x.shape[-1:])
    if tuple(x.shape[x.dim() - len(shape) :]) != shape or x.dim() < len(shape):
        raise RuntimeError(
            f"{type(module).__name__}: given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(x.shape)}"
        )
    if len(shape) == 1:
        return x, params, None
    flat = [None if p is None else p.reshape(-1) for p in params]
    return x.reshape(*x.shape[: x.dim() - len(shape)], -1), flat, x.shape


def _restore(y: torch.Tensor, shape: torch.Size | None) -> torch.Tensor:
    return y if shape is None else y.reshape(shape)


eps_of = _eps  # public: decoder layers that fuse a norm read its epsilon the same way


# ---- functional API --------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    hub.require_float("rms_norm", x)
    return hub.run(None, rms_norm_math, [x], [weight], eps=float(eps))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    hub.require_float("layer_norm", x)
    return hub.run(None, layer_norm_math, [x], [weight, bias], eps=float(eps))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    hub.require_float("fused_add_rms_norm", x, residual)
    return hub.run(None, fused_add_rms_norm_math, [x, residual], [weight], eps=float(eps))


# ---- kernel layers ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm: `weight * normalize(x)`; reads `self.weight` (None: no scale) and `self.variance_epsilon` or
    `eps` (None: torch's default). Llama's and torch's `nn.RMSNorm` (any `normalized_shape`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, hidden_states)
        eps = _eps(self, hidden_states)
        x, (w,), shape = _flat(self, hidden_states, getattr(self, "weight", None))
        if w is None:
            return _restore(hub.run(self, rms_norm_plain_math, [x], eps=eps), shape)
        return _restore(hub.run(self, rms_norm_math, [x], [w], eps=eps), shape)


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: `(1 + weight) * normalize(x)`; reads `self.weight` and `self.eps`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, x)
        return hub.run(self, gemma_rms_norm_math, [x], [self.weight], eps=_eps(self, x))


class LayerNorm(nn.Module):
    """LayerNorm; reads `self.weight`, `self.bias` (either may be None or absent: OLMo's has neither),
    the epsilon and `normalized_shape` (one or more trailing dims, as `torch.nn.LayerNorm`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        hub.require_float(type(self).__name__, input)
        eps = _eps(self, input)
        x, (w, b), shape = _flat(self, input, getattr(self, "weight", None), getattr(self, "bias", None))
        if w is None and b is not None:
            y = hub.run(self, layer_norm_bias_math, [x], [b], eps=eps)
        elif w is None:
            y = hub.run(self, layer_norm_plain_math, [x], eps=eps)
        elif b is None:
            y = hub.run(self, layer_norm_nobias_math, [x], [w], eps=eps)
        else:
            y = hub.run(self, layer_norm_math, [x], [w, b], eps=eps)
        return _restore(y, shape)


class GatedRMSNorm(nn.Module):
    """Gated RMSNorm: `(weight * normalize(x)) * act(gate)` as one row kernel; reads `self.weight`, the
    epsilon and `kernelize_gate_act` (the activation, set by `kernelize_model` from its probe; else the
    module's `activation`, else silu). Without a gate it is `RMSNorm`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is None:
            hub.require_float(type(self).__name__, hidden_states)
            return hub.run(self, rms_norm_math, [hidden_states], [self.weight], eps=_eps(self, hidden_states))
        hub.require_float(type(self).__name__, hidden_states, gate)
        if gate.shape != hidden_states.shape:
            raise ValueError(
                f"{type(self).__name__}: the gate's shape {list(gate.shape)} differs from the input's "
                f"{list(hidden_states.shape)}; the gated norm kernel multiplies them element by element."
            )
        act = getattr(self, "kernelize_gate_act", None) or getattr(self, "activation", "silu")
        if act not in GATE_ACT:
            raise ValueError(
                f"{type(self).__name__}: gate activation {act!r} is not one of {', '.join(GATE_ACT)}; map "
                "this layer to another kernel or keep its own forward."
            )
        eps = _eps(self, hidden_states)
        return hub.run(self, gated_rms_norm_math, [hidden_states, gate], [self.weight], eps=eps, act=act)


class FusedAddRMSNorm(nn.Module):
    """`(rms_norm(x + residual), x + residual)`; reads `self.weight` and the epsilon."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hub.require_float(type(self).__name__, x, residual)
        return hub.run(self, fused_add_rms_norm_math, [x, residual], [self.weight], eps=_eps(self, x))
