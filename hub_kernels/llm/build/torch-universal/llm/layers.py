"""Attention for transformers decoder models: torch projections, rotary as one kernel, the attention kernel.

`CausalSelfAttention` replaces the forward of a Llama-style attention module (Llama, Qwen2, Mistral, Gemma,
Phi-3...). State comes from the replaced module: `q_proj`/`k_proj`/`v_proj` or a fused `qkv_proj`, `o_proj`,
`head_dim`, `scaling`, `layer_idx`, `config` (head counts), `is_neox_style` (set by
`kernelize.integrations.transformers.kernelize_model` from the model's own rotary function), and
`sliding_window` when the family has one. The forward:

1. `project_qkv`: in inference, q|k|v merged once into one weight (`kernelize.merge`: the projections'
   parameters become views of it) and projected by one generated matmul kernel (up to 16 rows, as in
   decode: the few-row kernel reading each weight byte once); with gradients, torch matmuls; packed
   projections (`kernelize_model(quantize=...)`) as one packed call over their merged bytes;
2. query / key norms when the module has them (`norm_qk`: Qwen3, Gemma3 per head, OLMo2 over the
   projection), then rotary on the query and key heads in one generated kernel that also writes the
   `(batch, heads, seq, head_dim)` layout (`kernelize/rotary`'s `apply_rotary_qk`);
3. `cache.update(...)` (transformers' `DynamicCache`, as the model's own forward calls it; the argument is
   `cache` since transformers 5.24, `past_key_values` before, and both names are taken);
4. `kernelize.model_attention.attention_forward`: the generated attention kernel, or the module's
   eager attention with the reason noted for `kernelize.inspect`; a call that needs gradients takes torch's
   `scaled_dot_product_attention` (it has a backward; the generated kernel has none);
5. `o_proj` (in inference, a generated matmul kernel too).

Under tensor parallelism (the Megatron split, `kernelize.shards`) each rank runs the same steps on its local
heads and weight shards, and all-reduces the `o_proj` product before its bias.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from kernelize import hub, kv_cache
from kernelize.model_attention import attention_forward
from kernelize.shards import heads_of, require

from .alibi import AlibiAttention as AlibiAttention  # layers of this repository
from .alibi import ResidualAlibiAttention as ResidualAlibiAttention
from .block import ROTARY_TABLES as ROTARY_TABLES  # read by the one call
from .block import block_of, norms_of, rotary_tables, row_parallel, run_block
from .causal_lm import CausalLMWithLoss as CausalLMWithLoss  # a layer of this repository
from .causal_lm import MoECausalLM as MoECausalLM  # a layer of this repository
from .decode_step import replayed
from .fused_qkv import FusedQKVAttention as FusedQKVAttention  # layers of this repository
from .fused_qkv import FusedQKVDecoderLayer as FusedQKVDecoderLayer


@functools.cache
def _rotary() -> Any:
    from kernelize.layer.hub import get_kernel

    return get_kernel("kernelize/rotary", version=1)


@functools.cache
def _norms() -> Any:
    from kernelize.layer.hub import get_kernel

    return get_kernel("kernelize/layer_norm", version=1).layers


def linear_math(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


def linear_bias_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x @ weight.t() + bias


def _inference(x: torch.Tensor, *linears: nn.Module) -> bool:
    """True when generated matmul kernels may stand in for these linears (no autograd involved)."""
    return not (torch.is_grad_enabled() and (x.requires_grad or any(_grad(m) for m in linears)))


def _grad(linear: nn.Module) -> bool:
    return bool(getattr(getattr(linear, "weight", None), "requires_grad", False))


def _packed(*linears: nn.Module) -> bool:
    """Packed projections (`QuantizedLinear`, `kernelize_model(quantize=...)`): the packed decode kernels."""
    from kernelize.quant.fused import is_packed

    return is_packed(*linears)


def _packed_qkv(module: nn.Module, projs: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """q|k|v of packed projections: one packed call over their merged bytes (one activation quantization),
    or each projection's own call when they cannot be merged (formats or biases differ)."""
    from kernelize.quant.fused import merged_packed
    from kernelize.quant.ops import linear as packed_linear

    merged = merged_packed(module, ("q_proj", "k_proj", "v_proj")) if len(projs) > 1 else None
    if merged is not None:
        return packed_linear(x, *merged)
    return torch.cat([p(x) for p in projs], dim=-1) if len(projs) > 1 else projs[0](x)


def linear(
    owner: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` as one generated matmul kernel."""
    if bias is None:
        return hub.run(owner, linear_math, [x], [weight])
    return hub.run(owner, linear_bias_math, [x], [weight, bias])


def merged_qkv(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The q|k|v projection as one `(weight, bias or None)` (merged once, see `kernelize.merge`), or None when
    the projections cannot be merged (some but not all have a bias)."""
    from kernelize.merge import merged_parameter

    if hasattr(module, "qkv_proj"):
        return module.qkv_proj.weight, module.qkv_proj.bias
    names = ("q_proj", "k_proj", "v_proj")
    biases = [getattr(module, n).bias for n in names]
    if all(b is None for b in biases):
        return merged_parameter(module, names), None
    if all(b is not None for b in biases):
        return merged_parameter(module, names), merged_parameter(module, names, "bias")
    return None


def project_qkv(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(qk, v)`: the query and key projections side by side `(..., (heads + kv_heads) * head_dim)`, and v.

    Keeping q and k in one tensor lets one rotary kernel rotate both.
    """
    n_qk = sum(heads_of(module, require(module))) * module.head_dim
    projs = (
        [module.qkv_proj] if hasattr(module, "qkv_proj") else [module.q_proj, module.k_proj, module.v_proj]
    )
    merged = merged_qkv(module) if _inference(hidden_states, *projs) and not _packed(*projs) else None
    if _packed(*projs):
        qkv = _packed_qkv(module, projs, hidden_states)
    elif merged is not None:
        qkv = linear(module, hidden_states, *merged)
    elif len(projs) == 1:
        qkv = hub.project(projs[0], hidden_states)
    else:
        qkv = torch.cat([hub.project(p, hidden_states) for p in projs], dim=-1)
    return qkv[..., :n_qk], qkv[..., n_qk:]


def norm_qk(module: nn.Module, qk: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Query / key norms before rotary, when the module has them: per head (Qwen3, Gemma3: a `head_dim`
    weight) or over the whole projection (OLMo2), each by the norm module's own (possibly kernelized)
    forward."""
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if q_norm is None and k_norm is None:
        return qk
    n_q = heads * head_dim
    q, k = qk[..., :n_q], qk[..., n_q:]
    q = q if q_norm is None else _norm_heads(q_norm, q, head_dim)
    k = k if k_norm is None else _norm_heads(k_norm, k, head_dim)
    return torch.cat([q, k], dim=-1)


def _norm_heads(norm: nn.Module, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    weight = getattr(norm, "weight", None)
    if weight is not None and weight.numel() != head_dim:  # over the whole projection
        return norm(x)
    return norm(x.unflatten(-1, (-1, head_dim))).flatten(-2)


def project_out(module: nn.Module, out: torch.Tensor, proj: nn.Linear | None = None) -> torch.Tensor:
    """`proj(out)` (default: `module.o_proj`): a generated matmul kernel in inference."""
    proj = module.o_proj if proj is None else proj
    if _packed(proj):
        return proj(out)
    if not _inference(out, proj):
        return hub.project(proj, out)  # under tensor parallelism its own hooks all-reduce
    shards = require(module)
    if shards is None:
        return linear(module, out, proj.weight, proj.bias)
    return row_parallel(module, shards, out, proj)


def sliding_window_of(module: nn.Module) -> int | None:
    """The window the model's own forward passes to its attention function (module attribute, else config);
    None for none, and for 0, which cuts nothing (Qwen2-MoE's config says 0 on its full-attention layers)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window or None
    return getattr(module.config, "sliding_window", None) or None


class CausalSelfAttention(nn.Module):
    """Llama-style self-attention: projections, fused rotary, KV cache update, the attention kernel."""

    has_backward = True  # calls with gradients take torch's SDPA (model_attention.attention_with_grad)
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,  # named `past_key_values` before transformers 5.24: then it comes in `kwargs`
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        batch, seq = hidden_states.shape[:2]
        (heads, kv_heads), head_dim = heads_of(self, require(self)), self.head_dim  # this rank's heads
        qk, value = project_qkv(self, hidden_states)
        qk = norm_qk(self, qk, heads, head_dim)
        cos, sin = position_embeddings
        cos, sin = rotary_tables(self, cos, sin)
        rotated = _rotary().apply_rotary_qk(
            qk, cos, sin, heads + kv_heads, head_dim, bool(getattr(self, "is_neox_style", True)), owner=self
        )
        query, key = rotated[:, :heads], rotated[:, heads:]
        value = value.reshape(batch, seq, kv_heads, head_dim).transpose(1, 2)
        out, weights = attend(self, query, key, value, attention_mask, cache, kwargs)
        return project_out(self, out), weights


def attend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`cache.update(...)` then attention (the generated kernel, or eager with the reason noted):
    `(out (batch, seq, heads * head_dim), attention weights or None)`."""
    if cache is not None:
        key, value = kv_cache.update(cache, key, value, module.layer_idx)
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.Tensor) and "s_aux" not in kwargs:  # gpt-oss: a logit per head beside the keys
        kwargs = {**kwargs, "s_aux": sinks}
    out, weights = attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=module.attention_dropout if module.training else 0.0,
        scaling=module.scaling,
        sliding_window=sliding_window_of(module),
        softcap=getattr(module, "attn_logit_softcapping", None),
        **kwargs,
    )
    return out.reshape(query.shape[0], query.shape[2], -1), weights


def add_norm(owner: nn.Module, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, name: str):
    """`(norm(x + residual), x + residual)` as one generated kernel; `name`: the norm's kernel layer
    (RMSNorm, GemmaRMSNorm, LayerNorm). A norm the fused math does not take runs its own forward."""
    layers = _norms()
    style = layers.norm_style(name, norm)
    if style is None:
        total = x + residual
        return norm(total), total
    params = layers.norm_params(style, norm)
    eps = layers.eps_of(norm)
    return hub.run(owner, layers.fused_add_norm_math, [x, residual], params, style=style, eps=eps)


def decoder_forward(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    attention_mask: torch.Tensor | None,
    cache: Any,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """A decoder layer's forward, its norms wherever its `kernelize_norms` puts them (see `block.py`): the
    three-graph block in inference, else the submodules' own forwards with the residual add and a pre-MLP
    norm as one kernel. `kwargs` go on to the attention (`position_ids`, `use_cache`, ...)."""
    block = block_of(layer, hidden_states, CausalSelfAttention)
    if block is not None and position_embeddings is not None:
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)

        out = replayed(layer, block, hidden_states, position_embeddings, attention_mask, cache, kwargs)
        if out is not None:
            return out

        def attend_here(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend(layer.self_attn, q, k, v, attention_mask, cache, kwargs)[0]

        return run_block(layer, block, hidden_states, position_embeddings, attend_here, merged_qkv)
    if cache is not None:  # passed on under the name it came with
        kwargs["cache"] = cache
    norms = {slot: getattr(layer, name) for slot, name in norms_of(layer).items()}
    residual = hidden_states
    if "input" in norms:
        hidden_states = norms["input"](hidden_states)
    hidden_states, _ = layer.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    if hasattr(layer, "resid_attn_dropout"):
        hidden_states = layer.resid_attn_dropout(hidden_states)
    if "post_attn" in norms:
        hidden_states = norms["post_attn"](hidden_states)
    if "pre_ff" in norms:
        style = layer.kernelize_norm_style
        hidden_states, residual = add_norm(layer, norms["pre_ff"], hidden_states, residual, style)
    else:
        hidden_states = residual = residual + hidden_states
    hidden_states = layer.mlp(hidden_states)
    if isinstance(hidden_states, tuple):  # an MoE block's (output, router scores), as gpt-oss's returns
        hidden_states = hidden_states[0]
    if hasattr(layer, "resid_mlp_dropout"):
        hidden_states = layer.resid_mlp_dropout(hidden_states)
    if "post_ff" in norms:
        hidden_states = norms["post_ff"](hidden_states)
    return residual + hidden_states


class PreNormDecoderLayer(nn.Module):
    """A decoder layer (Llama, Qwen2, Mistral, Gemma, Phi-3, OLMo2, Starcoder2) with the parameter order
    `(hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings)`: in inference
    three generated graphs around the attention kernel (`block.py`), else its residual add and pre-MLP norm
    as one kernel (two stores: the normalised input of the MLP and the new residual) and the submodules'
    own (possibly kernelized) forwards. Its norms may sit before and after attention and the MLP (named by
    the data flow, not by the submodules' names); reads `self_attn`, `mlp`, the norms, `kernelize_norms`
    (slot -> norm submodule) and `kernelize_norm_style` (the pre-MLP norm's layer name), both set by
    `kernelize_model`, and Phi-3's `resid_attn_dropout` / `resid_mlp_dropout` when present.
    """

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,  # named `past_key_values` before transformers 5.24: then it comes in `kwargs`
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        kwargs = dict(kwargs, position_ids=position_ids, use_cache=use_cache)
        return decoder_forward(self, hidden_states, position_embeddings, attention_mask, cache, kwargs)


class EmbeddingsFirstDecoderLayer(nn.Module):
    """`PreNormDecoderLayer` for the parameter order `(hidden_states, position_embeddings, attention_mask,
    position_ids, cache)` and no `use_cache` (Gemma 2, Gemma 3)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        kwargs = dict(kwargs, position_ids=position_ids)
        return decoder_forward(self, hidden_states, position_embeddings, attention_mask, cache, kwargs)
