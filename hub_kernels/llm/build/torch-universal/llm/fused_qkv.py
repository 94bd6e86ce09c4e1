"""Attention with one fused q | k | v projection and no position encoding of its own (GPT-2 and look-alikes:
the learned positions are added to the embeddings before the first layer).

`FusedQKVAttention` replaces the forward of a GPT-2-style self-attention module. State comes from the
replaced module: `c_attn` (q | k | v side by side, heads contiguous in each; transformers' `Conv1D`, weight
stored `(in, out)`, or an `nn.Linear`), `c_proj` (likewise), `head_dim`, `scaling` (GPT-2 folds
`scale_attn_weights` and `scale_attn_by_inverse_layer_idx` into it), `layer_idx`, `attn_dropout`,
`resid_dropout`. `kernelize.integrations.transformers.kernelize_model` checks that structure before marking
the module. The forward:

1. `c_attn`: in inference one generated matmul kernel, bias fused (`x @ W + b` for a `Conv1D`, whose weight
   is re-laid once as `(out, in)` in memory by `kernelize.merge.linear_layout`: values and shape unchanged);
2. split into query, key and value heads `(batch, heads, seq, head_dim)`: views, no copies;
3. `cache.update(...)` (transformers' `DynamicCache`; the self-attention half of an `EncoderDecoderCache`);
4. `kernelize.model_attention.attention_forward`: the generated attention kernel with the model's mask
   (`sdpa_mask`: boolean, or None for plain causal attention), or the module's eager attention with the
   reason noted for `kernelize.inspect`; a call with gradients takes torch's SDPA;
5. `c_proj` (a generated matmul kernel in inference), then the module's residual dropout.

A call with `encoder_hidden_states` (cross-attention) runs the module's own forward; `kernelize_model`
never marks a cross-attention instance, so this only happens to a module used outside its model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernelize import hub, kv_cache
from kernelize.layer.kernelize import original_forward
from kernelize.merge import linear_layout
from kernelize.model_attention import attention_forward, note_fallback


def conv1d_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """transformers' `Conv1D`: the weight is stored `(in, out)`."""
    return x @ weight + bias


def conv1d_nobias_math(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight


def is_conv1d(proj: nn.Module) -> bool:
    return type(proj).__name__ == "Conv1D"


def project(owner: nn.Module, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`proj(x)` for an `nn.Linear` or a `Conv1D`: a generated matmul kernel in inference, torch's (with a
    backward) otherwise."""
    from .layers import linear, project_out  # imported when called: layers.py imports this module

    if not is_conv1d(proj):
        return project_out(owner, x, proj)
    if torch.is_grad_enabled() and (x.requires_grad or proj.weight.requires_grad):
        return proj(x)
    weight = linear_layout(proj.weight)  # (out, in) in memory: the layout the matmul kernels read fastest
    if weight is not None:
        return linear(owner, x, weight, proj.bias)
    if proj.bias is None:
        return hub.run(owner, conv1d_nobias_math, [x], [proj.weight])
    return hub.run(owner, conv1d_math, [x], [proj.weight, proj.bias])


class FusedQKVAttention(nn.Module):
    """GPT-2's self-attention: fused `c_attn`, the KV cache, the attention kernel, `c_proj`."""

    has_backward = True  # calls with gradients take torch's projections and SDPA
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,  # named `past_key_values` before transformers 5.24: then it comes in `kwargs`
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if encoder_hidden_states is not None:
            note_fallback(self, "cross-attention (encoder_hidden_states) is not in the layer", "own forward")
            own = original_forward(self)
            return own(
                hidden_states,
                cache,
                attention_mask,
                encoder_hidden_states,
                encoder_attention_mask,
                output_attentions,
                **kwargs,
            )
        batch, seq = hidden_states.shape[:2]
        qkv = project(self, self.c_attn, hidden_states)
        query, key, value = (
            t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1)
        )
        if cache is not None:
            cache = getattr(cache, "self_attention_cache", cache)  # an EncoderDecoderCache's own half
            key, value = kv_cache.update(cache, key, value, self.layer_idx)
        out, weights = attention_forward(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attn_dropout.p if self.training else 0.0,
            scaling=self.scaling,
            output_attentions=output_attentions,
            **kwargs,
        )
        out = project(self, self.c_proj, out.reshape(batch, seq, -1))
        return self.resid_dropout(out), weights
