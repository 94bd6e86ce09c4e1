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

`FusedQKVDecoderLayer` replaces the forward of GPT-2's decoder layer (`ln_1`, `attn`, `ln_2`, `mlp`, the
residual adds). In inference, when its attention runs `FusedQKVAttention`, its MLP `DenseMLP` and its norms
the `LayerNorm` kernel layer, the layer is three generated graphs around the attention kernel, where module
by module it is six graph calls, two torch adds and five module calls:

1. `dense_pre_math`: `ln_1` -> `c_attn` (+ bias) -> q, k, v as views in the attention layout;
2. the cache update and the attention kernel, as `FusedQKVAttention` runs them;
3. `dense_post_math`: `c_proj` (+ bias) + residual -> `ln_2`: `(normed, residual)`;
4. `dense_mlp_math`: `c_fc` (+ bias) -> activation -> `c_proj` (+ bias) + residual.

Anything else (training, hooks on the submodules, cross-attention, tensor-parallel shards, packed or shared
weights) runs the layer's own forward, its submodules' kernel forwards inside, with the reason in
`kernelize.inspect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernelize import hub, kv_cache
from kernelize.layer.kernelize import original_forward
from kernelize.merge import linear_layout
from kernelize.model_attention import attention_forward, note_fallback
from kernelize.shards import shards_of

from .block import _hubs, _installed, planned  # the norm / activation hubs, one block planner
from .decode_step import replayed_fused_qkv


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


# ---- GPT-2's decoder layer: three graphs around the attention kernel --------------------------------------
def _linear(x, weights, bias: bool):
    """`x @ W.T (+ b)` with W (and b) the next of the iterator `weights`."""
    y = x @ next(weights).t()
    return y + next(weights) if bias else y


def dense_pre_math(x, *weights, norm, eps, bias, heads, head_dim):
    """(q, k, v) of `norm(x) @ W.T (+ b)`, each `(batch, heads, seq, head_dim)`: views of one buffer, which
    the cache and the attention kernel read through strides. `weights`: the norm's (its style's, see the
    layer_norm hub's `norm_style`), W[, b]."""
    w = iter(weights)
    qkv = _linear(_hubs()[0].styled_norm(x, w, norm, eps), w, bias)
    width = heads * head_dim
    split = (qkv[..., i * width : (i + 1) * width] for i in range(3))
    return tuple(t.view(x.shape[0], x.shape[1], heads, head_dim).transpose(1, 2) for t in split)


def dense_post_math(attn, residual, *weights, bias, norm, eps):
    """`(norm(h), h)` for `h = attn @ W.T (+ b) + residual`; `weights`: W[, b], the norm's."""
    w = iter(weights)
    return _hubs()[0].fused_add_norm_math(_linear(attn, w, bias), residual, *w, style=norm, eps=eps)


def dense_mlp_math(x, residual, *weights, up_bias, down_bias, act):
    """`act(x @ W_up.T (+ b)) @ W_down.T (+ b) + residual`; `weights`: W_up[, b], W_down[, b]."""
    w = iter(weights)
    return _linear(_hubs()[1].ACT_MATH[act](_linear(x, w, up_bias)), w, down_bias) + residual


@dataclass(frozen=True)
class DenseBlock:
    """What one GPT-2-style layer's graphs read: the norms' styles and epsilons, the heads, the MLP's
    activation and projection names."""

    norms: tuple[str, str]
    eps: tuple[float, float]
    heads: int
    head_dim: int
    act: str
    mlp_names: tuple[str, str]


def _weight(proj: nn.Module) -> torch.Tensor | None:
    """`proj`'s weight as `(out, in)` (a `Conv1D`'s re-laid in its own memory), None where it cannot be."""
    weight = getattr(proj, "weight", None)
    if type(weight) not in (torch.Tensor, nn.Parameter) or not weight.is_floating_point():
        return None
    return linear_layout(weight) if is_conv1d(proj) else weight


def _dense_plan(layer: nn.Module) -> DenseBlock | str:
    """The layer's block, or why its submodules must run their own forwards."""
    norms, activation = _hubs()[:2]
    attn, mlp = layer.attn, layer.mlp
    if _installed(attn) is not FusedQKVAttention.forward:
        return "attn does not run the FusedQKVAttention kernel layer"
    if _installed(mlp) is not activation.DenseMLP.forward:
        return "mlp does not run the DenseMLP kernel layer"
    up_name, down_name, act = mlp.kernelize_dense_mlp
    styles = []
    for name in ("ln_1", "ln_2"):
        ln = getattr(layer, name)
        kernel = _installed(ln) is norms.LayerNorm.forward
        styles.append(norms.norm_style("LayerNorm", ln) if kernel else None)
        if styles[-1] is None:
            return f"{name} is not a LayerNorm kernel layer over one axis (with a weight where it has a bias)"
    if any(shards_of(m) is not None for m in (attn, mlp)):
        return "tensor-parallel shards: the submodules run their own forwards and collectives"
    projections = (attn.c_attn, attn.c_proj, getattr(mlp, up_name), getattr(mlp, down_name))
    if any(_weight(p) is None for p in projections):
        return "a projection is packed, or a Conv1D weight shares its storage (it cannot be re-laid)"
    eps = (norms.eps_of(layer.ln_1), norms.eps_of(layer.ln_2))
    heads = layer.ln_1.normalized_shape[0] // attn.head_dim  # hidden = heads * head_dim (recognition)
    return DenseBlock(tuple(styles), eps, heads, attn.head_dim, act, (up_name, down_name))


_SUBMODULES = ("attn", "mlp", "ln_1", "ln_2")


def dense_block_of(layer: nn.Module, x: torch.Tensor) -> DenseBlock | None:
    """`layer`'s block for this call, or None (its own forward runs; the reason noted for `inspect`)."""
    return planned(layer, x, _SUBMODULES, _dense_plan)


def _biased(proj: nn.Module) -> list[torch.Tensor]:
    return [] if proj.bias is None else [proj.bias]


def run_dense_block(
    layer: nn.Module,
    block: DenseBlock,
    x: torch.Tensor,
    cache: Any,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The layer's output for `x` as three graphs around the attention kernel; None where a weight can no
    longer be read as `(out, in)` (the caller runs the layer's own forward)."""
    graphs = dense_graphs(layer, block)
    if graphs is None:
        return None
    (pre_w, pre), (post_w, post), (mlp_w, flags) = graphs
    attn, mlp = layer.attn, layer.mlp
    batch, seq = x.shape[:2]
    q, k, v = hub.run(attn, dense_pre_math, [x], pre_w, **pre)
    if cache is not None:
        cache = getattr(cache, "self_attention_cache", cache)  # an EncoderDecoderCache's own half
        k, v = kv_cache.update(cache, k, v, attn.layer_idx)
    out, _ = attention_forward(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    normed, h = hub.run(layer, dense_post_math, [out.reshape(batch, seq, -1), x], post_w, **post)
    return hub.run(mlp, dense_mlp_math, [normed, h], mlp_w, **flags)


def dense_graphs(layer: nn.Module, block: DenseBlock) -> tuple | None:
    """The weights and parameters of the layer's three graphs, `((pre_w, pre), (post_w, post), (mlp_w,
    flags))` for `dense_pre_math`, `dense_post_math`, `dense_mlp_math`; None where a weight can no longer
    be read as `(out, in)`."""
    attn, mlp, ln_1, ln_2 = (getattr(layer, name) for name in _SUBMODULES)
    up, down = (getattr(mlp, name) for name in block.mlp_names)
    weights = [_weight(p) for p in (attn.c_attn, attn.c_proj, up, down)]
    if any(w is None for w in weights):
        return None
    norms = _hubs()[0]
    pre_w = [*norms.norm_params(block.norms[0], ln_1), weights[0], *_biased(attn.c_attn)]
    pre = dict(norm=block.norms[0], eps=block.eps[0], bias=attn.c_attn.bias is not None)
    post_w = [weights[1], *_biased(attn.c_proj), *norms.norm_params(block.norms[1], ln_2)]
    post = dict(norm=block.norms[1], eps=block.eps[1], bias=attn.c_proj.bias is not None)
    mlp_w = [weights[2], *_biased(up), weights[3], *_biased(down)]
    flags = dict(up_bias=up.bias is not None, down_bias=down.bias is not None, act=block.act)
    return (pre_w, dict(pre, heads=block.heads, head_dim=block.head_dim)), (post_w, post), (mlp_w, flags)


class FusedQKVDecoderLayer(nn.Module):
    """GPT-2's decoder layer: `ln_1` -> attention -> `+`, `ln_2` -> MLP -> `+`; in inference three generated
    graphs around the attention kernel (see the module's docstring), else its own forward."""

    has_backward = True  # a call with gradients runs the layer's own forward
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,  # named `past_key_values` before transformers 5.24: then it comes in `kwargs`
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        block = None if encoder_hidden_states is not None else dense_block_of(self, hidden_states)
        if block is not None:
            step = dict(kwargs, use_cache=use_cache)  # as GPT-2's layer passes them to its attention
            out = replayed_fused_qkv(self, block, hidden_states, attention_mask, cache, step)
            if out is not None:
                return out
            out = run_dense_block(self, block, hidden_states, cache, attention_mask, step)
            if out is not None:
                return out
        own = original_forward(self)
        args = (encoder_hidden_states, encoder_attention_mask, use_cache)
        return own(hidden_states, cache, attention_mask, *args, **kwargs)
