"""Token embeddings while training on the CPU: a weight gradient that costs the rows it writes.

``train_embedding(ids, weight, padding_idx)`` is ``F.embedding(ids, weight, padding_idx)`` with gradients.
Its backward makes the dense ``[vocab, hidden]`` weight gradient on a fresh anonymous mapping
(:func:`kernelize.runtime.memory.zeros_lazy`), whose pages the OS zeroes when first touched, and adds the
upstream rows at their ids (``index_add_``): torch's backward zero-fills all of it first (65 MB for
32000 x 512 f32; 38 ms of a ~440 ms demo training step in a profile) to add a few hundred rows. The
result is the same tensor autograd would make: zeros, the rows added, the padding row left zero. In an
interleaved A/B of the demo's fused-loss step (15 repetitions): 1.33x eager with the earlier
huge-page tensor zeroed in full, 1.38x lazily zeroed. Returns None where it does not apply (no gradient
needed, not the cpu backend, a ``torch.compile`` trace, a DTensor weight): the caller runs ``F.embedding``.

Example:
    >>> w = torch.randn(100, 8, requires_grad=True)
    >>> train_embedding(torch.tensor([[1, 5, 1]]), w).sum().backward()
    >>> w.grad[1].tolist() == [2.0] * 8
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernelize.runtime.memory import zeros_lazy

from .policy import backend_for


class _Embedding(torch.autograd.Function):
    """``weight[ids]``; backward: the dense weight gradient, lazily zeroed."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        grad = zeros_lazy(weight.shape, weight.dtype)
        grad.index_add_(0, ids.reshape(-1), dy.reshape(-1, weight.shape[1]).to(weight.dtype))
        if ctx.padding_idx is not None:
            grad[ctx.padding_idx] = 0
        return None, grad, None


def train_embedding(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor | None:
    """``F.embedding(ids, weight, padding_idx)`` as :class:`_Embedding` when the weight needs a gradient
    on the CPU backend (no ``torch.compile`` trace, no DTensor weight), else None (the caller's own path)."""
    if not (
        torch.is_grad_enabled()
        and weight.requires_grad
        and type(weight.data) is torch.Tensor
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and ids.dtype in (torch.int32, torch.int64)
        and not torch.compiler.is_compiling()
        and backend_for(weight.device) == "cpu"  # not under use_backend("reference") or another backend
    ):
        return None
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _Embedding.apply(ids, weight, padding_idx)
