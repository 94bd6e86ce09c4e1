"""Affine fusion: chains of constant scales and biases collapse into one ``x * s + b``, which then folds
into a neighbouring matmul/conv weight.

Rules (``c``, ``s``, ``b`` are constants of any broadcastable shape; floats only):

- ``(x * s1) * s2 -> x * (s1*s2)`` and ``(x + b1) + b2 -> x + (b1+b2)``; ``x - c -> x + (-c)``
- ``(x + b) * s -> x * s + b*s`` (the add must have no other user), so batch norm's
  ``(x - mean) * rstd * w + b`` becomes ``x * s + b'``
- ``matmul(a, W) * s -> matmul(a, W*s)`` for ``s`` along the output features; ``conv(x, W) * s ->
  conv(x, W*s)`` for ``s`` per output channel (conv + batch norm)
- ``matmul(a * s, W) -> matmul(a, s[:, None]*W)`` and ``matmul(a + b, W) -> matmul(a, W) + b@W`` for
  ``s``/``b`` along the input features; ``conv(x * s, W) -> conv(x, W*s)`` for ``s`` per input channel

A matmul/conv or an intermediate is only changed when nothing else reads it, so no work is duplicated.

Example:
    before                                       after
    %3 = conv(%0, %1) : f32[1, 8, 6, 6]          %3 = conv(%0, %9) : f32[1, 8, 6, 6]   (%9 = W * s)
    %5 = mul(%3, %4) : f32[1, 8, 6, 6]           %7 = add(%3, %6) : f32[1, 8, 6, 6]
    %7 = add(%5, %6) : f32[1, 8, 6, 6]
"""

from __future__ import annotations

import torch

from kernelize.ir.graph import Graph, Node, Op
from kernelize.passes.rewrite import Const, Context, P, Rule, Var, const_value, is_const, rewrite, unbroadcast


def _float(*nodes: Node) -> bool:
    return all(n.dtype.is_float for n in nodes)


def _const(ctx: Context, like: Node, value: torch.Tensor) -> Node:
    """A constant node holding ``value`` (computed in f64) in ``like``'s dtype."""
    return ctx.g.const(value.to(like.dtype.torch))


def _f64(node: Node) -> torch.Tensor | None:
    v = const_value(node)
    return None if v is None else v.to(torch.float64)


def _mul_mul(ctx: Context, x: Node, c1: Node, c2: Node) -> Node | None:
    a, b = _f64(c1), _f64(c2)
    if a is None or b is None or not _float(x) or is_const(x):
        return None
    return ctx.g.mul(x, _const(ctx, x, a * b))


def _add_add(ctx: Context, x: Node, c1: Node, c2: Node) -> Node | None:
    a, b = _f64(c1), _f64(c2)
    if a is None or b is None or not _float(x) or is_const(x):
        return None
    return ctx.g.add(x, _const(ctx, x, a + b))


def _sub_const(ctx: Context, x: Node, c: Node) -> Node | None:
    v = _f64(c)
    if v is None or not _float(x) or is_const(x):
        return None
    return ctx.g.add(x, _const(ctx, x, -v))


def _distribute(ctx: Context, inner: Node, x: Node, b: Node, s: Node) -> Node | None:
    bv, sv = _f64(b), _f64(s)
    if bv is None or sv is None or not _float(x) or ctx.uses(inner) > 1 or is_const(x):
        return None
    return ctx.g.add(ctx.apply(ctx.g.mul(x, _const(ctx, x, sv))), _const(ctx, x, bv * sv))


def _along(value: torch.Tensor, rank: int, axis: int) -> torch.Tensor | None:
    """``value`` (broadcastable to rank ``rank``) as a vector along ``axis``; None if it varies elsewhere."""
    v = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
    if any(v.shape[i] != 1 for i in range(rank) if i != axis):
        return None
    return v.reshape(-1)


def _weight(node: Node) -> torch.Tensor | None:
    """A 2-d matmul weight's constant value, seen through the builder's batch broadcast."""
    v = const_value(unbroadcast(node))
    if v is None or v.dim() < 2 or any(d != 1 for d in v.shape[:-2]):
        return None
    return v.reshape(v.shape[-2:]).to(torch.float64)


def _through_views(ctx: Context, node: Node) -> tuple[Node, list[Node]] | None:
    """Peel single-use views that keep the last axis (``[b, s, k] <-> [b*s, k]``): (inner node, views)."""
    views = []
    while node.op is Op.VIEW and node.rank and node.src[0].rank and node.shape[-1] == node.src[0].shape[-1]:
        if ctx.uses(node) > 1:
            return None
        views.append(node)
        node = node.src[0]
    return node, views


def _split_const(node: Node) -> tuple[Node, Node] | None:
    """(x, c) for a binary node with one constant operand."""
    a, b = node.src
    if is_const(b) and not is_const(a):
        return a, b
    if is_const(a) and not is_const(b):
        return b, a
    return None


def _matmul_scale(ctx: Context, y: Node, s: Node) -> Node | None:
    """matmul(a, W) * s, s along the output features (through views keeping them) -> matmul(a, W * s)."""
    peeled = _through_views(ctx, y)
    sv = _f64(s)
    if peeled is None or sv is None or not _float(y):
        return None
    mm, _ = peeled
    if mm.op is not Op.MATMUL or ctx.uses(mm) > 1:
        return None
    wv = _weight(mm.src[1])
    col = _along(sv, y.rank, y.rank - 1)
    if wv is None or col is None or col.numel() not in (1, wv.shape[1]):
        return None
    return ctx.g.view(ctx.g.matmul(mm.src[0], _const(ctx, mm, wv * col)), y.shape)


def _pre_matmul(ctx: Context, mm: Node, a: Node, w: Node) -> Node | None:
    """matmul(x * s, W) -> matmul(x, s[:, None] * W); matmul(x + b, W) -> matmul(x, W) + b @ W.

    ``s``/``b`` run along x's last axis (the contraction); views keeping that axis may sit in between.
    """
    peeled = _through_views(ctx, a)
    if peeled is None or not _float(mm):
        return None
    m, views = peeled
    split = _split_const(m) if m.op in (Op.MUL, Op.ADD) and ctx.uses(m) <= 1 else None
    # the weight in f64 only once the pattern is there: every matmul is tried, and the copy costs ~5 ms/MB
    wv = _weight(w) if split is not None else None
    if split is None or wv is None:
        return None
    x, c = split
    row = _along(_f64(c), m.rank, m.rank - 1)
    if row is None or row.numel() not in (1, wv.shape[0]):
        return None
    for v in reversed(views):
        x = ctx.g.view(x, v.shape)
    if m.op is Op.MUL:
        return ctx.g.matmul(x, _const(ctx, mm, row.reshape(-1, 1) * wv))
    bias = row.expand(wv.shape[0]) @ wv
    return ctx.g.add(ctx.g.matmul(x, unbroadcast(w)), _const(ctx, mm, bias))


def _conv_like(ctx: Context, conv: Node, x: Node, w: Node) -> Node:
    a = conv.arg
    return ctx.g.conv(x, w, stride=a.stride, padding=a.padding, dilation=a.dilation, groups=a.groups)


def _conv_scale(ctx: Context, conv: Node, x: Node, w: Node, s: Node) -> Node | None:
    """conv(x, W) * s, s per output channel -> conv(x, W * s)."""
    sv, wv = _f64(s), _f64(w)
    if sv is None or wv is None or ctx.uses(conv) > 1 or not _float(conv):
        return None
    ch = _along(sv, 4, 1)
    if ch is None or ch.numel() not in (1, wv.shape[0]):
        return None
    return _conv_like(ctx, conv, x, _const(ctx, conv, wv * ch.reshape(-1, 1, 1, 1)))


def _scale_conv(ctx: Context, conv: Node, m: Node, x: Node, s: Node, w: Node) -> Node | None:
    """conv(x * s, W), s per input channel -> conv(x, W * s) (padding zeros stay zeros)."""
    sv, wv = _f64(s), _f64(w)
    if sv is None or wv is None or ctx.uses(m) > 1 or not _float(conv) or is_const(x):
        return None
    ch = _along(sv, 4, 1)
    groups, c_in = conv.arg.groups, x.shape[1]
    if ch is None or ch.numel() not in (1, c_in):
        return None
    per_group = ch.expand(c_in).reshape(groups, -1)  # [groups, C/groups]
    scale = per_group[torch.arange(wv.shape[0]) // (wv.shape[0] // groups)]  # [O, C/groups]
    return _conv_like(ctx, conv, x, _const(ctx, conv, wv * scale[:, :, None, None]))


_X, _S = Var("x"), Const("s")
RULES: list[Rule] = [
    (P(Op.MUL, P(Op.MUL, _X, Const("c1")), Const("c2")), _mul_mul),
    (P(Op.ADD, P(Op.ADD, _X, Const("c1")), Const("c2")), _add_add),
    (P(Op.SUB, _X, Const("c")), _sub_const),
    (P(Op.MUL, P(Op.ADD, _X, Const("b"), name="inner"), _S), _distribute),
    (P(Op.MUL, Var("y", lambda n: n.op in (Op.MATMUL, Op.VIEW)), _S), _matmul_scale),
    (P(Op.MUL, P(Op.CONV, _X, Var("w"), name="conv"), _S), _conv_scale),
    (P(Op.MATMUL, Var("a"), Var("w"), name="mm"), _pre_matmul),
    (P(Op.CONV, P(Op.MUL, _X, _S, name="m"), Var("w"), name="conv"), _scale_conv),
]


def affine(graph: Graph) -> Graph:
    """Collapse constant scale/bias chains and fold them into matmul/conv weights (a pure function)."""
    return rewrite(graph, RULES, "affine")


__all__ = ["RULES", "affine"]
