"""Zero padding before a convolution becomes the convolution's own padding.

Exporters often spell "same" padding as an explicit ``Pad`` node (TensorFlow-style asymmetric padding
in MobileNet / EfficientNet exports); a library convolution pads on the fly, so the padded copy of the
activation is never written.

Example:
    before                                                   after
    %1 = pad(%0) {(((0,0), (0,0), (1,1), (1,1)), 0)}         %2 = conv(%0, %w) {(..., (1, 1, 1, 1), ...)}
    %2 = conv(%1, %w) {((1,1), (0,0,0,0), (1,1), 1)}
"""

from __future__ import annotations

from kernelize.ir.graph import Graph, Node, Op
from kernelize.passes.rewrite import Context, P, Rule, Var, rewrite


def _fold_pad(ctx: Context, conv: Node, pad: Node, x: Node, w: Node) -> Node | None:
    pads = pad.arg.pads
    if pad.arg.value != 0 or len(pads) != 4 or any(p != (0, 0) for p in pads[:2]):
        return None
    (top, bottom), (left, right) = pads[2], pads[3]
    if min(top, bottom, left, right) < 0:
        return None  # a negative pad crops: not a convolution padding
    a = conv.arg
    pt, pl, pb, pr = a.padding
    padding = (pt + top, pl + left, pb + bottom, pr + right)
    return ctx.g.conv(x, w, stride=a.stride, padding=padding, dilation=a.dilation, groups=a.groups)


RULES: list[Rule] = [
    (P(Op.CONV, P(Op.PAD, Var("x"), name="pad"), Var("w"), name="conv"), _fold_pad),
]


def conv_pad(graph: Graph) -> Graph:
    """Fold zero ``pad`` of the spatial dims into the ``conv`` that reads it (a pure function)."""
    return rewrite(graph, RULES, "conv_pad")


__all__ = ["RULES", "conv_pad"]
