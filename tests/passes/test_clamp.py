"""Clamp fusion."""

from __future__ import annotations

import math

import pytest
import torch

from kernelize.ir import Graph, Op, evaluate, verify
from kernelize.passes import clamp, dce


def run(build, dtype="f32"):
    g = Graph()
    x = g.input("x", (64,), dtype)
    g.output(build(g, x))
    out = dce(clamp(g))
    verify(out)
    t = torch.linspace(-10, 10, 64).to(getattr(torch, {"f32": "float32", "i32": "int32"}[dtype]))
    torch.testing.assert_close(evaluate(out, [t])[0], evaluate(g, [t])[0])
    return [n for n in out.nodes if n.op not in (Op.INPUT, Op.CONST, Op.VIEW, Op.BROADCAST)]


@pytest.mark.parametrize(
    "build,bounds",
    [
        (lambda g, x: g.max(x, 0.0), (0.0, math.inf)),
        (lambda g, x: g.min(6.0, x), (-math.inf, 6.0)),
        (lambda g, x: g.min(g.clamp(x, 0.0), 6.0), (0.0, 6.0)),  # relu6
        (lambda g, x: g.clamp(g.clamp(x, 0.0), 0.0), (0.0, math.inf)),  # relu(relu(x))
        (lambda g, x: g.max(g.min(g.max(x, -3.0), 5.0), -1.0), (-1.0, 5.0)),
        (lambda g, x: g.clamp(g.clamp(x, -1.0, 1.0), 2.0, 3.0), (2.0, 2.0)),  # disjoint bounds: all 2
        (
            lambda g, x: g.clamp(g.clamp(x, 2.0, 3.0), -1.0, 1.0),
            (2.0, 1.0),
        ),  # torch clamp: min(max(x, 2), 1) = 1
    ],
)
def test_chains_become_one_clamp(build, bounds):
    (node,) = run(build)
    assert node.op is Op.CLAMP and (node.arg.lo, node.arg.hi) == bounds


def test_min_max_with_tensors_or_ints_stay():
    assert [n.op for n in run(lambda g, x: g.max(x, g.neg(x)))] == [Op.NEG, Op.MAX]
    assert [n.op for n in run(lambda g, x: g.max(x, 0), dtype="i32")] == [Op.MAX]
