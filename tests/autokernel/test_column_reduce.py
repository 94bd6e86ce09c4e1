"""Column reductions (sums over leading axes, as weight gradients need) as library kernels."""

from __future__ import annotations

import pytest
import torch

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.partition import is_column_reduction
from kernelize.autokernel.plan import PlanSettings, plan
from kernelize.ir.graph import Graph, Op
from kernelize.ir.reference import evaluate
from kernelize.runtime.compiled import compile_graph


def _graph() -> Graph:
    g = Graph()
    x, dy = g.input("x", ("n", 24), "f32"), g.input("dy", ("n", 24), "f32")
    g.output(g.reduce(Op.SUM, g.mul(x, dy), 0), g.reduce(Op.SUM, g.exp(x), -1))
    return g


def test_only_leading_axis_sums_are_column_reductions() -> None:
    g = _graph()
    col, row = (o.src[0] for o in g.outputs)
    assert is_column_reduction(col) and not is_column_reduction(row)


def test_library_setting_moves_column_sums_to_torch() -> None:
    g = _graph()
    kernels = plan(g, PlanSettings(column_reduce="library")).kernels
    library = [k.node for k in kernels if k.kind is KernelKind.LIBRARY]
    assert [n.op for n in library] == [Op.SUM] and library[0].arg == (0,)
    generated = plan(g, PlanSettings()).kernels
    assert all(k.kind is not KernelKind.LIBRARY for k in generated)
    with pytest.raises(ValueError, match="column_reduce"):
        PlanSettings(column_reduce="fast")


@pytest.mark.parametrize("rows", [0, 1, 7, 129])
def test_cpu_backend_column_sums_match_reference(rows: int) -> None:
    g = _graph()
    x, dy = torch.randn(rows, 24), torch.randn(rows, 24)
    got = compile_graph(g, backend="cpu")(x, dy)
    for a, b in zip(got, evaluate(g, [x, dy])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
