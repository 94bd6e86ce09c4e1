"""A pre-norm decoder layer's inference forward as three generated-kernel graphs around the attention kernel.

Run module by module, one decoder layer makes seven calls into compiled graphs per step (input norm, q|k|v
matmul, rotary, o_proj, residual add + norm, gate|up matmul, down matmul) plus torch's final residual add,
each with ~20 us of Python around its kernel; at one token per step that is a sizeable share of a small
model's step beside the weight reads. `run_block` makes three, and the attention kernel between them:

1. `pre_attention_math`: input norm -> merged q|k|v matmul (+ bias) -> rotary on q and k; q, k and v come
   out in the `(batch, heads, seq, head_dim)` layout the cache and the attention kernel read;
2. transformers' `cache.update(...)` and the attention kernel, exactly as `CausalSelfAttention` calls them
   (so every cache class and every per-call attention fallback keeps working);
3. `post_attention_math`: o_proj (+ bias) -> + residual -> post-attention norm: `(normed, residual)`;
4. `mlp_math`: `act(x @ gate.T) * (x @ up.T)` over the merged gate|up weight -> down_proj -> + residual.

The block runs when the layer's attention runs this hub's `CausalSelfAttention`, its MLP the activation
hub's `GatedMLP` / `FusedGatedMLP` with bias-free projections and a gated activation the table knows, its
input norm a norm of the `kernelize/layer_norm` hub, and nothing needs gradients (nor dropout: eval mode).
Otherwise the submodules run their own forwards and `kernelize.inspect` notes why on the decoder layer.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from kernelize import hub
from kernelize.model_attention import note_fallback


@functools.cache
def _hubs() -> tuple[Any, Any, Any]:
    """The layers modules of the norm, activation and rotary hubs this block's math is made of."""
    from kernelize.layer.hub import get_kernel

    return tuple(
        get_kernel(f"kernelize/{name}", version=1).layers for name in ("layer_norm", "activation", "rotary")
    )


# ---- the math (plain torch; traced into kernels) ---------------------------------------------------------
def _rotate(x, cos, sin, qkv, *, eps, norm, heads, kv_heads, head_dim, neox):
    """(rotated q, rotated k, v) of the merged projection `qkv`, in the attention layout."""
    n_qk = (heads + kv_heads) * head_dim
    rotated = _hubs()[2].rotary_qk_math(
        qkv[..., :n_qk], cos, sin, heads=heads + kv_heads, head_dim=head_dim, neox=neox
    )
    v = qkv[..., n_qk:].view(x.shape[0], x.shape[1], kv_heads, head_dim).transpose(1, 2)
    return rotated[:, :heads], rotated[:, heads:], v


def pre_attention_math(x, cos, sin, norm_weight, qkv_weight, **p):
    """(q, k, v) of `norm(x) @ W_qkv.T` with q and k rotated, each `(batch, heads, seq, head_dim)`."""
    h = _hubs()[0].NORM_MATH[p["norm"]](x, norm_weight, eps=p["eps"])
    return _rotate(x, cos, sin, h @ qkv_weight.t(), **p)


def pre_attention_bias_math(x, cos, sin, norm_weight, qkv_weight, qkv_bias, **p):
    """`pre_attention_math` with a q|k|v bias (Qwen2)."""
    h = _hubs()[0].NORM_MATH[p["norm"]](x, norm_weight, eps=p["eps"])
    return _rotate(x, cos, sin, h @ qkv_weight.t() + qkv_bias, **p)


def post_attention_math(attn, residual, o_weight, norm_weight, *, eps, norm):
    """`(norm(attn @ W_o.T + residual), attn @ W_o.T + residual)`."""
    return _hubs()[0].FUSED_ADD_MATH[norm](attn @ o_weight.t(), residual, norm_weight, eps=eps)


def post_attention_bias_math(attn, residual, o_weight, o_bias, norm_weight, *, eps, norm):
    """`post_attention_math` with an o_proj bias."""
    return _hubs()[0].FUSED_ADD_MATH[norm](attn @ o_weight.t() + o_bias, residual, norm_weight, eps=eps)


def mlp_math(x, residual, gate_up, down, *, act):
    """`act(x @ gate.T) * (x @ up.T) @ W_down.T + residual` (gate|up merged along dim 0)."""
    activation = _hubs()[1]
    return activation.GATE_UP_MATH[activation.GATED_MATH[act]](x, gate_up) @ down.t() + residual


# ---- when the block runs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """What one decoder layer's block reads, worked out once: the kernel parameters of the pre-attention
    graph (norm math, eps, head counts, rotary style), the post-attention norm and eps, the MLP's activation
    and layout."""

    pre: dict[str, Any]
    norm_post: str
    eps_post: float
    act: str
    fused_gate_up: bool  # Phi-3's gate_up_proj (else gate_proj and up_proj, merged on first use)


def _installed(module: nn.Module) -> Any:
    """The function of the forward kernelize installed on `module` (None: its class's own forward)."""
    return getattr(module.__dict__.get("forward"), "__func__", None)


def _plan(layer: nn.Module, attention_layer: type) -> Block | str:
    """The block of `layer`, or why its submodules must run their own forwards."""
    norms, activation, _ = _hubs()
    if _installed(layer.self_attn) is not attention_layer.forward:
        return "self_attn does not run the CausalSelfAttention kernel layer"
    if hasattr(layer.self_attn, "q_norm") or hasattr(layer.self_attn, "k_norm"):
        return "the attention's query/key norms are not in the block's math"
    q_k_v = [getattr(layer.self_attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if len({getattr(p, "bias", None) is None for p in q_k_v if p is not None}) > 1:
        return "some but not all of q_proj, k_proj, v_proj have a bias: they cannot be merged"
    mlp = layer.mlp
    fused = _installed(mlp) is activation.FusedGatedMLP.forward
    if not fused and _installed(mlp) is not activation.GatedMLP.forward:
        return "mlp does not run the GatedMLP / FusedGatedMLP kernel layer"
    act = activation.hidden_act_of(mlp)
    names = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    if act not in activation.GATED_MATH or not activation.bias_free(*(getattr(mlp, n) for n in names)):
        return f"the MLP's activation {act!r} or its projection biases are not in the block's math"
    by_forward = {getattr(norms, name).forward: name for name in norms.NORM_MATH}
    norm_in = by_forward.get(_installed(layer.input_layernorm))
    if norm_in is None:
        return "input_layernorm does not run an RMSNorm kernel layer"
    attn, cfg = layer.self_attn, layer.self_attn.config
    pre = dict(
        eps=norms.eps_of(layer.input_layernorm),
        norm=norm_in,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=attn.head_dim,
        neox=bool(getattr(attn, "is_neox_style", True)),
    )
    post = layer.post_attention_layernorm
    return Block(pre, layer.kernelize_norm_style, norms.eps_of(post), act, fused)


def block_of(layer: nn.Module, x: torch.Tensor, attention_layer: type) -> Block | None:
    """`layer`'s block for this call, or None (its submodules run their own forwards, reason noted)."""
    installed = (_installed(layer.self_attn), _installed(layer.mlp), _installed(layer.input_layernorm))
    cached = layer.__dict__.get("_kernelize_block")
    if cached is None or cached[0] != installed:
        cached = layer.__dict__["_kernelize_block"] = (installed, _plan(layer, attention_layer))
    block = cached[1]
    if not isinstance(block, str):
        block = _hooked(layer) or block
    if isinstance(block, str):
        note_fallback(layer, block, "submodules run their own forwards")
        return None
    if layer.training or (torch.is_grad_enabled() and (x.requires_grad or _any_grad(layer))):
        return None  # training keeps the modules' own forwards (dropout, autograd through each kernel)
    return block


_BYPASSED = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _hooked(layer: nn.Module) -> str | None:
    """Why this call must go through the submodules: the block does not call them, so hooks on them
    (transformers' `output_attentions` capture among them) would not see their calls."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    for name in _BYPASSED:
        sub = getattr(layer, name)
        for hook in (*sub._forward_pre_hooks.values(), *sub._forward_hooks.values()):
            if (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) == _CAPTURE_HOOK:
                if _capturing():
                    return (
                        f"transformers is capturing outputs of `{name}` (output_attentions / hidden states)"
                    )
            else:
                return f"`{name}` has forward hooks"
    return None


# transformers' output recorders: hooks on every attention module, active only while outputs are captured
_CAPTURE_HOOK = ("transformers.utils.output_capturing", "output_capturing_hook")


def _capturing() -> bool:
    recorder = sys.modules.get("transformers.utils.output_capturing")
    return bool(recorder is not None and recorder._active_collector.get())


def _any_grad(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters())


# ---- the forward ------------------------------------------------------------------------------------------
def run_block(
    layer: nn.Module,
    block: Block,
    x: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attend: Any,
    qkv_params: Any,
) -> torch.Tensor:
    """The decoder layer's output for `x`; `attend(q, k, v) -> (batch, seq, heads * head_dim)` updates the
    cache and runs attention, `qkv_params(attn) -> (weight, bias | None)` gives the merged q|k|v."""
    attn, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    cos, sin = position_embeddings
    weight, bias = qkv_params(attn)
    pre_fn, pre_w = (pre_attention_math, []) if bias is None else (pre_attention_bias_math, [bias])
    q, k, v = hub.run(
        attn, pre_fn, [x, cos, sin], [layer.input_layernorm.weight, weight, *pre_w], **block.pre
    )
    out = attend(q, k, v)
    o = attn.o_proj
    post_fn, o_w = (
        (post_attention_math, [o.weight])
        if o.bias is None
        else (post_attention_bias_math, [o.weight, o.bias])
    )
    h, residual = hub.run(
        layer, post_fn, [out, x], [*o_w, post.weight], eps=block.eps_post, norm=block.norm_post
    )
    return hub.run(mlp, mlp_math, [h, residual], [_gate_up(mlp, block), mlp.down_proj.weight], act=block.act)


def _gate_up(mlp: nn.Module, block: Block) -> torch.Tensor:
    if block.fused_gate_up:
        return mlp.gate_up_proj.weight
    from kernelize.merge import merged_parameter

    return merged_parameter(mlp, ("gate_proj", "up_proj"))
