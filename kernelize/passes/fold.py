"""Constant folding and layout/cast simplification.

General constant folding evaluates, with the reference executor, every node whose operands are all
constants (a broadcast constant counts: it is folded at its small size), as long as the result stays
small (at most ``max(FOLD_LIMIT, largest constant operand)`` elements) and static. Broadcasts themselves
are never materialised, and a big constant read by several nodes is not copied to re-index it. Layout
rules merge slice-of-slice, turn a permute that only moves size-1 dims into a view, and drop exact
round-trip casts.

Example:
    before                                      after
    %1 = const <64 values> : f32[16, 4]         %1 = const <64 values> : f32[4, 16]
    %2 = permute(%1) {(1, 0)} : f32[4, 16]      %3 = matmul(%0, %1) : f32[2, 16]
    %3 = matmul(%0, %2) : f32[2, 16]
"""

from __future__ import annotations

from kernelize.ir.dtypes import FLOATS, INTS, DType
from kernelize.ir.graph import LAYOUT, SOURCE, Graph, Node, Op
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import Sym, is_static, numel
from kernelize.passes.rewrite import Context, P, Rule, Var, rewrite

# a folded constant may always have this many elements (more only if an operand constant is that big)
FOLD_LIMIT = 4096


def _const_operand(n: Node) -> Node | None:
    """The constant behind an operand: itself, or the constant a broadcast widens."""
    if n.op is Op.CONST:
        return n
    if n.op is Op.BROADCAST and n.src[0].op is Op.CONST:
        return n.src[0]
    return None


def _foldable(n: Node) -> bool:
    if n.op in SOURCE or n.op is Op.BROADCAST or not n.src or not is_static(n.shape):
        return False
    consts = [_const_operand(s) for s in n.src]
    if any(c is None for c in consts):
        return False
    return numel(n.shape) <= max(FOLD_LIMIT, *(numel(c.shape) for c in consts))


def _fold(ctx: Context, n: Node) -> Node | None:
    if n.op in LAYOUT and numel(n.shape) > FOLD_LIMIT and ctx.uses(n.src[0]) > 1:
        return None  # a re-indexed copy of a big constant others still read would double its memory
    g = Graph()
    srcs = []
    for s in n.src:
        c = g.const(_const_operand(s).arg.tensor)
        srcs.append(c if s.op is Op.CONST else g.push(Op.BROADCAST, s.dtype, s.shape, (c,)))
    g.output(g.push(n.op, n.dtype, n.shape, srcs, n.arg))
    try:
        value = evaluate(g, [])[0]
    except (RuntimeError, ValueError, IndexError):  # e.g. an out-of-range gather: leave it for run time
        return None
    return ctx.g.const(value)


def _slice_slice(ctx: Context, outer: Node, inner: Node, x: Node) -> Node | None:
    """slice(slice(x)) -> one slice: the outer range indexes the inner one's elements."""
    ranges = []
    for (s1, e1, st1), (s2, e2, st2), d, mid in zip(inner.arg, outer.arg, x.shape, inner.shape):
        if (s2, e2, st2) == (0, mid, 1):
            ranges.append((s1, e1, st1))
            continue
        if isinstance(d, Sym):
            return None
        size = -(-(e2 - s2) // st2) if e2 > s2 else 0
        start = s1 + s2 * st1
        ranges.append((start, start + size * st1 * st2, st1 * st2))
    return ctx.g.push(Op.SLICE, x.dtype, outer.shape, (x,), tuple(ranges))


def _permute_as_view(ctx: Context, p: Node, x: Node) -> Node | None:
    """A permute that keeps the order of the non-1 dims is a reshape."""
    moved = [a for a in p.arg if x.shape[a] != 1]
    if moved != sorted(moved):
        return None
    return ctx.g.view(x, p.shape)


def _exact(wide: DType, narrow: DType) -> bool:
    """True when every ``narrow`` value survives a round trip through ``wide``."""
    if narrow in FLOATS and wide in FLOATS:
        return wide == narrow or (
            wide in (DType.F32, DType.F64) and FLOATS.index(wide) >= FLOATS.index(narrow)
        )
    if narrow is DType.BOOL:
        return True
    if narrow in INTS and wide in INTS:
        return wide.itemsize > narrow.itemsize or wide == narrow
    return narrow in INTS and (
        (wide is DType.F32 and narrow.itemsize <= 2) or (wide is DType.F64 and narrow.itemsize <= 4)
    )


def _cast_cast(ctx: Context, outer: Node, inner: Node, x: Node) -> Node | None:
    """cast(cast(x, wide), x.dtype) -> x when ``wide`` holds every value of x's dtype."""
    if outer.dtype == x.dtype and _exact(inner.dtype, x.dtype):
        return x
    return None


def _pad_of_neg(ctx: Context, pad: Node, neg: Node, x: Node) -> Node | None:
    """pad(-x, 0) -> -pad(x, 0): the pad then reads x in place (an autodiff'd rotate-half gives this), where
    a pad of a computed value needs the value in a buffer first."""
    if pad.arg.value != 0:
        return None
    return ctx.g.neg(ctx.g.push(Op.PAD, x.dtype, pad.shape, (x,), pad.arg))


RULES: list[Rule] = [
    (P(None, name="n", where=_foldable), _fold),
    (P(Op.SLICE, P(Op.SLICE, Var("x"), name="inner"), name="outer"), _slice_slice),
    (P(Op.PERMUTE, Var("x"), name="p"), _permute_as_view),
    (P(Op.CAST, P(Op.CAST, Var("x"), name="inner"), name="outer"), _cast_cast),
    (P(Op.PAD, P(Op.NEG, Var("x"), name="neg"), name="pad"), _pad_of_neg),
]


def fold(graph: Graph) -> Graph:
    """Fold constant subexpressions and simplify layout/cast chains (a pure function)."""
    return rewrite(graph, RULES, "fold")


__all__ = ["FOLD_LIMIT", "RULES", "fold"]
