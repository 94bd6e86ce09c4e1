"""Token embeddings while training on the CPU: the weight gradient without 4 KiB page faults.

``train_embedding(ids, weight, padding_idx)`` is ``F.embedding(ids, weight, padding_idx)`` with gradients.
Its backward makes the dense ``[vocab, hidden]`` weight gradient as a tensor that asks for transparent huge
pages before it is zeroed (:func:`kernelize.runtime.memory.empty_huge`): torch's backward zero-fills a
fresh one page by page (16,000 faults for 32000 x 512 f32, ~16 ms of a ~450 ms step here) before adding a
few hundred rows into it. The result is the same tensor autograd would make: zeros, the
upstream rows added at their ids (``index_add_``), the padding row left zero. Returns None where it does
not apply (no gradient needed, not the cpu backend, a ``torch.compile`` trace, a DTensor weight): the
caller runs ``F.embedding``.

Example:
    >>> w = torch.randn(100, 8, requires_grad=True)
    >>> train_embedding(torch.tensor([[1, 5, 1]]), w).sum().backward()
    >>> w.grad[1].tolist() == [2.0] * 8
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernelize.runtime.memory import empty_huge

from .policy import backend_for


class _Embedding(torch.autograd.Function):
    """``weight[ids]``; backward: the dense weight gradient in huge pages."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        grad = empty_huge(weight.shape, weight.dtype)
        grad.zero_()
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
