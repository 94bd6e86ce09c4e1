"""A decoder layer's inference forward as three generated-kernel graphs around the attention kernel.

Run module by module, one decoder layer makes seven or more calls into compiled graphs per step (norms, q|k|v
matmul, rotary, o_proj, residual add + norm, gate|up matmul, down matmul) plus torch's residual adds, each
with ~20 us of Python around its kernel; at one token per step that is a sizeable share of a small model's
step beside the weight reads. `run_block` makes three, and the attention kernel between them.

A layer's norms sit at up to four places (`NORM_SLOTS`): before attention (`input`), on the attention's
output before the residual add (`post_attn`), before the MLP (`pre_ff`) and on the MLP's output before the
second residual add (`post_ff`). Llama has `input` and `pre_ff` (its `post_attention_layernorm` normalises
the MLP's input), Gemma 2 / 3 all four, OLMo2 `post_attn` and `post_ff`. The layer's `kernelize_norms`
(slot -> submodule name, set by `kernelize_model` from the forward's data flow) says which; each graph
takes the norms of its slots:

1. `pre_attention_math`: [input norm] -> merged q|k|v matmul (+ bias) -> [q/k norms] -> rotary; q, k and v
   come out in the `(batch, heads, seq, head_dim)` layout the cache and the attention kernel read;
2. transformers' `cache.update(...)` and the attention kernel, exactly as `CausalSelfAttention` calls them
   (so every cache class and every per-call attention fallback keeps working);
3. `post_attention_math`: o_proj (+ bias) -> [post-attention norm] -> + residual -> [pre-MLP norm]:
   `(normed, residual)`;
4. `mlp_math`: `act(x @ gate.T) * (x @ up.T)` over the merged gate|up weight -> down_proj -> [post-MLP
   norm] -> + residual.

With packed projections (`kernelize_model(quantize=...)`: `QuantizedLinear`) the matmuls are packed calls
instead (`_run_packed`): [input norm] graph, one packed q|k|v call over the merged bytes, the rotary graph
(`rotate_math`, with the query / key norms when the attention has them), attention, the packed o_proj, the
residual/norm graph (`residual_norm_math`), one packed gate|up call with `act(gate) * up` in its epilogue,
the packed down_proj, and `[norm] + residual`; an MoE block (its experts packed or not) runs its own forward
in place of the gate|up and down calls.

The block runs when the layer's attention runs this hub's `CausalSelfAttention` (query / key norms, if
any, per head, in graph 1 before the rotary: Qwen3, Gemma 3), each of its norms is an RMSNorm or a
LayerNorm kernel layer of the `kernelize/layer_norm` hub (a style and its parameters: `norm_style`,
`norm_params`), and nothing needs gradients (nor dropout: eval mode). Graph 4 is the MLP when it is
the activation hub's `GatedMLP` / `FusedGatedMLP` with bias-free projections and a gated activation the
table knows; any other MLP (an MoE block with its router and experts kernels, biased
projections) runs its own forward between graph 3 and the `[norm] + residual` graph (`Block.own_mlp` says
why): an MoE layer then makes two graph calls around its attention where it made seven (Qwen3-MoE layout,
f32 decode, 2 threads: 14.3 -> 13.0 ms per token). Under tensor parallelism (the Megatron split of
`kernelize.shards`) the graphs read the local weight shards and local heads, and the o_proj and down_proj
products are all-reduced before their residual adds: graph 3 becomes the o_proj matmul, the all-reduce and the
residual add + norm; graph 4 the MLP's partial sum, the all-reduce and the residual add. Otherwise the
submodules run their own forwards and `kernelize.inspect` notes why on the decoder layer.
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
from kernelize.shards import Shards, heads_of, local, shards_of


@functools.cache
def _hubs() -> tuple[Any, Any, Any]:
    """The layers modules of the norm, activation and rotary hubs this block's math is made of."""
    from kernelize.layer.hub import get_kernel

    return tuple(
        get_kernel(f"kernelize/{name}", version=1).layers for name in ("layer_norm", "activation", "rotary")
    )


# ---- the math (plain torch; traced into kernels) ---------------------------------------------------------
def _rotate(x, cos, sin, qkv, *qk_weights, heads, kv_heads, head_dim, neox, qk_norm=None, qk_eps=0.0):
    """(rotated q, rotated k, v) of the merged projection `qkv`, in the attention layout; with `qk_norm`,
    each query and key head normed first (`qk_weights`: the q_norm's and k_norm's `head_dim` weights)."""
    n_qk = (heads + kv_heads) * head_dim
    qk = qkv[..., :n_qk]
    if qk_norm is not None:
        heads_of_qk = qk.unflatten(-1, (heads + kv_heads, head_dim))
        math = _hubs()[0].NORM_MATH[qk_norm]
        q = math(heads_of_qk[..., :heads, :], qk_weights[0], eps=qk_eps)
        k = math(heads_of_qk[..., heads:, :], qk_weights[1], eps=qk_eps)
        qk = torch.cat((q, k), dim=-2).flatten(-2)
    rotated = _hubs()[2].rotary_qk_math(qk, cos, sin, heads=heads + kv_heads, head_dim=head_dim, neox=neox)
    v = qkv[..., n_qk:].view(x.shape[0], x.shape[1], kv_heads, head_dim).transpose(1, 2)
    return rotated[:, :heads], rotated[:, heads:], v


def _normed(h, weights, style, eps):
    """`style`'s norm of `h` with its parameters from the iterator `weights` (`h` itself when the slot has
    no norm; styles: the layer_norm hub's `norm_style`)."""
    return h if style is None else _hubs()[0].styled_norm(h, weights, style, eps)


def pre_attention_math(x, cos, sin, *weights, norm, eps, bias=False, **p):
    """(q, k, v) of `[norm](x) @ W_qkv.T (+ b)` with q and k [normed per head and] rotated, each `(batch,
    heads, seq, head_dim)`; `weights`: the norm's weight (when `norm` is not None), W_qkv, the bias (when
    `bias`), the query and key norms' weights (when `p["qk_norm"]`)."""
    w = iter(weights)
    qkv = _normed(x, w, norm, eps) @ next(w).t()
    return _rotate(x, cos, sin, qkv + next(w) if bias else qkv, *w, **p)


def post_attention_math(
    attn, residual, o_weight, *weights, bias=False, norm_post=None, eps_post=0.0, norm, eps
):
    """`(norm(h), h)` for `h = [post_norm](attn @ W_o.T (+ b)) + residual`; only `h` when `norm` is None.
    `weights`: the o_proj bias (when `bias`), the post-attention norm's weight, the pre-MLP norm's."""
    w = iter(weights)
    o = attn @ o_weight.t() + next(w) if bias else attn @ o_weight.t()
    return residual_norm_math(o, residual, *w, norm_post=norm_post, eps_post=eps_post, norm=norm, eps=eps)


def residual_norm_math(o, residual, *weights, norm_post=None, eps_post=0.0, norm, eps):
    """`post_attention_math` after the o_proj product `o` (tensor parallelism: after its all-reduce)."""
    w = iter(weights)
    o = _normed(o, w, norm_post, eps_post)
    if norm is None:
        return o + residual
    return _hubs()[0].fused_add_norm_math(o, residual, *w, style=norm, eps=eps)


def mlp_partial_math(x, gate_up, down, *, act):
    """`act(x @ gate.T) * (x @ up.T) @ W_down.T` (gate|up merged along dim 0); under tensor parallelism,
    this rank's partial sum of the MLP's output."""
    activation = _hubs()[1]
    return activation.GATE_UP_MATH[activation.GATED_MATH[act]](x, gate_up) @ down.t()


def mlp_math(x, residual, gate_up, down, *weights, act, norm=None, eps=0.0):
    """`[norm](act(x @ gate.T) * (x @ up.T) @ W_down.T) + residual`."""
    return after_mlp_math(mlp_partial_math(x, gate_up, down, act=act), residual, *weights, norm=norm, eps=eps)


def after_mlp_math(y, residual, *weights, norm=None, eps=0.0):
    """`[norm](y) + residual` for the MLP's output `y`."""
    return _normed(y, iter(weights), norm, eps) + residual


def norm_math(x, *params, norm, eps):
    """`norm(x)`: the packed block's input norm (its q|k|v matmul is a packed call)."""
    return _hubs()[0].styled_norm(x, iter(params), norm, eps)


def rotate_math(qkv, cos, sin, *qk_weights, **p):
    """(q, k, v) of the merged projection `qkv` (a packed call's output), q and k [normed per head and]
    rotated (`p`: `_rotate`'s parameters)."""
    return _rotate(qkv, cos, sin, qkv, *qk_weights, **p)


def rotate_params(attn: nn.Module, pre: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """`rotate_math`'s weights (the query and key norms', when the block has them) and parameters."""
    names = ("heads", "kv_heads", "head_dim", "neox", "qk_norm", "qk_eps")
    weights = [attn.q_norm.weight, attn.k_norm.weight] if pre.get("qk_norm") else []
    return weights, {name: pre[name] for name in names if name in pre}


def matmul_math(x, weight):
    return x @ weight.t()


# How a model's `apply_rotary_pos_emb` reads the cos/sin tables its rotary embedding makes, as the tables the
# rotary kernel reads (one angle per rotated dim: the neox halves or the interleaved pairs)
ROTARY_TABLES = {
    "same": lambda t: t,
    "half tables": lambda t: torch.cat((t, t), dim=-1),  # gpt-oss: each angle once, for both halves
    "pairs from the first half": lambda t: t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1),  # GLM
}


def rotary_tables(attn: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary kernel's cos/sin tables from the model's (`attn.rotary_tables`, set by the one call)."""
    tables = ROTARY_TABLES[getattr(attn, "rotary_tables", "same")]
    return tables(cos), tables(sin)


# ---- when the block runs ----------------------------------------------------------------------------------
NORM_SLOTS = ("input", "post_attn", "pre_ff", "post_ff")  # where a decoder layer's norms may sit, in order


@dataclass(frozen=True)
class Block:
    """What one decoder layer's block reads, worked out once: the kernel parameters of each graph (norm
    math and eps per slot, head counts, rotary style, the MLP's activation), its norms (slot -> submodule
    name) and the MLP's layout."""

    pre: dict[str, Any]
    post: dict[str, Any]
    mlp: dict[str, Any]
    norms: dict[str, str]
    fused_gate_up: bool  # Phi-3's gate_up_proj (else gate_proj and up_proj, merged on first use)
    attn_shards: Shards | None = None  # tensor parallelism: the attention's and the MLP's (None: whole)
    mlp_shards: Shards | None = None
    packed: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # packed: the q|k|v and gate|up names
    own_mlp: str | None = None  # why the MLP runs its own forward between the graphs (None: `mlp_math`)


def _installed(module: nn.Module) -> Any:
    """The function of the forward kernelize installed on `module` (None: its class's own forward)."""
    return getattr(module.__dict__.get("forward"), "__func__", None)


def norms_of(layer: nn.Module) -> dict[str, str]:
    """slot -> submodule name of the layer's norms (`kernelize_norms`; a pre-norm layer without it)."""
    default = {"input": "input_layernorm", "pre_ff": "post_attention_layernorm"}
    return getattr(layer, "kernelize_norms", None) or default


def norm_style_of(module: nn.Module) -> str | None:
    """The style of the norm kernel layer installed on `module` (the layer_norm hub's `norm_style`: an
    RMSNorm's or a one-axis LayerNorm's), or None when it runs neither."""
    norms = _hubs()[0]
    by_forward = {getattr(norms, name).forward: name for name in norms.NORM_MATH}
    by_forward[norms.LayerNorm.forward] = "LayerNorm"
    return norms.norm_style(by_forward.get(_installed(module), ""), module)


def _plan(layer: nn.Module, attention_layer: type) -> Block | str:
    """The block of `layer`, or why its submodules must run their own forwards."""
    norms, activation, _ = _hubs()
    if _installed(layer.self_attn) is not attention_layer.forward:
        return "self_attn does not run the CausalSelfAttention kernel layer"
    packed = _packed_names(layer)
    if isinstance(packed, str):
        return packed
    by_forward = {getattr(norms, name).forward: name for name in norms.NORM_MATH}
    qk_norm = _qk_norm(layer.self_attn, by_forward)
    if isinstance(qk_norm, str):
        return qk_norm
    q_k_v = [getattr(layer.self_attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if len({getattr(p, "bias", None) is None for p in q_k_v if p is not None}) > 1:
        return "some but not all of q_proj, k_proj, v_proj have a bias: they cannot be merged"
    mlp = layer.mlp
    fused = _installed(mlp) is activation.FusedGatedMLP.forward
    own_mlp = _own_mlp(mlp, fused, activation, packed is not None)
    if packed is not None and bool(own_mlp) != (packed[1] is None):
        return f"packed projections, and {own_mlp or 'an MLP whose projections are not packed'}"
    act = None if own_mlp else activation.hidden_act_of(mlp)
    slots = norms_of(layer)
    style, eps = dict.fromkeys(NORM_SLOTS), dict.fromkeys(NORM_SLOTS, 0.0)
    for slot, name in slots.items():
        style[slot] = norm_style_of(getattr(layer, name))
        if style[slot] is None:
            return f"{name} does not run an RMSNorm or LayerNorm (one axis) kernel layer"
        eps[slot] = norms.eps_of(getattr(layer, name))
    attn = layer.self_attn
    shards = (shards_of(attn), None if own_mlp else shards_of(mlp))  # its own forward: its own collectives
    if why := next((s for s in shards if isinstance(s, str)), None):
        return why
    heads, kv_heads = heads_of(attn, shards[0])
    pre = dict(
        norm=style["input"],
        eps=eps["input"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=attn.head_dim,
        neox=bool(getattr(attn, "is_neox_style", True)),
        **qk_norm,
    )
    post = dict(
        norm_post=style["post_attn"], eps_post=eps["post_attn"], norm=style["pre_ff"], eps=eps["pre_ff"]
    )
    mlp_kw = dict(act=act, norm=style["post_ff"], eps=eps["post_ff"])
    return Block(pre, post, mlp_kw, dict(slots), fused, *shards, packed=packed, own_mlp=own_mlp)


def _own_mlp(mlp: nn.Module, fused: bool, activation: Any, packed: bool) -> str | None:
    """Why the block calls `mlp`'s own forward between its graphs (an MoE block, a non-gated MLP, biased
    projections, an activation the table lacks), or None when the MLP's math is the block's graph."""
    if not fused and _installed(mlp) is not activation.GatedMLP.forward:
        return "mlp is not a GatedMLP / FusedGatedMLP kernel layer"
    act = activation.hidden_act_of(mlp)
    names = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    if not packed and not activation.bias_free(*(getattr(mlp, n) for n in names)):
        return "mlp's projections have biases"
    if act not in activation.GATED_MATH:
        return f"mlp's activation {act!r} is not in the block's math"
    return None


def _qk_norm(attn: nn.Module, by_forward: dict) -> dict | str:
    """The block's query/key norm parameters: `{}` without them; `qk_norm` (style) and `qk_eps` for a
    q_norm and a k_norm per head (Qwen3, Gemma 3: `head_dim` weights, one RMSNorm kernel style and eps);
    why not, else (over the whole projection as OLMo2's, only one of them)."""
    found = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    if all(n is None for n in found):
        return {}
    if any(n is None for n in found):
        return "the attention's query/key norms are not in the block's math (only one of them)"
    norms = _hubs()[0]
    styles = {by_forward.get(_installed(n)) for n in found}
    eps = {norms.eps_of(n) for n in found}
    shapes = {tuple(getattr(n, "weight", torch.empty(0)).shape) for n in found}
    one_rms_style = len(styles) == 1 and styles <= set(norms.NORM_MATH)
    if not one_rms_style or len(eps) != 1 or shapes != {(attn.head_dim,)}:
        return "the attention's query/key norms are not per-head RMSNorm kernel layers of one style and eps"
    return {"qk_norm": styles.pop(), "qk_eps": eps.pop()}


def _packed_names(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...] | None] | str | None:
    """The merged projections' names ((q|k|v), (gate|up)) when the layer's projections are packed
    (`QuantizedLinear`), None when none is, or why the packed block cannot run them. (gate|up) is None for
    an MLP with no packed projection of its own (an MoE block: its experts, packed or not, run in its
    forward)."""
    from kernelize.quant.fused import is_packed, merged_packed

    attn, mlp = layer.self_attn, layer.mlp
    children = [c for s in (attn, mlp) for c in s.children()]
    if not is_packed(*children):
        return None
    mixed = "packed and float projections mixed, or packed ones in formats that do not merge"
    qkv = ("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    if not (merged_packed(attn, qkv) and is_packed(attn.o_proj)):
        return mixed
    if not is_packed(*mlp.children()):
        return qkv, None
    gate_up = ("gate_up_proj",) if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj")
    if not (merged_packed(mlp, gate_up) and is_packed(getattr(mlp, "down_proj", None))):
        return mixed
    return qkv, gate_up


def block_of(layer: nn.Module, x: torch.Tensor, attention_layer: type) -> Block | None:
    """`layer`'s block for this call, or None (its submodules run their own forwards, reason noted)."""
    subs = ("self_attn", "mlp", *norms_of(layer).values())
    return planned(layer, x, subs, lambda layer: _plan(layer, attention_layer))


def planned(layer: nn.Module, x: torch.Tensor, subs: tuple[str, ...], plan: Any) -> Any:
    """The block `plan(layer)` makes (or why not: a string) for this call, or None (the submodules run their
    own forwards, the reason noted): made once while the forwards installed on the submodules `subs` stay
    the same, and only in inference with nothing hooked on those submodules."""
    installed = tuple(_installed(getattr(layer, name)) for name in subs)
    cached = layer.__dict__.get("_kernelize_block")
    if cached is None or cached[0] != installed:
        cached = layer.__dict__["_kernelize_block"] = (installed, plan(layer))
        own_mlp = getattr(cached[1], "own_mlp", None)
        if own_mlp:
            note_fallback(layer, own_mlp, "the block runs the MLP's own forward")
    block = cached[1]
    if not isinstance(block, str):
        block = _hooked(layer, subs) or block
    if isinstance(block, str):
        note_fallback(layer, block, "submodules run their own forwards")
        return None
    if layer.training or (torch.is_grad_enabled() and (x.requires_grad or _any_grad(layer))):
        return None  # training keeps the modules' own forwards (dropout, autograd through each kernel)
    return block


def _hooked(layer: nn.Module, names: tuple[str, ...]) -> str | None:
    """Why this call must go through the submodules `names`: the block does not call them, so hooks on them
    (transformers' `output_attentions` capture among them) would not see their calls."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    for name in names:  # the submodules the block bypasses
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
    if block.packed is not None:
        return _run_packed(layer, block, x, position_embeddings, attend)
    attn, mlp = layer.self_attn, layer.mlp
    weight_of = _norm_params(layer, block)
    cos, sin = rotary_tables(attn, *position_embeddings)
    pre_w, bias = pre_weights(layer, block, weight_of, qkv_params)
    q, k, v = hub.run(attn, pre_attention_math, [x, cos, sin], pre_w, bias=bias, **block.pre)
    out = attend(q, k, v)
    o = attn.o_proj
    if block.attn_shards is None:
        post_w, bias = post_weights(layer, weight_of)
        h = hub.run(layer, post_attention_math, [out, x], post_w, bias=bias, **block.post)
    else:  # the all-reduce of the o_proj product comes between it and the residual add
        o_out = row_parallel(attn, block.attn_shards, out, o)
        h = hub.run(
            layer, residual_norm_math, [o_out, x], _weights(weight_of, "post_attn", "pre_ff"), **block.post
        )
    h, residual = (h, h) if block.post["norm"] is None else h
    if block.own_mlp:
        return own_mlp(layer, block, h, residual, weight_of)
    post_ff = _weights(weight_of, "post_ff")
    if block.mlp_shards is None:
        mlp_w = [_gate_up(mlp, block), mlp.down_proj.weight, *post_ff]
        return hub.run(mlp, mlp_math, [h, residual], mlp_w, **block.mlp)
    act = block.mlp["act"]
    y = hub.run(mlp, mlp_partial_math, [h], [_gate_up(mlp, block), local(mlp.down_proj.weight)], act=act)
    return _after_mlp(mlp, block, block.mlp_shards.reduce(y), residual, post_ff)


def pre_weights(layer: nn.Module, block: Block, weight_of: dict, qkv_params: Any) -> tuple[list, bool]:
    """`pre_attention_math`'s weights (the input norm's, the merged q|k|v, its bias, the q / k norms') and
    whether a bias is among them."""
    attn = layer.self_attn
    weight, bias = qkv_params(attn)
    qk_w = [attn.q_norm.weight, attn.k_norm.weight] if block.pre.get("qk_norm") else []
    return [*_weights(weight_of, "input"), weight, *([] if bias is None else [bias]), *qk_w], bias is not None


def post_weights(layer: nn.Module, weight_of: dict) -> tuple[list, bool]:
    """`post_attention_math`'s weights (o_proj's, its bias, the post-attention and pre-MLP norms') and
    whether a bias is among them."""
    o = layer.self_attn.o_proj
    return [o.weight, *([] if o.bias is None else [o.bias]), *_weights(weight_of, "post_attn", "pre_ff")], (
        o.bias is not None
    )


def own_mlp(layer: nn.Module, block: Block, h: torch.Tensor, residual: torch.Tensor, weight_of=None):
    """The MLP's own forward on `h` (an MoE block may return (output, router scores), as gpt-oss's does),
    then `[post-MLP norm] + residual`; `weight_of`: the norms' parameters (made here when None)."""
    y = layer.mlp(h)
    y = y[0] if isinstance(y, tuple) else y
    post_ff = (
        [] if block.mlp["norm"] is None else _weights(weight_of or _norm_params(layer, block), "post_ff")
    )
    return _after_mlp(layer.mlp, block, y, residual, post_ff)


def _after_mlp(mlp: nn.Module, block: Block, y: torch.Tensor, residual: torch.Tensor, post_ff: list):
    """`[post-MLP norm](y) + residual` for the MLP's output `y`."""
    if block.mlp["norm"] is None:
        return y + residual
    tail = {"norm": block.mlp["norm"], "eps": block.mlp["eps"]}
    return hub.run(mlp, after_mlp_math, [y, residual], post_ff, **tail)


def row_parallel(owner: nn.Module, shards: Shards, x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """A row-parallel `proj(x)` on this rank's shards: the local product (one generated matmul kernel), the
    all-reduce of the ranks' partial sums (as the linear's own hook does), then the replicated bias."""
    y = shards.reduce(hub.run(owner, matmul_math, [x], [local(proj.weight)]))
    return y if proj.bias is None else y + local(proj.bias)


def _weights(weight_of: dict[str, list[torch.Tensor]], *slots: str) -> list[torch.Tensor]:
    """The norm parameters of those of `slots` the layer has, in order (the graphs take them so)."""
    return [p for slot in slots if slot in weight_of for p in weight_of[slot]]


def _norm_params(layer: nn.Module, block: Block) -> dict[str, list[torch.Tensor]]:
    """slot -> the parameters its norm's style reads (an RMSNorm's weight; a LayerNorm's weight and bias)."""
    styles = {"input": block.pre["norm"], "post_attn": block.post["norm_post"], "pre_ff": block.post["norm"]}
    styles["post_ff"] = block.mlp["norm"]
    norms = _hubs()[0]
    return {slot: norms.norm_params(styles[slot], getattr(layer, name)) for slot, name in block.norms.items()}


def _gate_up(mlp: nn.Module, block: Block) -> torch.Tensor:
    if block.fused_gate_up:
        return mlp.gate_up_proj.weight
    from kernelize.merge import merged_parameter

    return merged_parameter(mlp, ("gate_proj", "up_proj"))


def _run_packed(
    layer: nn.Module, block: Block, x: torch.Tensor, position_embeddings: Any, attend: Any
) -> torch.Tensor:
    """`run_block` with packed projections: [norm] -> one packed q|k|v call -> rotary -> attention -> packed
    o_proj -> residual and norms -> one packed gate|up call (`act(gate) * up` in its epilogue) -> packed
    down_proj -> [norm] + residual; the submodules' forwards are not called (no module dispatch per step),
    but an MoE block's (`own_mlp`)."""
    from kernelize.quant.fused import glu, merged_packed
    from kernelize.quant.ops import linear

    attn, mlp = layer.self_attn, layer.mlp
    weight_of = _norm_params(layer, block)
    pre, (qkv_names, gate_up_names) = block.pre, block.packed
    calls = _packed_calls(layer, block)
    h = x
    if pre["norm"] is not None:
        h = hub.run(layer, norm_math, [x], weight_of["input"], norm=pre["norm"], eps=pre["eps"])
    qkv = _project(calls[0], h, lambda h: linear(h, *merged_packed(attn, qkv_names)))
    qk_w, rotary = rotate_params(attn, pre)
    q, k, v = hub.run(attn, rotate_math, [qkv, *rotary_tables(attn, *position_embeddings)], qk_w, **rotary)
    o = _project(calls[1], attend(q, k, v), attn.o_proj)
    h = hub.run(layer, residual_norm_math, [o, x], _weights(weight_of, "post_attn", "pre_ff"), **block.post)
    h, residual = (h, h) if block.post["norm"] is None else h
    if block.own_mlp:
        return own_mlp(layer, block, h, residual, weight_of)
    act = block.mlp["act"]
    y = _project(calls[2], h, lambda h: glu(h, *_swap(merged_packed(mlp, gate_up_names), act)))
    y = _project(calls[3], y, mlp.down_proj)
    return _after_mlp(mlp, block, y, residual, _weights(weight_of, "post_ff"))


def _swap(merged: tuple, act: str) -> tuple:
    """`glu`'s arguments (packed, act, bias) from `merged_packed`'s (packed, bias)."""
    return merged[0], act, merged[1]


def _project(call: Any, x: torch.Tensor, fallback: Any) -> torch.Tensor:
    """`call(x)` (a resolved few-row kernel call), or `fallback(x)` for what it does not take."""
    y = None if call is None else call(x)
    return fallback(x) if y is None else y


def _packed_calls(layer: nn.Module, block: Block) -> tuple[Any, ...]:
    """The layer's four packed products (q|k|v, o_proj, gate|up with its activation, down_proj; the first two
    around an MLP of its own) as resolved few-row kernel calls (`kernelize.quant.ops.FewRows`; None where a
    bias is not the kernel's f32), made once and kept while the merged weights and biases are the same
    objects (a replaced buffer re-merges them, so the calls are made again)."""
    from kernelize.quant.fused import merged_packed
    from kernelize.quant.ops import FewRows

    attn, mlp = layer.self_attn, layer.mlp
    o = attn.o_proj
    parts = (*merged_packed(attn, block.packed[0]), o.packed, o.bias)
    if block.packed[1] is not None:
        parts += (*merged_packed(mlp, block.packed[1]), mlp.down_proj.packed, mlp.down_proj.bias)
    held = layer.__dict__.get("_kernelize_packed_calls")
    if held is not None and all(a is b for a, b in zip(held[0], parts)):
        return held[1]
    acts = (None, None, block.mlp["act"], None)
    pairs = zip(parts[::2], parts[1::2], acts)
    calls = tuple(FewRows(p, b, act) if FewRows.takes(p, b) else None for p, b, act in pairs)
    layer.__dict__["_kernelize_packed_calls"] = (parts, calls)
    return calls
