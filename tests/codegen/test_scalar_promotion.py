"""Python scalars in 16-bit graphs follow torch's promotion: ``x * s`` and ``x / s`` compute in f32 with ``s``
at f32 precision and round once (``x / 1e5`` on f16 is not a division by f16's ``inf``); other ops round
``s`` to 16 bits first, as torch does on CPU. The reference executor matches eager torch bit for bit; the C++
backend and Triton (interpreter) match it within one 16-bit rounding."""

from __future__ import annotations

import math
import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelize.ir import evaluate, optimize, trace
from kernelize.ir.graph import Graph, Op
from kernelize.runtime.compiled import compile_graph

# no inf input: torch floor-divides inf to nan, the IR to inf (a separate, known difference)
X = [0.0, -0.0, 1.0, -1.0, 3.0, 0.1, 1000.0, 6e-8, 2.5e-5, 60000.0, -65504.0, 1e-3, -7.25]
EXTREME = [1e-8, 3.3e-5, 1e5, 7e4, 65504.0, 65520.0, 1e-45, 3e38, 1.0001, 1 / 3, 100001, -2.5e-7, 2**-24]
SCALARS = st.sampled_from(EXTREME) | st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)
OPS = {
    "mul": operator.mul,
    "rmul": lambda x, s: s * x,
    "div": operator.truediv,
    "rdiv": lambda x, s: s / x,
    "floordiv": lambda x, s: torch.div(x, s, rounding_mode="floor"),
    "truncdiv": lambda x, s: torch.div(x, s, rounding_mode="trunc"),
    "add": operator.add,
    "sub": operator.sub,
    "gt": operator.gt,
    "mul_0d": lambda x, s: x * torch.tensor(s),
}
CASES = st.lists(st.tuples(st.sampled_from(sorted(OPS)), SCALARS), min_size=1, max_size=5)
DTYPES = st.sampled_from([torch.float16, torch.bfloat16])


def _fn(case):
    def fn(x):
        return tuple(OPS[name](x, s) for name, s in case)

    return fn


def _same(got: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if not want.is_floating_point():
        assert torch.equal(got, want)
        return
    g, w = got.double(), want.double()
    if ulps == 0:
        assert torch.equal(g.nan_to_num(1.5), w.nan_to_num(1.5)), (got, want)
        return
    eps = torch.finfo(want.dtype).eps * ulps
    tiny = torch.finfo(want.dtype).smallest_normal * eps  # one subnormal step
    torch.testing.assert_close(g, w, rtol=eps, atol=tiny, equal_nan=True)


def test_division_by_a_large_scalar_is_not_zero():
    x = torch.tensor([1.0, 3.0, 1000.0, -7.25], dtype=torch.float16)
    for fn in (lambda x: x / 1e5, lambda x: x * 1e-8):
        g = trace(fn, x)
        (got,) = evaluate(g, [x])
        assert got.abs().max() > 0
        _same(got, fn(x))
        _same(compile_graph(optimize(g), backend="cpu", cache=False)(x)[0], fn(x), ulps=1)


def test_builder_scalars_keep_f32_precision_for_mul_and_div():
    g = Graph()
    h = g.input("h", (3,), "f16")
    y = g.div(h, 1e5)
    assert y.op is Op.CAST and y.src[0].op is Op.DIV and y.src[0].dtype == "f32"
    assert g.mul(h, 0.5).op is Op.MUL  # exact in f16: the plain rule, no casts
    assert g.add(h, 1e-8) is h  # add rounds the scalar like torch: 1e-8 is 0 in f16
    assert g.add(h, 1e-4).src[1].dtype == "f16"
    g.output(y, g.mul(1e-8, h))
    x = torch.tensor([1.0, 1000.0, -3.0], dtype=torch.float16)
    got = evaluate(g, [x])
    _same(got[0], x / 1e5)
    _same(got[1], 1e-8 * x)


@given(CASES, DTYPES)
def test_reference_matches_eager_bit_for_bit(case, dtype):
    x = torch.tensor(X, dtype=dtype)
    fn = _fn(case)
    g = trace(fn, x)
    for got, want in zip(evaluate(g, [x]), fn(x)):
        _same(got, want)
    for got, want in zip(evaluate(optimize(g), [x]), fn(x)):
        _same(got, want, ulps=1)  # optimized: x / s becomes x * (1 / s) in f32


def _backend_matches(backend: str, case, dtype) -> None:
    x = torch.tensor(X, dtype=dtype)
    fn = _fn(case)
    cg = compile_graph(optimize(trace(fn, x)), backend=backend, device="cpu", cache=False)
    for got, want in zip(cg(x), fn(x)):
        _same(got, want, ulps=1)


@settings(max_examples=8)
@given(CASES, DTYPES)
def test_cpu_backend_matches_eager(case, dtype):
    _backend_matches("cpu", case, dtype)


@settings(max_examples=6)
@given(CASES, DTYPES)
def test_triton_interpreter_matches_eager(case, dtype):
    _backend_matches("triton", case, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_with_an_inexact_scalar_is_still_recognised(dtype):
    x = torch.randn(4, 8).to(dtype)
    g = optimize(trace(lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), x))
    assert [n.op for n in g.nodes] == [Op.INPUT, Op.GELU]
