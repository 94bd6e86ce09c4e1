"""Clamp fusion: relu / min / max-with-a-constant chains become one ``clamp``.

``max(x, a)`` is ``clamp(x, a, inf)``, ``min(x, b)`` is ``clamp(x, -inf, b)``, and two clamps compose:
``clamp(clamp(x, a, b), c, d) = clamp(x, max(a, c), min(max(b, c), d))`` (torch's clamp is
``min(max(x, lo), hi)``, which this formula keeps even when the bounds cross). Floats only.

Example:
    before                                                after
    %1 = clamp(%0) {ClampArgs(lo=0, hi=inf)} : f32[8]     %1 = clamp(%0) {ClampArgs(lo=0, hi=6)} : f32[8]
    %3 = min(%1, %2) : f32[8]  (%2 = 6.0)
"""

from __future__ import annotations

import math

from kernelize.ir.graph import Graph, Node, Op, scalar_value
from kernelize.passes.rewrite import Context, P, Rule, Scalar, Var, rewrite


def _bound(c: Node, x: Node) -> float | None:
    v = scalar_value(c)
    if v is None or not x.dtype.is_float or math.isnan(v):
        return None
    return float(v)


def _max_const(ctx: Context, x: Node, c: Node) -> Node | None:
    lo = _bound(c, x)
    return None if lo is None else ctx.g.clamp(x, lo, math.inf)


def _min_const(ctx: Context, x: Node, c: Node) -> Node | None:
    hi = _bound(c, x)
    return None if hi is None else ctx.g.clamp(x, -math.inf, hi)


def _clamp_clamp(ctx: Context, outer: Node, inner: Node, x: Node) -> Node | None:
    a, b, c, d = inner.arg.lo, inner.arg.hi, outer.arg.lo, outer.arg.hi
    return ctx.g.clamp(x, max(a, c), min(max(b, c), d))


RULES: list[Rule] = [
    (P(Op.MAX, Var("x", lambda n: n.dtype.is_float), Scalar("c")), _max_const),
    (P(Op.MIN, Var("x", lambda n: n.dtype.is_float), Scalar("c")), _min_const),
    (P(Op.CLAMP, P(Op.CLAMP, Var("x"), name="inner"), name="outer"), _clamp_clamp),
]


def clamp(graph: Graph) -> Graph:
    """Fuse relu/min/max chains into single clamps (a pure function)."""
    return rewrite(graph, RULES, "clamp")


__all__ = ["RULES", "clamp"]
