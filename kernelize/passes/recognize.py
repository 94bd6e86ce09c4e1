"""Recognition of compound ops from their decomposed templates: layernorm, rmsnorm, softmax, log-softmax and
gelu (erf and tanh forms), in the spellings people write and the ones torch's decompositions produce.

Templates (``mean`` over the last axis, ``sq(x)`` is ``x*x`` or ``x**2``, ``e = exp(d)``, a shift
``d = x - max(x)`` is optional since both ops are shift-invariant):

- ``x * rsqrt(mean(sq(x)) + eps)`` (or ``x / sqrt(..)``) -> ``rmsnorm(x)``; when ``x = y - mean(y)`` ->
  ``layernorm(y)``; a following ``* w`` / ``+ b`` along the last axis becomes the norm's parameters
- ``e / sum(e)`` (or ``e * reciprocal(sum(e))``) -> ``softmax``; ``d - log(sum(exp(d)))`` and
  ``log(softmax(x))`` -> ``log_softmax``
- any add/mul tree equal to ``0.5*x + 0.5*x*erf(x/sqrt(2))`` -> ``gelu(x)``, and to
  ``0.5*x + 0.5*x*tanh(k*(x + 0.044715*x^3))``, ``k = sqrt(2/pi)`` -> ``gelu(x, 'tanh')``: a small
  polynomial normaliser reads the tree, so every association order and constant placement matches
- ``cast(op(cast(x, f32)), f16)`` for these ops -> ``op(x)`` in f16 (kernels compute 16-bit floats in f32)
- ``softmax(q @ k^T * scale + mask) @ v`` -> ``attention`` (:mod:`kernelize.passes.attention`)

SiLU (``x * sigmoid(x)``) has no IR node and stays elementwise.

Example:
    before                                           after
    %2 = pow(%0, %1) : f32[4, 64]                    %3 = rmsnorm(%0, %1) {NormArgs(eps=1e-06,
    %3 = mean(%2) {(1,)} : f32[4, 1]                      has_weight=True, has_bias=False)} : f32[4, 64]
    ... add, rsqrt, broadcast, mul(%0, ..), mul(.., w)
"""

from __future__ import annotations

import math

from kernelize.ir.dtypes import HALF, DType, compute_dtype
from kernelize.ir.graph import ROW, Graph, Node, Op, scalar_value
from kernelize.passes.attention import RULES as ATTENTION_RULES
from kernelize.passes.rewrite import B, Context, P, Rule, Scalar, Var, rewrite, strip_broadcast, unbroadcast

# relative tolerance when reading template constants stored in each dtype
_RTOL = {DType.F16: 2e-3, DType.BF16: 1e-2, DType.F32: 1e-5, DType.F64: 1e-9}


def _last_axis(n: Node) -> bool:
    return n.arg == (n.rank - 1,)


def _mean_last(node: Node) -> Node | None:
    """The operand of a mean over the last axis: ``mean(v)``, ``sum(v) * (1/n)`` or ``sum(v) / n``."""
    if node.op is Op.MEAN and _last_axis(node):
        return node.src[0]
    for i, j in {Op.MUL: ((0, 1), (1, 0)), Op.DIV: ((0, 1),)}.get(node.op, ()):
        s, v = unbroadcast(node.src[i]), scalar_value(node.src[j])
        if s.op is not Op.SUM or not _last_axis(s) or not v or not isinstance(s.src[0].shape[-1], int):
            continue
        if math.isclose(v if node.op is Op.DIV else 1 / v, s.src[0].shape[-1], rel_tol=1e-3):
            return s.src[0]
    return None


def _square_of(sq: Node) -> Node | None:
    if sq.op is Op.MUL and sq.src[0] is sq.src[1]:
        return sq.src[0]
    if sq.op is Op.POW and scalar_value(sq.src[1]) == 2:
        return sq.src[0]
    return None


def _norm(ctx: Context, x: Node, ms: Node, eps: Node, r: Node | None = None) -> Node | None:
    """x * rsqrt(mean(x^2) + eps) -> rmsnorm(x); with x = y - mean(y) -> layernorm(y). Not when a statistic
    (``r``, the mean) has readers outside the template, as in a training forward that saves them for
    backward: the decomposition computes them once for both, a fused norm would compute them again."""
    sq = _mean_last(ms)
    e = scalar_value(eps)
    if sq is None or _square_of(sq) is not x or e is None or e < 0 or not x.dtype.is_float or x.rank == 0:
        return None
    if r is not None and ctx.uses(r) > 1:
        return None
    if x.op is Op.SUB and _mean_last(unbroadcast(x.src[1])) is x.src[0]:
        return None if ctx.uses(unbroadcast(x.src[1])) > 1 else ctx.g.layernorm(x.src[0], eps=e)
    return ctx.g.rmsnorm(x, eps=e)


def _vector(ctx: Context, norm: Node, p: Node) -> Node | None:
    """``p`` (seen through broadcasts) as a vector along the norm's last axis, if that is what it is and
    scaling/shifting by it keeps the norm's shape."""
    v = unbroadcast(p)
    d = norm.shape[-1]
    if (
        v.dtype != norm.dtype
        or ctx.root.shape != norm.shape
        or ctx.uses(norm) > 1
        or any(s != 1 for s in v.shape[:-1])
        or v.shape[-1:] != (d,)
    ):
        return None
    return ctx.g.view(v, (d,))


def _rms_weight(ctx: Context, n: Node, w: Node) -> Node | None:
    wv = _vector(ctx, n, w)
    return None if wv is None else ctx.g.rmsnorm(n.src[0], wv, n.arg.eps)


def _ln_weight(ctx: Context, n: Node, w: Node) -> Node | None:
    wv = _vector(ctx, n, w)
    return None if wv is None else ctx.g.layernorm(n.src[0], wv, None, n.arg.eps)


def _ln_bias(ctx: Context, n: Node, b: Node) -> Node | None:
    bv = _vector(ctx, n, b)
    if bv is None:
        return None
    return ctx.g.layernorm(n.src[0], n.src[1] if n.arg.has_weight else None, bv, n.arg.eps)


def _unshift(d: Node, axis: int) -> Node:
    """x for d = x - m with m constant along ``axis`` (softmax and log-softmax do not change under such a
    shift; it is usually max(x)), else d."""
    if d.op is Op.SUB and strip_broadcast(d.src[1]).shape[axis] == 1:
        return d.src[0]
    return d


def _softmax(ctx: Context, e: Node, s: Node) -> Node | None:
    (axis,) = s.arg
    return ctx.g.softmax(_unshift(e.src[0], axis), axis)


def _log_softmax(ctx: Context, d: Node, s: Node) -> Node | None:
    (axis,) = s.arg
    return ctx.g.log_softmax(_unshift(d, axis), axis)


def _lse_sub(ctx: Context, x: Node, s: Node, m: Node) -> Node | None:
    """x - (log(sum(exp(x - m))) + m) -> log_softmax(x) (torch's logsumexp, m its guarded max)."""
    (axis,) = s.arg
    return ctx.g.log_softmax(x, axis) if m.shape[axis] == 1 else None


def _log_of_softmax(ctx: Context, sm: Node, x: Node) -> Node | None:
    return ctx.g.log_softmax(x, sm.arg)


# -- gelu: read an add/mul tree as a polynomial over its non-arithmetic leaves ------------------------------
Poly = dict[tuple[int, ...], float]
_MAX_DEGREE, _MAX_TERMS, _BUDGET = 4, 16, 40


def _poly(node: Node, atoms: dict[int, Node], budget: list[int]) -> Poly | None:
    """``node`` as {monomial (sorted leaf ids): coefficient}, or None when it is not a small polynomial."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    v = scalar_value(node)
    if v is not None:
        return {(): float(v)}
    op, src = node.op, node.src
    if op is Op.CAST and node.dtype.is_float and src[0].dtype.is_float:
        # a 16-bit graph computes `x / sqrt(2)` as cast(cast(x, f32) / sqrt(2), f16): the value is the same
        return _poly(src[0], atoms, budget)
    if op in (Op.ADD, Op.SUB):
        a, b = _poly(src[0], atoms, budget), _poly(src[1], atoms, budget)
        if a is None or b is None:
            return None
        out = dict(a)
        for k, c in b.items():
            out[k] = out.get(k, 0.0) + (c if op is Op.ADD else -c)
        return out
    if op is Op.NEG:
        a = _poly(src[0], atoms, budget)
        return None if a is None else {k: -c for k, c in a.items()}
    if op is Op.MUL:
        a, b = _poly(src[0], atoms, budget), _poly(src[1], atoms, budget)
        return None if a is None or b is None else _times(a, b)
    if op is Op.DIV and scalar_value(src[1]):
        a = _poly(src[0], atoms, budget)
        return None if a is None else {k: c / scalar_value(src[1]) for k, c in a.items()}
    if op is Op.POW and scalar_value(src[1]) in (2.0, 3.0):
        a = _poly(src[0], atoms, budget)
        out = a
        for _ in range(int(scalar_value(src[1])) - 1):
            out = None if out is None else _times(out, a)
        return out
    atoms[id(node)] = node
    return {(id(node),): 1.0}


def _times(a: Poly, b: Poly) -> Poly | None:
    out: Poly = {}
    for ka, ca in a.items():
        for kb, cb in b.items():
            k = tuple(sorted(ka + kb))
            if len(k) > _MAX_DEGREE:
                return None
            out[k] = out.get(k, 0.0) + ca * cb
    return out if len(out) <= _MAX_TERMS else None


def _close(p: Poly, want: Poly, rtol: float) -> bool:
    got = {k: c for k, c in p.items() if abs(c) > 1e-12}
    return got.keys() == want.keys() and all(abs(got[k] - c) <= rtol * abs(c) for k, c in want.items())


def _gelu(ctx: Context, root: Node) -> Node | None:
    if not root.dtype.is_float:
        return None
    atoms: dict[int, Node] = {}
    p = _poly(root, atoms, [_BUDGET])
    if p is None or len(atoms) != 2:
        return None
    t = next((a for a in atoms.values() if a.op in (Op.ERF, Op.TANH)), None)
    x = next((a for a in atoms.values() if a is not t), None)
    if t is None or x is None or x.shape != root.shape or t.shape != root.shape or x.dtype != root.dtype:
        return None
    rtol = _RTOL[root.dtype]
    ix, it = id(x), id(t)
    if not _close(p, {(ix,): 0.5, tuple(sorted((ix, it))): 0.5}, rtol):
        return None
    inner: dict[int, Node] = {}
    q = _poly(t.src[0], inner, [_BUDGET])
    if q is None or set(inner) != {ix}:
        return None
    if t.op is Op.ERF:
        return ctx.g.gelu(x) if _close(q, {(ix,): math.sqrt(0.5)}, rtol) else None
    k = math.sqrt(2 / math.pi)
    return ctx.g.gelu(x, "tanh") if _close(q, {(ix,): k, (ix, ix, ix): k * 0.044715}, rtol) else None


# -- 16-bit sandwiches --------------------------------------------------------------------------------------
def _narrow(ctx: Context, c: Node, r: Node) -> Node | None:
    """cast(op(cast(x, f32), cast(w, f32)..), f16) -> op(x, w..) in f16: the IR computes f16 in f32 anyway."""
    lo = c.dtype
    if lo not in HALF or r.dtype != compute_dtype(lo):
        return None
    srcs = []
    for s in r.src:
        if s.op is not Op.CAST or s.src[0].dtype != lo:
            return None
        srcs.append(s.src[0])
    return ctx.g.push(r.op, lo, r.shape, srcs, r.arg)


def _one_axis(n: Node) -> bool:
    return len(n.arg) == 1


def _no_params(n: Node) -> bool:
    return not n.arg.params


_x, _ms, _eps = Var("x"), Var("ms"), Scalar("eps")
_EXP = Var("e", lambda n: n.op is Op.EXP)
_SUM = P(Op.SUM, _EXP, name="s", where=_one_axis)

RULES: list[Rule] = [
    (P(Op.MUL, _x, B(P(Op.RSQRT, P(Op.ADD, _ms, _eps), name="r"))), _norm),
    (P(Op.DIV, _x, B(P(Op.SQRT, P(Op.ADD, _ms, _eps)))), _norm),
    (P(Op.MUL, _x, B(P(Op.RECIPROCAL, P(Op.SQRT, P(Op.ADD, _ms, _eps))))), _norm),
    (P(Op.MUL, P(Op.RMSNORM, name="n", where=_no_params), Var("w")), _rms_weight),
    (P(Op.MUL, P(Op.LAYERNORM, name="n", where=_no_params), Var("w")), _ln_weight),
    (P(Op.ADD, P(Op.LAYERNORM, name="n", where=lambda n: not n.arg.has_bias), Var("b")), _ln_bias),
    (P(Op.DIV, _EXP, B(_SUM)), _softmax),
    (P(Op.MUL, _EXP, B(P(Op.RECIPROCAL, _SUM))), _softmax),
    (
        P(Op.SUB, Var("d"), B(P(Op.LOG, P(Op.SUM, P(Op.EXP, Var("d")), name="s", where=_one_axis)))),
        _log_softmax,
    ),
    (
        P(
            Op.SUB,
            _x,
            B(
                P(
                    Op.ADD,
                    B(P(Op.LOG, P(Op.SUM, P(Op.EXP, P(Op.SUB, _x, B(Var("m")))), name="s", where=_one_axis))),
                    Var("m"),
                )
            ),
        ),
        _lse_sub,
    ),
    (P(Op.LOG, P(Op.SOFTMAX, Var("x"), name="sm")), _log_of_softmax),
    (P(frozenset({Op.MUL, Op.ADD}), name="root"), _gelu),
    (P(Op.CAST, Var("r", lambda n: n.op in ROW or n.op is Op.GELU), name="c"), _narrow),
    *ATTENTION_RULES,
]


def recognize(graph: Graph) -> Graph:
    """Replace decomposed norm/softmax/gelu templates with single IR ops (a pure function)."""
    return rewrite(graph, RULES, "recognize")


__all__ = ["RULES", "recognize"]
