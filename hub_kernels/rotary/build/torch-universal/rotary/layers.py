"""Rotary position embeddings: the math once, as plain torch; `forward` runs the generated kernels.

`cos` and `sin` have the rotary dimension `D` as their last axis (as transformers builds them: the
frequencies concatenated twice for the neox style, repeated element-wise for the interleaved style) and
broadcast against `q` and `k`.

* neox style (Llama, Qwen2, Mistral, GPT-NeoX): `x * cos + rotate_half(x) * sin`, where
  `rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])`;
* interleaved style (GPT-J): pairs `(x[2i], x[2i+1])` rotate: `x * cos + rotate_pairs(x) * sin`, where
  `rotate_pairs(x)[2i] = -x[2i+1]` and `rotate_pairs(x)[2i+1] = x[2i]`.
"""

from __future__ import annotations

import torch
from torch import nn

from kernelize import hub


# ---- the math (plain torch; traced into kernels) ---------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1)
    return rotated.reshape(x.shape)


def rotary_neox_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin."""
    return x * cos + rotate_half(x) * sin


def rotary_interleaved_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_pairs(x) * sin."""
    return x * cos + rotate_pairs(x) * sin


def rotary_neox_math(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)."""
    return rotary_neox_one(q, cos, sin), rotary_neox_one(k, cos, sin)


def rotary_interleaved_math(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin)."""
    return rotary_interleaved_one(q, cos, sin), rotary_interleaved_one(k, cos, sin)


def rotary_qk_math(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, heads: int, head_dim: int, neox: bool
) -> torch.Tensor:
    """Rotate the query and key heads of `qk` (batch, seq, heads * head_dim) at once.

    `cos`/`sin` are (batch, seq, R) with R <= head_dim: the first R dims of each head rotate, the rest pass
    through (partial rotary, as Phi-3). The result is (batch, heads, seq, head_dim): the layout attention and
    the KV cache read, so the kernel's store does the transpose instead of a later copy.
    """
    b, s = qk.shape[0], qk.shape[1]
    x = qk.view(b, s, heads, head_dim)
    c, sn = cos.unsqueeze(2), sin.unsqueeze(2)
    one = rotary_neox_one if neox else rotary_interleaved_one
    r = cos.shape[-1]
    out = one(x, c, sn) if r == head_dim else torch.cat((one(x[..., :r], c, sn), x[..., r:]), dim=-1)
    return out.transpose(1, 2)


def apply_rotary_qk(
    qk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    head_dim: int,
    is_neox_style: bool = True,
    owner: nn.Module | None = None,
) -> torch.Tensor:
    """Functional API: `rotary_qk_math` as one generated kernel (query and key heads side by side in `qk`)."""
    return hub.run(owner, rotary_qk_math, [qk, cos, sin], heads=heads, head_dim=head_dim, neox=is_neox_style)


def _apply(owner: nn.Module | None, one, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    # One kernel per tensor: q and k may have different head counts (grouped-query attention), and the
    # planner currently drops one output of a two-output graph whose outputs share broadcast inputs.
    return hub.run(owner, one, [q, cos, sin]), hub.run(owner, one, [k, cos, sin])


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional API: rotate `q` and `k` with generated kernels."""
    return _apply(None, rotary_neox_one if is_neox_style else rotary_interleaved_one, q, k, cos, sin)


# ---- kernel layers ----------------------------------------------------------------------------------------
class RotaryEmbedding(nn.Module):
    """`forward(q, k, cos, sin) -> (q_rot, k_rot)`; the style from `self.is_neox_style` (default neox)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        neox = bool(getattr(self, "is_neox_style", True))
        return _apply(self, rotary_neox_one if neox else rotary_interleaved_one, q, k, cos, sin)


class ApplyRotaryPosEmb(nn.Module):
    """For transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` (marked `rotary_pos_emb`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return _apply(self, rotary_neox_one, q, k, cos, sin)
