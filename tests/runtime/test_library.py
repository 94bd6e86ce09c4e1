"""Library kernels run with the reference ops (``kernelize.runtime.library``): the tests' plan oracle."""

from __future__ import annotations

import torch

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.plan import PlanSettings, plan
from kernelize.ir import Graph, evaluate
from kernelize.runtime.library import library_operands, materialize, run_library


def test_a_library_matmul_reads_its_operands_through_their_views():
    g = Graph()
    a, b = g.input("a", (3, 5), "f32"), g.input("b", (4, 5), "f32")
    g.output(g.matmul(a, g.transpose(b)))
    (k,) = [k for k in plan(g, PlanSettings(matmul="library")).kernels if k.kind is KernelKind.LIBRARY]
    x, y = torch.randn(3, 5), torch.randn(4, 5)
    values = {g.inputs[0]: x, g.inputs[1]: y}
    ops = library_operands(k, values, {})
    assert torch.equal(ops[1], y.t()) and len(values) == 2  # the caller's values are left alone
    torch.testing.assert_close(run_library(k, values, {}), evaluate(g, [x, y])[0])


def test_materialize_computes_views_and_constants_without_recursion():
    g = Graph()
    x = g.input("x", (2, 3), "f32")
    deep = x
    for _ in range(3000):  # a chain of views deeper than Python's recursion limit
        deep = g.flip(deep, (1,))
    t = torch.randn(2, 3)
    vals = {x: t}
    out = materialize(deep, vals, {})
    assert torch.equal(out, t) and len(vals) == 3001  # every view on the way is kept for later readers
