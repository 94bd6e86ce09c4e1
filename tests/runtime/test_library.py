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


def test_materialize_view_remembers_where_a_view_lies_and_checks_its_buffer():
    from kernelize.runtime.library import materialize_view

    g = Graph()
    x = g.input("x", (4, 6), "f32")
    view = g.transpose(g.slice(x, 1, 2, 6))  # a view of x through two layout ops
    flipped = g.flip(x, (1,))  # torch copies a flip: nothing to remember
    geometry: dict = {}
    t = torch.randn(4, 6)
    first = materialize_view(view, {x: t}, {}, geometry)
    assert torch.equal(first, t[:, 2:].t()) and set(geometry) == {view}
    assert torch.equal(materialize_view(flipped, {x: t}, {}, geometry), t.flip(1)) and flipped not in geometry
    u = torch.randn(4, 6)
    again = materialize_view(view, {x: u}, {}, geometry)  # rebuilt from the remembered geometry
    assert torch.equal(again, u[:, 2:].t()) and again.stride() == first.stride()
    wide = torch.randn(4, 9)[:, :6]  # another buffer layout: walked again, not rebuilt from the old one
    assert torch.equal(materialize_view(view, {x: wide}, {}, geometry), wide[:, 2:].t())
