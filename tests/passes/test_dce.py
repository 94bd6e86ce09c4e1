"""Dead-code elimination."""

from __future__ import annotations

import torch

from kernelize.ir import Graph, Op, evaluate, verify
from kernelize.passes import dce
from kernelize.passes.dce import live_nodes


def test_dce_drops_dead_nodes_and_keeps_unused_inputs():
    g = Graph()
    x = g.input("x", (4,), "f32")
    unused = g.input("unused", (2,), "f32")
    g.exp(x)
    g.reduce(Op.SUM, g.neg(unused), 0)
    y = g.add(g.neg(x), 1.0)
    g.output(y)
    out = dce(g)
    verify(out)
    assert [n.op for n in out.nodes] == [Op.INPUT, Op.INPUT, Op.NEG, Op.CONST, Op.VIEW, Op.BROADCAST, Op.ADD]
    assert [i.arg for i in out.inputs] == ["x", "unused"]
    a, b = torch.randn(4), torch.randn(2)
    torch.testing.assert_close(evaluate(out, [a, b])[0], evaluate(g, [a, b])[0])
    assert len(g) == 11  # the input graph is untouched


def test_live_nodes_of_a_deep_chain():
    g = Graph()
    v = g.input("x", (2,), "f32")
    for _ in range(3000):
        v = g.tanh(v)
    g.exp(v)  # dead
    g.output(v)
    assert len(live_nodes(g)) == 3001
    assert len(dce(g)) == 3001
