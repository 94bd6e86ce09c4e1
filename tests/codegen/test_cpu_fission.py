"""Loop fission of long sums in pointwise CPU kernels (:mod:`kernelize.codegen.cpu_fission`): sums over a
small non-last axis (unrolled into adds by the canon pass) render a loop per term; results match the
reference executor over inner pieces (rotary's rotation), chunked and symbolic inner axes, means and
16-bit / f64 dtypes, and sums too short to fission keep the one-loop form."""

from __future__ import annotations

import pytest
import torch

from kernelize.codegen.cpu_fission import FISSION_CHUNK, MIN_TERMS
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Op
from kernelize.ir.reference import evaluate
from kernelize.runtime.compiled import compile_graph

TOL = {DType.F32: 1e-5, DType.F64: 1e-12, DType.BF16: 2e-2, DType.F16: 2e-3}


def _check(g: Graph, xs: list[torch.Tensor], dtype: DType, fissioned: bool = True) -> None:
    cg = compile_graph(g, backend="cpu", cache=False)
    source = "\n".join(k.source for k in cg.kernels)
    assert ("kz_acc0[" in source) == fissioned
    for got, want in zip(cg(*xs), evaluate(g, xs)):
        tol = TOL[dtype]
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_rotary_cos_and_sin_gradients_share_the_term_loops(dtype):
    """Two sums over 16 heads of products with the rotated input (a concat on the inner axis: two pieces)."""
    heads, d = 16, 32
    g = Graph()
    x = g.input("x", ("n", heads, d), dtype)
    dy = g.input("dy", ("n", heads, d), dtype)
    lo, hi = g.slice(x, 2, 0, d // 2), g.slice(x, 2, d // 2, d)
    rot = g.concat([g.neg(hi), lo], 2)
    g.output(g.reduce(Op.SUM, g.mul(dy, x), 1), g.reduce(Op.SUM, g.mul(dy, rot), 1))
    cg = compile_graph(g, backend="cpu", cache=False)
    (kernel,) = [k for k in cg.kernels if "kz_acc0[" in k.source]
    assert "kz_acc1[" in kernel.source and kernel.source.count("#pragma omp simd") >= 2 * (heads - 1)
    xs = [torch.randn(5, heads, d).to(dtype.torch) for _ in range(2)]
    for got, want in zip(cg(*xs), evaluate(g, xs)):
        torch.testing.assert_close(got.double(), want.double(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("inner", [7, FISSION_CHUNK, FISSION_CHUNK + 3, 2 * FISSION_CHUNK + 129])
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16])
def test_chunked_inner_axis(inner, dtype):
    """Symbolic rows, static inner lengths around the chunk (a partial last chunk), an epilogue after the
    sum (a cast back to the 16-bit dtype, a scale)."""
    g = Graph()
    x = g.input("x", ("n", 6, inner), dtype)
    s = g.reduce(Op.SUM, g.exp(g.mul(x, g.scalar(0.5, dtype))), 1)
    g.output(g.mul(s, g.scalar(3.0, dtype)))
    _check(g, [torch.randn(3, 6, inner).to(dtype.torch)], dtype)


@pytest.mark.parametrize("dtype", [DType.F64, DType.F32])
def test_symbolic_inner_axis_and_mean(dtype):
    g = Graph()
    x = g.input("x", (MIN_TERMS, "d"), dtype)
    y = g.input("y", (MIN_TERMS, "d"), dtype)
    g.output(g.reduce(Op.MEAN, g.mul(x, y), 0))
    _check(g, [torch.randn(MIN_TERMS, 2 * FISSION_CHUNK + 5).to(dtype.torch) for _ in range(2)], dtype)


def test_short_sums_keep_one_loop():
    g = Graph()
    x = g.input("x", ("n", MIN_TERMS - 1, 40), DType.F32)
    g.output(g.reduce(Op.SUM, x, 1))
    _check(g, [torch.randn(4, MIN_TERMS - 1, 40)], DType.F32, fissioned=False)


def test_a_sum_of_different_tensors_keeps_one_loop():
    """Each term reads its own tensor in order: nothing for fission to fix."""
    g = Graph()
    xs = [g.input(f"x{i}", ("n", 40), DType.F32) for i in range(MIN_TERMS + 1)]
    total = xs[0]
    for x in xs[1:]:
        total = g.add(total, x)
    g.output(total)
    _check(g, [torch.randn(4, 40) for _ in xs], DType.F32, fissioned=False)
