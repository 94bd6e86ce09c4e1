"""The text form of graphs."""

from __future__ import annotations

import torch

from kernelize.ir import Graph, format_graph, op_counts
from kernelize.ir.printer import format_node


def test_format_graph_golden():
    g = Graph()
    x = g.input("x", ("batch", 4), "f32")
    w = g.const(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    y = g.softmax(g.mul(x, w))
    g.output(y)
    assert format_graph(g) == "\n".join(
        [
            "graph(%0 x: f32[batch, 4]) {",
            "  %0 = input 'x' : f32[batch, 4]",
            "  %1 = const {[1.0, 2.0, 3.0, 4.0]} : f32[4]",
            "  %2 = view(%1) : f32[1, 4]",
            "  %3 = broadcast(%2) : f32[batch, 4]",
            "  %4 = mul(%0, %3) : f32[batch, 4]",
            "  %5 = softmax(%4) {1} : f32[batch, 4]",
            "  return %5",
            "}",
        ]
    )
    assert str(g) == format_graph(g)
    assert format_node(g, y) == "%5 = softmax(%4) {1} : f32[batch, 4]"


def test_large_constants_print_a_digest_and_op_counts_count():
    g = Graph()
    c = g.const(torch.zeros(100))
    g.output(g.exp(c), g.exp(c))
    assert "<100 values" in format_node(g, c)
    assert op_counts(g) == {"const": 1, "exp": 1}
