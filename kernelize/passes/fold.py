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
    if n.op is Op.VIEW and n.src[0].op is Op.CONST:
        return ctx.g.push(Op.CONST, n.dtype, n.shape, (), n.src[0].arg.reshaped(n.shape))
    if n.op in LAYOUT and numel(n.shape) > FOLD_LIMIT and ctx.uses(n.src[0]) > 1:
        return None  # a re-indexed copy of a big constant others still read would double its memory
    g = Graph()
    srcs = []
    for s in n.src:
        op = _const_operand(s)  # its Constant as is: hashing a weight again costs ~1 ms per MB
        c = g.push(Op.CONST, op.dtype, op.shape, (), op.arg)
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


def _pieces(n: Node) -> tuple[int, list[tuple[int, Node | None]]] | None:
    """``n`` as consecutive pieces along one axis: a concat's operands, or a zero pad's blocks around its
    operand (``None`` stands for zeros); None when it is neither."""
    if n.op is Op.CONCAT:
        return n.arg, [(s.shape[n.arg], s) for s in n.src]
    if n.op is not Op.PAD or n.arg.value != 0:
        return None
    padded = [a for a, (lo, hi) in enumerate(n.arg.pads) if lo or hi]
    if len(padded) != 1:
        return None
    (axis,) = padded
    lo, hi = n.arg.pads[axis]
    parts = [(lo, None), (n.src[0].shape[axis], n.src[0]), (hi, None)]
    return axis, [(size, v) for size, v in parts if size]


def _add_pieces(ctx: Context, n: Node, a: Node, b: Node) -> Node | None:
    """concat(a1, a2) + concat(b1, b2) -> concat(a1 + b1, a2 + b2) when both split the same axis at the same
    points (a zero pad counts as a concat with zero blocks). The gradient of a value sliced into parts
    (``silu(x[:, :d]) * x[:, d:]``) is such a sum of zero-padded pieces; after the rewrite the zeros vanish
    (``x + 0 -> x``) and each piece is computed once over its own range, not every piece over the row."""
    pa, pb = _pieces(a), _pieces(b)
    if pa is None or pb is None or pa[0] != pb[0] or [s for s, _ in pa[1]] != [s for s, _ in pb[1]]:
        return None
    axis, g = pa[0], ctx.g
    parts = []
    for (size, x), (_, y) in zip(pa[1], pb[1]):
        shape = tuple(size if k == axis else d for k, d in enumerate(n.shape))
        x = x if x is not None else g.broadcast(g.scalar(0.0, n.dtype), shape)
        parts.append(g.add(x, y) if y is not None else x)
    return g.concat(parts, axis)


def _cast_of_broadcast(ctx: Context, c: Node, b: Node, x: Node) -> Node:
    """cast(broadcast(x)) -> broadcast(cast(x)): the cast runs on the small value, and what reads it (a pad
    or a slice of a gradient, which needs a materialized source) reads it through layout ops."""
    return ctx.g.broadcast(ctx.g.cast(x, c.dtype), b.shape)


def _cast_of_concat(ctx: Context, c: Node, cat: Node) -> Node:
    """cast(concat(a, b)) -> concat(cast(a), cast(b)): each branch stays a layout chain over its source."""
    return ctx.g.concat([ctx.g.cast(s, c.dtype) for s in cat.src], cat.arg)


_PIECES = frozenset({Op.CONCAT, Op.PAD})

RULES: list[Rule] = [
    (P(None, name="n", where=_foldable), _fold),
    (P(Op.SLICE, P(Op.SLICE, Var("x"), name="inner"), name="outer"), _slice_slice),
    (P(Op.PERMUTE, Var("x"), name="p"), _permute_as_view),
    (P(Op.CAST, P(Op.CAST, Var("x"), name="inner"), name="outer"), _cast_cast),
    (P(Op.PAD, P(Op.NEG, Var("x"), name="neg"), name="pad"), _pad_of_neg),
    (P(Op.ADD, P(_PIECES, name="a"), P(_PIECES, name="b"), name="n"), _add_pieces),
    (P(Op.CAST, P(Op.BROADCAST, Var("x"), name="b"), name="c"), _cast_of_broadcast),
    (P(Op.CAST, P(Op.CONCAT, name="cat"), name="c"), _cast_of_concat),
]


def fold(graph: Graph) -> Graph:
    """Fold constant subexpressions and simplify layout/cast chains (a pure function)."""
    return rewrite(graph, RULES, "fold")


__all__ = ["FOLD_LIMIT", "RULES", "fold"]
