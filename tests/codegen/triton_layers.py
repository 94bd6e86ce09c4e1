"""The layer corpus of issue 4's "done when": small torch layers, traced, optimized and planned."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class AddRMSNorm(RMSNorm):
    def forward(self, x, residual):
        h = x + residual
        return super().forward(h), h


class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


class Rotary(nn.Module):
    """Llama's apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""

    def forward(self, x, cos, sin):
        d = x.shape[-1] // 2
        rot = torch.cat((-x[..., d:], x[..., :d]), dim=-1)
        return x * cos + rot * sin


class LinearReLU(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.lin = nn.Linear(k, n)

    def forward(self, x):
        return torch.relu(self.lin(x))


def corpus(dtype: torch.dtype = torch.float32):
    """``(name, module, example inputs, dynamic dims)`` for each layer, sized for the interpreter."""
    torch.manual_seed(0)
    h = 64
    x = torch.randn(4, h, dtype=dtype)
    layers = [
        ("rmsnorm", RMSNorm(h), (x,)),
        ("add_rmsnorm", AddRMSNorm(h), (x, torch.randn(4, h, dtype=dtype))),
        ("layernorm", nn.LayerNorm(h), (x,)),
        ("silu_and_mul", SiluAndMul(), (torch.randn(4, 2 * h, dtype=dtype),)),
        ("gelu_and_mul", GeluAndMul(), (torch.randn(4, 2 * h, dtype=dtype),)),
        ("softmax", Softmax(), (x,)),
        (
            "rotary",
            Rotary(),
            (
                torch.randn(4, 2, 16, dtype=dtype),
                torch.randn(4, 1, 16, dtype=dtype),
                torch.randn(4, 1, 16, dtype=dtype),
            ),
        ),
        ("linear_relu", LinearReLU(32, 48), (torch.randn(4, 32, dtype=dtype),)),
    ]
    return [(name, m.to(dtype), inputs) for name, m, inputs in layers]
