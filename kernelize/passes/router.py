"""Router fusion: a traced router's row math becomes ``ROUTE`` nodes (:mod:`kernelize.ir.router`).

transformers' routers compute ``softmax(logits, dtype=float) -> topk -> / sum -> .to(dtype)`` (Qwen3-MoE,
Mixtral, OLMoE) or ``topk(logits) -> softmax`` (gpt-oss); traced, that is a softmax (or sigmoid) feeding a
``TOPK`` pair, a division by the values' sum, a cast. The rules fold them step by step into the two nodes
of one ``ROUTE``, which the planner runs as one ROUTER kernel reading the logits once:

1. ``topk(score(x))`` -> ``route(x, score)`` (score: a last-axis softmax, a sigmoid or nothing; a widening
   cast of ``x`` is read through, the kernel widens as it loads);
2. ``w / (sum(w) + eps)`` -> ``renorm="sum"``; ``softmax(w)`` of unscored weights -> ``renorm="softmax"``;
3. ``w * c`` (a constant) -> ``scale``; ``w.to(float dtype)`` -> the node's dtype.

Example:
    before                                                after
    %4 = softmax(%3) {1} : f32[tokens, 12]                %4 = route(%3) {RouteArgs(k=3, ...)}
    %5 = topk(%4) {TopkArgs(k=3)} : f32[tokens, 3]        %5 = route(%3) {... indices=True} : i64
    %6 = topk(%4) {TopkArgs(k=3, indices=True)} : i64     %6 = route(%3) {... renorm='sum'}
    %9 = div(%5, broadcast(sum(%5)))
"""

from __future__ import annotations

import dataclasses

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Node, Op, scalar_value
from kernelize.passes.rewrite import B, Context, P, Rule, Scalar, Var, rewrite


def _widened(x: Node) -> Node:
    """``x`` under an exact widening cast (f16 / bf16 -> f32): the kernel widens as it loads."""
    if x.op is Op.CAST and x.dtype is DType.F32 and x.src[0].dtype in (DType.F16, DType.BF16):
        return x.src[0]
    return x


def _score(s: Node) -> tuple[str, Node] | None:
    """(score, logits) of a topk operand: a last-axis softmax, a sigmoid, or plain floats."""
    if s.op is Op.SOFTMAX and s.arg == s.rank - 1:
        return "softmax", _widened(s.src[0])
    if s.op is Op.SIGMOID:
        return "sigmoid", _widened(s.src[0])
    return ("none", s) if s.dtype.is_float else None


def _topk(ctx: Context, t: Node, s: Node) -> Node | None:
    scored = _score(s)
    if scored is None or t.dtype is DType.F64 or scored[1].dtype is DType.F64:
        return None
    score, x = scored
    dtype = DType.F32 if t.arg.indices else t.dtype
    return ctx.g.route(x, t.arg.k, score=score, dtype=dtype)[t.arg.indices]


def _weights(w: Node) -> bool:
    """A ROUTE weights node nothing was applied to after the choice yet."""
    a = w.arg
    return w.op is Op.ROUTE and not a.indices and a.renorm == "none" and a.scale == 1.0


def _again(ctx: Context, w: Node, dtype: DType | None = None, **change: object) -> Node:
    """``w``'s router with fields changed (and the node's dtype)."""
    a = dataclasses.replace(w.arg, **change)
    fields = dict(score=a.score, renorm=a.renorm, eps=a.eps, scale=a.scale)
    bias = w.src[1] if a.bias else None
    return ctx.g.route(w.src[0], a.k, bias, dtype=dtype or w.dtype, **fields)[0]


def _sum_renorm(ctx: Context, w: Node, total: Node, eps: Node | None = None) -> Node | None:
    e = 0.0 if eps is None else scalar_value(eps)
    if not _weights(w) or w.dtype is not DType.F32 or e is None or total.arg != (w.rank - 1,):
        return None
    return _again(ctx, w, renorm="sum", eps=e)


def _softmax_renorm(ctx: Context, root: Node, w: Node) -> Node | None:
    if not _weights(w) or w.arg.score != "none" or root.arg != w.rank - 1:
        return None
    return _again(ctx, w, root.dtype, renorm="softmax")


def _scale(ctx: Context, w: Node, c: Node) -> Node | None:
    v = scalar_value(c)
    a = w.arg
    if w.op is not Op.ROUTE or a.indices or a.scale != 1.0 or v is None or w.dtype is not DType.F32:
        return None
    return _again(ctx, w, scale=v)


def _cast(ctx: Context, root: Node, w: Node) -> Node | None:
    if w.op is not Op.ROUTE or w.arg.indices or not root.dtype.is_float or w.dtype is not DType.F32:
        return None
    return _again(ctx, w, root.dtype)


_W = Var("w", lambda n: n.op is Op.ROUTE)
RULES: list[Rule] = [
    (P(Op.TOPK, Var("s"), name="t"), _topk),
    (P(Op.DIV, _W, B(P(Op.SUM, _W, name="total"))), _sum_renorm),
    (P(Op.DIV, _W, B(P(Op.ADD, P(Op.SUM, _W, name="total"), Scalar("eps")))), _sum_renorm),
    (P(Op.SOFTMAX, _W, name="root"), _softmax_renorm),
    (P(Op.MUL, _W, Scalar("c")), _scale),
    (P(Op.CAST, _W, name="root"), _cast),
]


def router(graph: Graph) -> Graph:
    """Fold routers' score / top-k / renormalisation / scale / cast chains into ``ROUTE`` nodes."""
    return rewrite(graph, RULES, "router")


__all__ = ["RULES", "router"]
