"""Recognition of attention: ``softmax(q @ k^T * scale + mask) @ v`` -> one ``ATTENTION`` node.

The template, as model code writes it and the torch front end traces it (batched matmuls over flattened
``[B*H, L, D]`` views of ``[B, H, L, D]`` values)::

    s = view(matmul(view(q), view(kt)))          # [B, H, Lq, Lk]; kt = permute(k, (0, 1, 3, 2)), or any
                                                 # permute whose last two axes are head dim and keys;
                                                 # q and kt may each be times a scalar (ONNX exports)
    t = s | s * c | s / c | cap * tanh(s * c)    # the last: soft-capping (Gemma 2)
    x = t | t + mask | where(keep, t, -inf)
    out = view(matmul(view(softmax(x, axis=3)), view(v)))      # [B, H, Lq, Dv]

becomes ``attention(q, k, v, mask, scale=c)`` with ``k = transpose(kt)`` (a layout view the kernel reads
in place) and, for soft-capping, the score modification ``softcap(cap)`` (:mod:`kernelize.ir.score_mod`).
Only exact rewrites: q, k, v and the softmax share one float dtype (no casts between), the softmax is over
the key axis and nothing else reads the probabilities, the mask is additive (same float dtype) or a boolean
keep-mask. One difference: a query row whose every key is masked gives NaN in the template (softmax of all
-inf) and zeros after the rewrite, as torch's own attention kernels give.

Example:
    before                                               after
    %7 = matmul(%5, %6) : f32[8, 8, 8]                   %9 = attention(%0, %1, %2, %8) {...}
    ... mul, add(mask), softmax, matmul, view
"""

from __future__ import annotations

import math

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Node, Op, scalar_value
from kernelize.ir.score_mod import softcap
from kernelize.ir.shapes import ShapeError
from kernelize.passes.rewrite import Context, P, Rule, strip_broadcast


def _rank4(node: Node) -> Node:
    """``node`` seen as its ``[B, H, L, X]`` value: through a view that only merged the two leading axes."""
    if node.rank == 3 and node.op is Op.VIEW and node.src[0].rank == 4:
        src = node.src[0]
        if src.shape[2:] == node.shape[1:]:
            return src
    return node


def _scores(s: Node) -> tuple[Node, Node, float] | None:
    """(q, k^T, scale) when ``s`` is ``(q * a) @ (k^T * b)`` over ``[B, H, L, D]`` operands (scale ``a * b``,
    each factor optional: ONNX exports of torch's attention scale both by ``sqrt(scale)``), k^T a permute
    (a layout view)."""
    mm = s.src[0] if s.op is Op.VIEW and s.rank == 4 else s
    if mm.op is not Op.MATMUL:
        return None
    (q, a), (kt, b) = _factor(_rank4(mm.src[0])), _factor(_rank4(mm.src[1]))
    if q.rank != 4 or kt.rank != 4 or kt.op is not Op.PERMUTE:
        return None
    return q, kt, a * b


def _factor(x: Node) -> tuple[Node, float]:
    """(y, c) when ``x`` is ``y * c`` for a nonzero scalar ``c`` (same dtype and shape), else (x, 1)."""
    if x.op is Op.MUL and x.dtype.is_float:
        for a, b in ((0, 1), (1, 0)):
            c, y = scalar_value(x.src[b]), x.src[a]
            if c is not None and c != 0 and y.dtype == x.dtype and y.shape == x.shape:
                return y, float(c)
    return x, 1.0


def _logits(x: Node) -> tuple[Node, float, float | None, Node | None] | None:
    """(scores, scale, soft-cap, mask) of the softmax operand ``x``."""
    mask = None
    if x.op is Op.ADD:
        for a, b in ((0, 1), (1, 0)):
            if _scores(_scaled(x.src[a])[0]) is not None and x.src[b].dtype == x.dtype:
                x, mask = x.src[a], x.src[b]
                break
        else:
            return None
    elif x.op is Op.WHERE and scalar_value(x.src[2]) == -math.inf and x.src[0].dtype is DType.BOOL:
        x, mask = x.src[1], x.src[0]
    s, scale, cap = _scaled(x)
    return (s, scale, cap, mask) if scale is not None else None


def _scaled(x: Node) -> tuple[Node, float | None, float | None]:
    """(scores, scale, soft-cap) of ``x``: ``s * scale``, or ``cap * tanh(s * a)`` (scale ``a * cap``)."""
    if x.op is Op.MUL and x.dtype.is_float:
        for a, b in ((0, 1), (1, 0)):
            cap, t = scalar_value(x.src[b]), x.src[a]
            if cap is not None and cap > 0 and t.op is Op.TANH:
                s, inner = _strip_scale(t.src[0])
                if _scores(s) is not None:
                    return s, inner * cap, cap
    return (*_strip_scale(x), None)


def _strip_scale(x: Node) -> tuple[Node, float | None]:
    op = x
    if x.op is Op.CAST and x.src[0].dtype is DType.F32 and x.src[0].op in (Op.MUL, Op.DIV):
        op = x.src[0]  # 16-bit scores times a scale f16 cannot hold: cast(cast(s, f32) * c, f16)
    if op.op in (Op.MUL, Op.DIV):
        for a, b in ((0, 1), (1, 0)) if op.op is Op.MUL else ((0, 1),):
            c, s = scalar_value(op.src[b]), op.src[a]
            if op is not x and s.op is Op.CAST and s.src[0].dtype == x.dtype:
                s = s.src[0]
            if c is None or c == 0:
                continue
            c = c if op.op is Op.MUL else 1.0 / c
            if _scores(s) is not None:
                return s, c
            if op is x and s.dtype == x.dtype:  # a chain of scalings: (s * a) / b
                inner, scale = _strip_scale(s)
                if inner is not s:
                    return inner, scale * c
    return x, 1.0


def _attention(ctx: Context, root: Node) -> Node | None:
    mm = root.src[0] if root.op is Op.VIEW else root
    if root.rank != 4 or mm.op is not Op.MATMUL or not root.dtype.is_float:
        return None
    probs, v = _rank4(mm.src[0]), _rank4(mm.src[1])
    if probs.op is not Op.SOFTMAX or probs.arg != 3 or ctx.uses(probs) > 1 or v.rank != 4:
        return None
    parts = _logits(probs.src[0])
    if parts is None:
        return None
    s, scale, cap, mask = parts
    qk = _scores(s)
    if qk is None:
        return None
    q, k, factors = qk[0], ctx.g.transpose(qk[1]), qk[2]
    scale *= factors
    if len({q.dtype, k.dtype, v.dtype, probs.dtype, root.dtype}) != 1:
        return None
    mask = strip_broadcast(mask) if mask is not None else None
    try:
        out = ctx.g.attention(q, k, v, mask, scale=scale, score_mod=softcap(cap) if cap else None)
    except (ShapeError, TypeError):  # a shape or dtype the op does not take: leave the template alone
        return None
    return out if out.shape == root.shape else None


RULES: list[Rule] = [(P(frozenset({Op.VIEW, Op.MATMUL}), name="root"), _attention)]

__all__ = ["RULES"]
