"""Strength reduction: cheaper ops with the same value.

Division by a constant becomes multiplication by its reciprocal (floats only: integer division
truncates), and powers with small constant exponents become multiplications or unary ops, 0.75 and 1.5
square roots.

Example:
    before                                  after
    %2 = div(%0, %1) : f32[4]  (%1 = 8.0)   %2 = mul(%0, %1) : f32[4]  (%1 = 0.125)
    %3 = pow(%2, 2.0) : f32[4]              %3 = mul(%2, %2) : f32[4]
"""

from __future__ import annotations

import torch

from kernelize.ir.dtypes import HALF, compute_dtype
from kernelize.ir.graph import Graph, Node, Op, scalar_value
from kernelize.passes.rewrite import Const, Context, P, Rule, Scalar, Var, const_value, rewrite


def _div_const(ctx: Context, x: Node, c: Node) -> Node | None:
    """x / c -> x * (1 / c) when 1 / c is a normal number, or c is 0 or inf (x / 0 and x * inf agree).

    A subnormal c has no finite reciprocal (0 / c is 0, 0 * inf is nan) and a huge c a subnormal one that
    loses digits: those divisions stay. A 16-bit x takes the reciprocal as an f32 scalar (the builder then
    multiplies in f32, as torch's ``x / s`` does); a per-element 16-bit divisor keeps the exact division.
    """
    if not x.dtype.is_float:
        return None
    value = const_value(c)
    if value is None:
        return None
    wide = compute_dtype(x.dtype).torch
    recip = torch.reciprocal(value.to(torch.float64)).to(wide)
    exact = value.to(wide)
    normal = recip.isfinite() & (recip.abs() >= torch.finfo(wide).tiny)
    if not bool((normal | (exact == 0) | exact.isinf()).all()):
        return None
    if x.dtype in HALF:
        if scalar_value(c) is None:
            return None
        return ctx.g.mul(x, float(recip.reshape(-1)[0]))
    return ctx.g.mul(x, ctx.g.const(recip.to(x.dtype.torch)))


def _sq(g: Graph, x: Node) -> Node:
    return g.mul(x, x)


# exponent -> how to compute x ** exponent (not 0.5 / -0.5: sqrt(-inf) is nan but pow(-inf, 0.5) is inf)
_POW = {
    1.0: lambda g, x: x,
    2.0: _sq,
    3.0: lambda g, x: g.mul(_sq(g, x), x),
    4.0: lambda g, x: _sq(g, _sq(g, x)),
    -1.0: lambda g, x: g.reciprocal(x),
    -2.0: lambda g, x: g.reciprocal(_sq(g, x)),
}


# exponents 0.75 and 1.5 through square roots (vectorised, where powf is a scalar libm call per element: the
# LRN of AlexNet's export, (k + a * sum x^2) ^ 0.75, took 0.9-1.4 ms of a 13 ms model on one thread). They
# differ from pow by an ulp or two, agree at +-0, +inf and below 0, and at -inf, where pow gives +inf and a
# root nan, are guarded. (0.25 and 0.5 are not here: their roots give -0 for -0.)
_ROOTS = {
    0.75: lambda g, x: g.mul(g.sqrt(x), g.sqrt(g.sqrt(x))),
    1.5: lambda g, x: g.mul(x, g.sqrt(x)),
}


def _pow_const(ctx: Context, x: Node, e: Node) -> Node | None:
    if not x.dtype.is_float:
        return None
    exponent = scalar_value(e)
    build = _POW.get(exponent)
    if build is not None:
        return build(ctx.g, x)
    root = _ROOTS.get(exponent)
    if root is None:
        return None
    g = ctx.g
    return g.where(g.eq(x, -float("inf")), float("inf"), root(g, x))


RULES: list[Rule] = [
    (P(Op.DIV, Var("x"), Const("c")), _div_const),
    (P(Op.POW, Var("x"), Scalar("e")), _pow_const),
]


def strength(graph: Graph) -> Graph:
    """Replace division by constants and small constant powers (a pure function)."""
    return rewrite(graph, RULES, "strength")


__all__ = ["RULES", "strength"]
