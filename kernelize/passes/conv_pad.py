"""Zero padding before a convolution becomes the convolution's own padding; padding before a pool that
pads the same way (zeros counted by an average, -inf for a maximum) becomes the pool's.

Exporters often spell "same" padding as an explicit ``Pad`` node (TensorFlow-style asymmetric padding
in MobileNet / EfficientNet exports; torch's opset-9 export of ``count_include_pad`` average pools, as in
ShuffleNet); convolutions and pools pad on the fly, so the padded copy of the activation is never written
(ShuffleNet v1: three padded copies, ~0.5 ms of a ~5 ms run).

Example:
    before                                                   after
    %1 = pad(%0) {(((0,0), (0,0), (1,1), (1,1)), 0)}         %2 = conv(%0, %w) {(..., (1, 1, 1, 1), ...)}
    %2 = conv(%1, %w) {((1,1), (0,0,0,0), (1,1), 1)}
"""

from __future__ import annotations

import math

from kernelize.ir.graph import Graph, Node, Op
from kernelize.passes.rewrite import Context, P, Rule, Var, rewrite


def _spatial_pads(pad: Node) -> tuple[int, int, int, int] | None:
    """(top, left, bottom, right) of a pad of the two spatial dims of NCHW only, never cropping."""
    pads = pad.arg.pads
    if len(pads) != 4 or any(p != (0, 0) for p in pads[:2]):
        return None
    (top, bottom), (left, right) = pads[2], pads[3]
    return None if min(top, bottom, left, right) < 0 else (top, left, bottom, right)


def _fold_pad(ctx: Context, conv: Node, pad: Node, x: Node, w: Node) -> Node | None:
    pads = _spatial_pads(pad)
    if pad.arg.value != 0 or pads is None:
        return None
    top, left, bottom, right = pads
    a = conv.arg
    pt, pl, pb, pr = a.padding
    padding = (pt + top, pl + left, pb + bottom, pr + right)
    return ctx.g.conv(x, w, stride=a.stride, padding=padding, dilation=a.dilation, groups=a.groups)


# the pad value a pool's own padding stands for, by kind (an average's only where it counts the padding)
POOL_PAD = {"max": -math.inf, "avg": 0.0}


def _fold_pool_pad(ctx: Context, pool: Node, pad: Node, x: Node) -> Node | None:
    """Not in ceil mode, where a last window starting in the explicit padding is kept but one starting in
    the pool's own right padding is dropped; an average that does not count its own padding takes a pad
    only when it has none (then every window lies in the padded input and the two divisors agree)."""
    a, pads = pool.arg, _spatial_pads(pad)
    if pads is None or a.ceil_mode or pad.arg.value != POOL_PAD[a.kind]:
        return None
    if not a.count_pad and any(a.padding) and POOL_PAD[a.kind] == 0.0:
        return None
    padding = tuple(p + q for p, q in zip(a.padding, pads, strict=True))
    count = a.count_pad or POOL_PAD[a.kind] == 0.0
    y = ctx.g.pool(x, a.kind, a.kernel, a.stride, padding, a.dilation, count_include_pad=count)
    return y if y.shape == pool.shape else None


RULES: list[Rule] = [
    (P(Op.CONV, P(Op.PAD, Var("x"), name="pad"), Var("w"), name="conv"), _fold_pad),
    (P(Op.POOL, P(Op.PAD, Var("x"), name="pad"), name="pool"), _fold_pool_pad),
]


def conv_pad(graph: Graph) -> Graph:
    """Fold ``pad`` of the spatial dims into the ``conv`` or ``pool`` that reads it (a pure function)."""
    return rewrite(graph, RULES, "conv_pad")


__all__ = ["RULES", "conv_pad"]
