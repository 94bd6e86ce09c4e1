"""ALiBi attention for the families that write their attention out (BLOOM, MPT): fused q|k|v projection,
transformers' cache, the attention kernel with ALiBi as a score modification, the output projection.

The modules keep their own forward signatures, so there is one layer per signature; both read the
`kernelize_alibi` score modification (`kernelize.ir.score_mod.alibi`, the family's slopes) that
`kernelize.integrations.transformers.kernelize_model` sets on each instance, and ignore the bias tensor the
model passes (a slope per head times a key position: the modification computes it inside the kernel).

- `ResidualAlibiAttention` (BLOOM): `query_key_value` (heads interleaved: per head q, k, v), `dense`, the
  residual added after the output's dropout, as `BloomAttention.forward` does;
- `AlibiAttention` (MPT): `Wqkv` (q | k | v), optional `clip_qkv`, `out_proj`; MPT's mask is True where a
  key is cut.

The attention weights are not computed (None) unless the call takes the eager path
(`kernelize.model_attention.attention_forward`: `output_attentions=True`, gradients with dropout...).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernelize import kv_cache
from kernelize.model_attention import attention_forward

from .fused_qkv import project as _project  # Linear or Conv1D: a matmul kernel in inference


class ResidualAlibiAttention(nn.Module):
    """BLOOM's attention: interleaved fused q|k|v, ALiBi in the kernel, `dense`, dropout, `+ residual`."""

    has_backward = True  # calls with gradients take torch's SDPA with the bias in the mask
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        alibi: torch.Tensor,
        attention_mask: torch.Tensor,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq = hidden_states.shape[:2]
        qkv = _project(self, self.query_key_value, hidden_states)
        qkv = qkv.view(batch, seq, self.num_heads, 3, self.head_dim)
        query, key, value = (qkv[..., i, :].transpose(1, 2) for i in range(3))
        if layer_past is not None:
            key, value = kv_cache.update(layer_past, key, value, self.layer_idx)
        out, weights = attention_forward(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout.p if self.training else 0.0,
            scaling=self.inv_norm_factor,
            output_attentions=output_attentions,
            alibi=self.kernelize_alibi,
        )
        out = _project(self, self.dense, out.reshape(batch, seq, -1))
        out = torch.nn.functional.dropout(out, p=self.hidden_dropout, training=self.training)
        return residual + out, weights


class AlibiAttention(nn.Module):
    """MPT's attention: fused q|k|v (optionally clipped), ALiBi in the kernel, `out_proj`."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_bias: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        batch, seq = hidden_states.shape[:2]
        qkv = _project(self, self.Wqkv, hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query, key, value = (
            t.reshape(batch, seq, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2)
        )
        if cache is not None:
            key, value = kv_cache.update(cache, key, value, self.layer_idx)
        out, weights = attention_forward(
            self,
            query,
            key,
            value,
            None if attention_mask is None else ~attention_mask,  # MPT's mask: True cuts the key
            dropout=self.attn_dropout_p if self.training else 0.0,
            scaling=self.softmax_scale,
            is_causal=False,  # the mask carries the causal cut; without one MPT attends to every key
            alibi=self.kernelize_alibi,
        )
        return _project(self, self.out_proj, out.reshape(batch, seq, -1)), weights
