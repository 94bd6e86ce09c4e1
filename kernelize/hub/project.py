"""Linear layers while training on the CPU: oneDNN for the products it runs faster than MKL.

``project(proj, x)`` is ``proj(x)``. With gradients, for a plain f32 ``nn.Linear`` on the CPU (no hooks, no
autocast, no ``torch.compile`` trace, no DTensor weight) it runs as one autograd function: the forward
``x @ W.T`` and the input gradient ``dy @ W`` are oneDNN matmuls on the weight as it is, the weight gradient
``dy.T @ x`` stays MKL's (``torch.mm``), which is faster for that product, into a new tensor that asks
for transparent huge pages before its first touch (``empty_huge``). Measured per product (512 tokens, 2
threads, GFLOP/s, MKL -> oneDNN): 512 x 512 forward 169 -> 217, input gradient 169 -> 217;
512 -> 1408 forward 166 -> 210; 1408 -> 512 input gradient 162 -> 216. ``KERNELIZE_CPU_GEMM=torch``
keeps every product in ``torch.mm``. ``train_linear(x, weight, bias)`` is the same on tensors (the hub's
``Linear`` layer trains through it) and returns None where it does not apply.

Example:
    >>> proj = torch.nn.Linear(64, 32)
    >>> y = project(proj, torch.randn(8, 64, requires_grad=True))
    >>> y.shape
    torch.Size([8, 32])
"""

from __future__ import annotations

import torch
from torch import nn

from kernelize.codegen.cpu_gemv import onednn_gemm, onednn_linear
from kernelize.runtime.memory import empty_huge

from .policy import backend_for


class _Linear(torch.autograd.Function):
    """``x @ weight.T + bias``: forward and input gradient through oneDNN, weight gradient through MKL."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = onednn_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0] and torch.is_grad_enabled():
            dx = dy @ weight  # create_graph=True: torch's differentiable product (oneDNN's has no derivative)
        elif ctx.needs_input_grad[0]:
            dx2 = onednn_linear(dy2, weight.t())
            dx = (dy2 @ weight if dx2 is None else dx2).view(x.shape)
        if ctx.needs_input_grad[1] and torch.is_grad_enabled():
            dw = torch.mm(dy2.t(), x.reshape(-1, x.shape[-1]))
        elif ctx.needs_input_grad[1]:  # a new gradient faulting in huge pages
            dw = empty_huge(weight.shape, weight.dtype)
            torch.mm(dy2.t(), x.reshape(-1, x.shape[-1]), out=dw)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def _hookless(proj: nn.Module) -> bool:
    """A plain ``nn.Linear`` whose call runs no hooks (of its own or global)."""
    return (
        type(proj) is nn.Linear
        and not (proj._forward_hooks or proj._forward_pre_hooks)
        and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    )


def train_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` as :class:`_Linear` when gradients are needed and the oneDNN path applies
    (f32 CPU tensors, the cpu backend, no autocast, no ``torch.compile`` trace, no DTensor weight), else None
    (the caller's own path)."""
    if not (
        torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        and type(weight.data) is torch.Tensor
        and x.dim() >= 2
        and x.numel() > 0
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(x.device.type)  # autocast picks the matmul dtype: torch's call
        and onednn_gemm(x, weight, packed=False)
        and backend_for(x.device) == "cpu"  # not under use_backend("reference") or another forced backend
    ):
        return None
    return _Linear.apply(x, weight, bias)


def project(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``proj(x)``; on the CPU with gradients, a plain f32 ``nn.Linear`` runs its forward and input gradient
    through oneDNN (see the module doc)."""
    y = train_linear(x, proj.weight, proj.bias) if _hookless(proj) else None
    return proj(x) if y is None else y
