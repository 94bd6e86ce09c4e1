"""A 1x1 convolution over a 1x1 image becomes a matmul.

Squeeze-and-excite blocks (EfficientNet, RegNetY, MobileNetV3) run two 1x1 convolutions on the pooled
``[N, C, 1, 1]`` activation: matrix-vector products of a few kilobytes of work, where a library convolution
costs its fixed overhead (measured ~50-90 us per call through oneDNN on this machine). As a matmul the
planner fuses the bias and activation into one matmul kernel, the few-row kernel for up to 16 images.

Example:
    before (%0: f32[N, C, 1, 1], %w: f32[O, C, 1, 1])
    %2 = conv(%0, %w) {((1,1), (0,0,0,0), (1,1), 1)}
    after
    %4 = matmul(view(%0) [N, C], transpose(view(%w) [O, C]))
    %5 = view(%4) [N, O, 1, 1]
"""

from __future__ import annotations

from kernelize.ir.graph import Graph, Node, Op
from kernelize.passes.rewrite import Context, P, Rule, Var, rewrite


def _as_matmul(ctx: Context, conv: Node, x: Node, w: Node) -> Node | None:
    n, c, h, wd = x.shape
    o = w.shape[0]
    if conv.arg.groups != 1 or any(conv.arg.padding) or (h, wd) != (1, 1) or tuple(w.shape[2:]) != (1, 1):
        return None
    g = ctx.g
    y = g.matmul(g.view(x, (n, c)), g.transpose(g.view(w, (o, c))))
    return g.view(y, (n, o, 1, 1))


RULES: list[Rule] = [
    (P(Op.CONV, Var("x"), Var("w"), name="conv"), _as_matmul),
]


def conv_matmul(graph: Graph) -> Graph:
    """Rewrite 1x1 convolutions of a 1x1 image as matmuls (a pure function)."""
    return rewrite(graph, RULES, "conv_matmul")


__all__ = ["RULES", "conv_matmul"]
