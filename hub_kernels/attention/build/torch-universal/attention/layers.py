"""Attention layers: the math once, as plain torch; `forward` runs the fused attention kernel.

The kernel is one ``ATTENTION`` op of the kernelize IR (`kernelize.attention`): q @ k^T, scale, mask,
an online softmax and the weighted sum of values in one pass, never storing the seq x seq scores. Calls
that need gradients run torch's `scaled_dot_product_attention` (it has a backward); what else the kernel
cannot run (dropout, other dtypes) runs `attention_math`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernelize import attention


# ---- the math (plain torch) ------------------------------------------------------------------------------
def attention_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float
) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v with the softmax in f32; a bool `mask` keeps where True."""
    logits = (q @ k.transpose(-1, -2)).to(torch.float32) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    return torch.softmax(logits, dim=-1).to(q.dtype) @ v


# ---- functional API --------------------------------------------------------------------------------------
def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    return _forward(None, q, k, v, mask, float(scale))


def _forward(owner, q, k, v, mask, scale):
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)  # the model's f32 mask on 16-bit activations: the kernel adds it in f32
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # the kernel has no backward; torch's SDPA has one and, on the CPU, never stores the scores either
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    try:
        return attention.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, owner=owner)
    except attention.AttentionUnsupported:
        return attention_math(q, k, v, mask, scale=scale)


# ---- kernel layers ----------------------------------------------------------------------------------------
class ScaledDotProductAttention(nn.Module):
    """`forward(q, k, v, mask=None)`: softmax(q @ k^T * self.scale + mask) @ v, one fused kernel.

    q, k, v are ``[batch, heads, seq, head_dim]`` (any strides); `mask` is additive (float) or boolean
    (True = attend) and broadcasts to ``[batch, heads, q_len, k_len]``.
    """

    has_backward = True  # through torch's SDPA (see _forward)
    can_torch_compile = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _forward(self, q, k, v, mask, float(getattr(self, "scale", q.shape[-1] ** -0.5)))
