"""Column reductions (sums over leading axes, as weight gradients need): library kernels, and column sums
accumulated inside the row kernel computing their operand."""

from __future__ import annotations

import pytest
import torch
from spec_interpreter import run

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.partition import ACCUMULATE_MAX_COLUMNS, is_column_reduction
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


# ---- column sums accumulated inside row kernels (PlanSettings(column_reduce="accumulate"), the cpu's) -----
ACCUMULATE = PlanSettings(column_reduce="accumulate")


def _norm_backward() -> Graph:
    """RMSNorm's backward as autodiff writes it: dx by a row reduction, dw = sum over rows of dy * xhat."""
    g = Graph()
    x, w = g.input("x", ("n", 37), "f32"), g.input("w", (37,), "f32")
    rstd, dy = g.input("rstd", ("n", 1), "f32"), g.input("dy", ("n", 37), "f32")
    full = x.shape
    xhat = g.mul(x, g.broadcast(rstd, full))
    dyw = g.mul(dy, g.broadcast(g.view(w, (1, 37)), full))
    mean = g.reduce(Op.MEAN, g.mul(dyw, xhat), 1, keepdim=True)
    dx = g.mul(g.broadcast(rstd, full), g.sub(dyw, g.mul(xhat, g.broadcast(mean, full))))
    g.output(dx, g.reduce(Op.SUM, g.mul(dy, xhat), 0), g.reduce(Op.SUM, dy, 0))
    return g


def test_accumulate_puts_column_sums_into_the_row_kernel() -> None:
    p = plan(_norm_backward(), ACCUMULATE)
    (k,) = p.kernels
    assert k.kind is KernelKind.ROW
    # dx and the two column sums are stored; dy * xhat is never written
    assert [b.shape for b in k.writes].count((1, 37)) == 2 and len(k.writes) == 3
    assert all(s.strides[0] == 0 for s in k.stores if s.buffer.shape == (1, 37)), (
        "column sums are stored once, not per row"
    )


@pytest.mark.parametrize("rows", [1, 6])
def test_accumulated_plan_matches_reference_under_the_spec_interpreter(rows: int) -> None:
    g = _norm_backward()
    ins = [torch.randn(rows, 37), torch.randn(37), torch.rand(rows, 1) + 0.5, torch.randn(rows, 37)]
    for a, b in zip(run(plan(g, ACCUMULATE), ins), evaluate(g, ins)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_accumulate_sends_other_column_sums_to_the_library() -> None:
    g = Graph()
    x = g.input("x", ("n", "m", 24), "f32")
    g.output(g.reduce(Op.SUM, g.exp(x), 1))  # a middle axis: no leading run
    kinds = [k.kind for k in plan(g, ACCUMULATE).kernels]
    assert KernelKind.LIBRARY in kinds


def test_a_value_reading_a_column_sum_is_computed_after_it() -> None:
    """A column sum is complete only after every row: nothing in its kernel may read it."""
    g = Graph()
    x = g.input("x", ("n", 24), "f32")
    s = g.reduce(Op.SUM, g.exp(x), 0, keepdim=True)
    g.output(g.mul(x, g.broadcast(s, x.shape)))
    p = plan(g, ACCUMULATE)
    assert len(p.kernels) == 2
    xs = torch.randn(9, 24)
    torch.testing.assert_close(
        compile_graph(g, backend="cpu")(xs)[0], xs * xs.exp().sum(0), rtol=1e-5, atol=1e-5
    )


def _columns(shape: tuple, axes: tuple[int, ...], dtype: str, op: Op) -> Graph:
    g = Graph()
    x, dy = g.input("x", shape, dtype), g.input("dy", shape, dtype)
    g.output(g.reduce(op, g.mul(g.sin(x), dy), axes), g.reduce(op, dy, axes), g.mul(x, dy))
    return g


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 65, 1000])
@pytest.mark.parametrize("width", [1, 5, 37, 64])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f64"])
def test_cpu_column_sums_match_reference(rows: int, width: int, dtype: str) -> None:
    g = _columns(("n", width), (0,), dtype, Op.SUM)
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}[dtype]
    x, dy = torch.randn(rows, width, dtype=tdt), torch.randn(rows, width, dtype=tdt)
    cg = compile_graph(g, backend="cpu")
    assert not any(k.kind is KernelKind.LIBRARY for k in cg.plan.kernels)
    tol = {"f32": 1e-5, "bf16": 2e-2, "f64": 1e-10}[dtype] * (1 + rows**0.5)
    for a, b in zip(cg(x, dy), evaluate(g, [x, dy])):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("op", [Op.SUM, Op.MEAN])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_cpu_column_sums_over_two_leading_axes(op: Op, batch: int) -> None:
    g = _columns(("b", "s", 13), (0, 1), "f32", op)
    x, dy = torch.randn(batch, 7, 13), torch.randn(batch, 7, 13)
    got = compile_graph(g, backend="cpu")(x, dy)
    for a, b in zip(got, evaluate(g, [x, dy])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_column_sums_with_any_team(threads: int) -> None:
    """More threads than rows, and teams that split rows unevenly, add up every row once."""
    g = _norm_backward()
    ins = [torch.randn(5, 37), torch.randn(37), torch.rand(5, 1) + 0.5, torch.randn(5, 37)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = compile_graph(g, backend="cpu")(*ins)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(got, evaluate(g, ins)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_accumulate_leaves_long_or_symbolic_rows_to_the_library() -> None:
    """Per-thread partials of a very long (or unknown) row would not stay in cache: torch sums those."""
    g = Graph()
    x = g.input("x", ("n", "m"), "f32")
    y = g.input("y", ("n", ACCUMULATE_MAX_COLUMNS + 1), "f32")
    g.output(g.reduce(Op.SUM, g.exp(x), 0), g.reduce(Op.SUM, g.exp(y), 0))
    kinds = [k.kind for k in plan(g, ACCUMULATE).kernels]
    assert kinds.count(KernelKind.LIBRARY) == 2
