"""ONNX converters for the transformer ops: Attention (opset 23+), RotaryEmbedding, SwiGLU and the losses.

``Attention`` follows the ONNX reference implementation step by step (3-d inputs split into heads, KV
cache concatenation, grouped-query heads repeated, ``sqrt(scale)`` applied to both Q and K, soft-capping,
causal / sliding-window / padding masks built as additive ``0 / -inf`` biases, fully-masked rows zeroed),
but maps it onto plain IR ops: ``matmul``, ``softmax``, ``where`` and layout ops, so that the optimizer
sees ordinary attention.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Node, Op
from kernelize.ir.onnx_context import Converter, NodeContext, to_dtype
from kernelize.ir.shapes import Dim


def _heads(g: Graph, x: Node, heads: int) -> Node:
    """``[B, S, H*D] -> [B, H, S, D]``."""
    b, s, hidden = x.shape
    return g.permute(g.view(x, (b, s, heads, hidden // heads)), (0, 2, 1, 3))


def _additive(g: Graph, mask: Node, dtype: DType) -> Node:
    """A bool mask (True = attend) as a ``0 / -inf`` bias; a float mask cast to ``dtype``."""
    if mask.dtype is DType.BOOL:
        return g.where(mask, g.scalar(0, dtype), g.scalar(-math.inf, dtype))
    return g.cast(mask, dtype)


def _frontier(
    g: Graph,
    sq: int,
    skv: int,
    offset: int | Node,
    dtype: DType,
    left: int = -1,
    right: int = -1,
    causal: bool = True,
) -> Node:
    """Bias allowing key ``j`` for query ``i`` iff ``j <= i + offset`` (causal) and inside the window.

    ``offset`` is a python int, or a ``[B]`` node (per-batch, external cache); the result is ``[sq, skv]``
    or ``[B, 1, sq, skv]``.
    """
    i = torch.arange(sq).reshape(sq, 1)
    j = torch.arange(skv).reshape(1, skv)
    if isinstance(offset, int):
        diff = i + offset - j  # >= 0 where causal allows
        allowed = torch.ones(sq, skv, dtype=torch.bool)
        if causal:
            allowed &= diff >= 0
        if left >= 0:
            allowed &= diff <= left
        if right >= 0:
            allowed &= -diff <= right
        return g.where(g.const(allowed), g.scalar(0, dtype), g.scalar(-math.inf, dtype))
    off = g.view(g.cast(offset, DType.I64), (offset.shape[0], 1, 1, 1))
    diff = g.sub(g.add(g.const(i.reshape(1, 1, sq, 1)), off), g.const(j.reshape(1, 1, 1, skv)))
    allowed = None
    for cond in (
        ([g.ge(diff, 0)] if causal else [])
        + ([g.le(diff, left)] if left >= 0 else [])
        + ([g.le(g.neg(diff), right)] if right >= 0 else [])
    ):
        allowed = cond if allowed is None else g.and_(allowed, cond)
    if allowed is None:
        return g.const(torch.zeros(sq, skv, dtype=dtype.torch))
    return g.where(allowed, g.scalar(0, dtype), g.scalar(-math.inf, dtype))


def _attention(ctx: NodeContext):
    g = ctx.g
    q, k, v = ctx.x(0), ctx.x(1), ctx.x(2)
    mask = ctx.x(3) if ctx.has(3) else None
    past_k, past_v = (ctx.x(i) if ctx.has(i) else None for i in (4, 5))
    nonpad = ctx.x(6) if ctx.has(6) else None
    if (past_k is None) != (past_v is None):
        raise ValueError("past_key and past_value must be given together")
    if not q.dtype.is_float:
        raise ctx.unsupported(f"Attention over {q.dtype}")
    dtype = q.dtype
    rank3 = q.rank == 3
    if rank3:
        qh, kvh = ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
        if not qh or not kvh:
            raise ValueError("3-d Attention inputs need q_num_heads and kv_num_heads")
        q, k, v = _heads(g, q, qh), _heads(g, k, kvh), _heads(g, v, kvh)
    scale = ctx.attr("scale")
    if scale is None:
        scale = 1 / np.sqrt(q.shape[3])
    s = g.scalar(float(np.sqrt(scale)), dtype)
    if past_k is not None:
        k, v = g.concat([past_k, k], 2), g.concat([past_v, v], 2)
    present_k, present_v = k, v
    bias = _bias(ctx, mask, nonpad, past_k, q.shape[2], k.shape[2], dtype)
    heads_q, heads_k = q.shape[1], k.shape[1]
    if heads_q != heads_k and heads_q % heads_k == 0 and v.shape[1] == heads_k:
        k, v = (_repeat_heads(g, t, heads_q // heads_k) for t in (k, v))
    qk = g.matmul(g.mul(q, s), g.mul(g.transpose(k), s))
    softcap = ctx.attr("softcap", 0.0)
    if softcap and softcap > 0:
        qk = g.mul(g.tanh(g.div(qk, softcap)), softcap)
    logits = qk if bias is None else g.add(qk, bias)
    mode = ctx.attr("qk_matmul_output_mode", 0)
    qk_out = logits if mode == 2 else qk
    precision = ctx.attr("softmax_precision")
    if precision is not None:
        logits = g.cast(logits, to_dtype(precision, "softmax_precision"))
    probs = _masked_softmax(g, logits)
    if bias is not None:  # a row whose bias is all -inf attends to nothing: zero it (as the reference)
        dead = g.eq(g.reduce(Op.REDUCE_MAX, bias, -1, keepdim=True), -math.inf)
        probs = g.where(dead, g.scalar(0, probs.dtype), probs)
    if mode == 3:
        qk_out = probs
    y = g.matmul(g.cast(probs, dtype), v)
    if rank3:
        y = g.permute(y, (0, 2, 1, 3))
        y = g.view(y, (y.shape[0], y.shape[1], -1))
    return y, present_k, present_v, g.cast(qk_out, dtype)


def _bias(
    ctx: NodeContext,
    mask: Node | None,
    nonpad: Node | None,
    past_k: Node | None,
    sq: Dim,
    skv: Dim,
    dtype: DType,
) -> Node | None:
    """The additive bias of the logits: the mask, the causal frontier, the window, the padding (None: no
    bias)."""
    g = ctx.g
    left, right = ctx.attr("left_window_size", -1), ctx.attr("right_window_size", -1)
    windowed = left >= 0 or right >= 0
    if mask is not None:
        mask = _additive(g, mask, dtype)
        pad = skv - mask.shape[-1]
        if pad > 0:
            mask = g.pad(mask, [(0, 0)] * (mask.rank - 1) + [(0, pad)], -math.inf)
    if past_k is None and nonpad is not None:
        offset: int | Node = g.sub(nonpad, sq) if nonpad.dtype.is_int else nonpad
    else:
        offset = past_k.shape[2] if past_k is not None else 0
    zeros = g.const(torch.zeros(sq, skv, dtype=dtype.torch))
    bias = None
    if ctx.attr("is_causal", 0):
        base = zeros if mask is None else (g.add(zeros, mask) if windowed else mask)
        bias = g.add(base, _frontier(g, sq, skv, offset, dtype))
    elif mask is not None:
        bias = g.add(zeros, mask)
    if windowed:
        bias = g.add(
            zeros if bias is None else g.add(zeros, bias),
            _frontier(g, sq, skv, offset, dtype, left, right, causal=False),
        )
    if nonpad is not None:
        keep = g.lt(
            g.const(torch.arange(skv).reshape(1, 1, 1, skv)),
            g.view(g.cast(nonpad, DType.I64), (nonpad.shape[0], 1, 1, 1)),
        )
        pad_bias = g.where(keep, g.scalar(0, dtype), g.scalar(-math.inf, dtype))
        bias = pad_bias if bias is None else g.add(bias, pad_bias)
    return bias


def _masked_softmax(g: Graph, x: Node) -> Node:
    """Softmax whose all ``-inf`` rows give zeros instead of NaN (the reference's convention)."""
    p = g.softmax(x, -1)
    all_masked = g.eq(g.reduce(Op.REDUCE_MAX, x, -1, keepdim=True), -math.inf)
    return g.where(all_masked, g.scalar(0, x.dtype), p)


def _repeat_heads(g: Graph, x: Node, reps: int) -> Node:
    """``[B, H, S, D] -> [B, H*reps, S, D]`` with each head repeated in place (h0, h0, h1, h1, ...)."""
    b, h, s, d = x.shape
    return g.view(g.broadcast(g.view(x, (b, h, 1, s, d)), (b, h, reps, s, d)), (b, h * reps, s, d))


def _rotary(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    cos, sin = ctx.x(1), ctx.x(2)
    if ctx.has(3):
        pos = ctx.x(3)
        cos, sin = g.gather(cos, pos, 0), g.gather(sin, pos, 0)
    shape = x.shape
    if x.rank == 4:  # [B, H, S, D] -> [B, S, H, D]
        x = g.permute(x, (0, 2, 1, 3))
    else:
        heads = ctx.attr("num_heads")
        if not heads:
            raise ValueError("3-d RotaryEmbedding input needs num_heads")
        x = g.view(x, (x.shape[0], x.shape[1], heads, x.shape[2] // heads))
    d = x.shape[3]
    rd = ctx.attr("rotary_embedding_dim", 0) or d
    half = rd // 2
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"cos/sin caches must have last dim {half} (rotary_embedding_dim / 2)")
    cos = g.view(cos, (*cos.shape[:-1], 1, half))
    sin = g.view(sin, (*sin.shape[:-1], 1, half))
    rot = g.slice(x, 3, 0, rd)
    if ctx.attr("interleaved", 0):
        x1, x2 = g.slice(rot, 3, 0, rd, 2), g.slice(rot, 3, 1, rd, 2)
    else:
        x1, x2 = g.slice(rot, 3, 0, half), g.slice(rot, 3, half, rd)
    real = g.sub(g.mul(cos, x1), g.mul(sin, x2))
    imag = g.add(g.mul(sin, x1), g.mul(cos, x2))
    if ctx.attr("interleaved", 0):
        pair = g.concat([g.view(real, (*real.shape, 1)), g.view(imag, (*imag.shape, 1))], 4)
        rot = g.view(pair, rot.shape)
    else:
        rot = g.concat([real, imag], 3)
    out = g.concat([rot, g.slice(x, 3, rd)], 3) if rd < d else rot
    return g.permute(out, (0, 2, 1, 3)) if len(shape) == 4 else g.view(out, shape)


def _swiglu(ctx: NodeContext) -> Node:
    g, a, b = ctx.g, ctx.x(0), ctx.x(1)
    if a.shape != b.shape:
        raise ValueError(f"SwiGLU inputs must have equal shapes, got {list(a.shape)} and {list(b.shape)}")
    return g.mul(g.mul(a, g.sigmoid(g.mul(a, ctx.attr("alpha", 1.0)))), b)


# -- losses --------------------------------------------------------------------------------------------------
def _nll(ctx: NodeContext, logp: Node, target: Node, weight: Node | None) -> Node:
    """``-logp[n, target[n, ...], ...] * weight[target]`` reduced as ONNX NegativeLogLikelihoodLoss."""
    g = ctx.g
    c = logp.shape[1]
    if not isinstance(c, int):
        raise ctx.unsupported(f"loss over a symbolic class dimension {c}")
    ignore = ctx.attr("ignore_index")
    reduction = ctx.attr("reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"unknown reduction {reduction!r}")
    t = g.cast(target, DType.I64)
    ones = [1] * (t.rank - 1)
    hot = g.eq(g.view(t, (t.shape[0], 1, *t.shape[1:])), g.const(torch.arange(c).reshape(1, c, *ones)))
    zero = g.scalar(0, logp.dtype)
    picked = g.reduce(Op.SUM, g.where(hot, logp, zero), 1)  # logp[n, t[n, ...], ...]
    if weight is not None:
        w = g.reduce(Op.SUM, g.where(hot, g.view(weight, (1, c, *ones)), zero), 1)  # weight[t[n, ...]]
    else:
        w = g.broadcast(g.scalar(1, logp.dtype), t.shape)
    if ignore is not None:
        w = g.where(g.eq(t, ignore), zero, w)
    loss = g.neg(g.mul(picked, w))
    if reduction == "none":
        return loss
    total = g.reduce(Op.SUM, loss)
    return total if reduction == "sum" else g.div(total, g.reduce(Op.SUM, w))


def _nll_loss(ctx: NodeContext) -> Node:
    return _nll(ctx, ctx.x(0), ctx.x(1), ctx.x(2) if ctx.has(2) else None)


def _softmax_ce(ctx: NodeContext):
    g, x = ctx.g, ctx.x(0)
    logp = g.log_softmax(x, 1)
    loss = _nll(ctx, logp, ctx.x(1), ctx.x(2) if ctx.has(2) else None)
    return (loss, logp) if ctx.wants_output(1) else loss


ATTENTION_OPS: dict[str, Converter] = {
    "Attention": _attention,
    "RotaryEmbedding": _rotary,
    "SwiGLU": _swiglu,
    "NegativeLogLikelihoodLoss": _nll_loss,
    "SoftmaxCrossEntropyLoss": _softmax_ce,
}

__all__ = ["ATTENTION_OPS"]
