"""Issue 4's "done when": traced layers run through trace -> optimize -> plan -> Triton, each as one fused
kernel, under the interpreter; and random graphs differentially against ``ir.evaluate``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton_layers import corpus
from triton_specs import TOL, assert_close, randn

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.plan import PlanSettings, plan
from kernelize.ir import evaluate, optimize, trace
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Op
from kernelize.runtime import compile_graph

EXPECTED = {  # kinds of the planned kernels: one fused kernel each (the matmul carries its epilogue)
    "rmsnorm": ["row"],
    "add_rmsnorm": ["row"],
    "layernorm": ["row"],
    "silu_and_mul": ["pointwise"],
    "gelu_and_mul": ["pointwise"],
    "softmax": ["row"],
    "rotary": ["pointwise"],
    "linear_relu": ["matmul"],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_corpus_fuses_to_one_kernel_and_matches(dtype):
    for name, module, inputs in corpus(dtype):
        g = optimize(trace(module, *inputs, dynamic_dims={0: "batch"}))
        cg = compile_graph(g, backend="triton", device="cpu")
        assert [str(k.kind) for k in cg.plan.kernels] == EXPECTED[name], (name, str(cg.plan))
        for batch in (4, 3):  # one compiled kernel serves every batch size
            xs = [x[:batch].contiguous() for x in inputs]
            got = cg(*xs)
            with torch.no_grad():
                want = module(*xs)
            want = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype, name
                rtol, atol = TOL[DType.from_torch(dtype)]
                torch.testing.assert_close(a.float(), b.float(), rtol=rtol * 4, atol=atol * 4, msg=name)
        assert all("s_batch" in k.source for k in cg.kernels), name


def test_linear_as_library_matmul_plus_fused_epilogue():
    """PlanSettings(matmul="library"): torch runs the matmul, bias + relu is one generated kernel."""
    name, module, inputs = corpus()[-1]
    g = optimize(trace(module, *inputs))
    p = plan(g, PlanSettings(matmul="library"))
    assert [k.kind for k in p.kernels] == [KernelKind.LIBRARY, KernelKind.POINTWISE]
    cg = compile_graph(g, backend="triton", device="cpu", plan=p)
    assert len(cg.kernels) == 1
    torch.testing.assert_close(cg(*inputs)[0], module(*inputs))


# -- random graphs ---------------------------------------------------------------------------------------
SHAPES = [(1,), (7,), (33, 7), (4097,), (3, 33), (0, 5), (2, 7, 33), (5, 1, 7)]
STEPS = [
    "unary",
    "binary_full",
    "binary_bcast",
    "reduce",
    "softmax",
    "rmsnorm",
    "layernorm",
    "permute",
    "slice",
    "matmul",
]
DT_TOL = {DType.F32: (1e-4, 1e-4), DType.F16: (2e-2, 2e-2), DType.BF16: (6e-2, 6e-2)}


def _random_graph(shape, dtype: DType, steps, axes):
    g = Graph()
    x = g.input("x", shape, dtype)
    w = g.input("w", shape, dtype)
    v = x
    for step, ax in zip(steps, axes):
        rank = len(v.shape)
        axis = ax % rank
        empty = 0 in v.shape
        if step == "unary":
            v = g.tanh(v) if ax % 3 == 0 else g.sigmoid(v) if ax % 3 == 1 else g.neg(g.abs(v))
        elif step == "binary_full" and v.shape == w.shape:
            v = g.add(g.mul(v, w), v)
        elif step == "binary_bcast":
            b = g.slice(w, 0, 0, 1) if w.shape[0] != 0 and w.shape[-1] == v.shape[-1] else None
            v = g.sub(v, g.view(b, b.shape[1:])) if b is not None and len(b.shape) > 1 else g.mul(v, 0.5)
        elif step == "reduce" and not empty:
            op = [Op.SUM, Op.MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN][ax % 4]
            v = g.sub(v, g.reduce(op, v, axis, keepdim=True))
        elif step == "softmax":
            v = g.softmax(v, axis)
        elif step == "rmsnorm":
            v = g.rmsnorm(v, None, 1e-5)
        elif step == "layernorm":
            v = g.layernorm(v, None, None, 1e-5)
        elif step == "permute" and rank > 1:
            v = g.transpose(v, 0, -1)
        elif step == "slice" and v.shape[axis] > 2:
            v = g.slice(v, axis, 1, None, 2)
        elif step == "matmul" and v.shape[-1] != 0:
            mw = g.const(torch.randn(v.shape[-1], 8, generator=torch.Generator().manual_seed(ax)), dtype)
            v = g.gelu(g.add(g.matmul(v, mw), 1.0))
    g.output(v)
    return g


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from([DType.F32, DType.F16, DType.BF16]),
    steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=4),
    axes=st.lists(st.integers(0, 11), min_size=4, max_size=4),
    noncontig=st.booleans(),
)
def test_random_graphs_match_reference(shape, dtype, steps, axes, noncontig):
    g = _random_graph(shape, dtype, steps, axes)
    gen = torch.Generator().manual_seed(1)
    xs = [randn(shape, dtype, gen) for _ in range(2)]
    if noncontig and len(shape) > 1:  # same values, transposed storage: the runtime makes them contiguous
        xs = [x.transpose(0, -1).contiguous().transpose(0, -1) for x in xs]
    want = evaluate(g, xs)
    got = compile_graph(optimize(g), backend="triton", device="cpu")(*xs)
    rtol, atol = DT_TOL[dtype]
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True)


def test_assert_close_helper_catches_differences():
    with pytest.raises(AssertionError):
        assert_close(torch.ones(3), torch.zeros(3), DType.F32)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled (not interpreted) Triton",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layer_corpus_on_gpu(dtype):
    for name, module, inputs in corpus(dtype):
        module = module.cuda()
        inputs = [x.cuda() for x in inputs]
        g = optimize(trace(module, *inputs, dynamic_dims={0: "batch"}))
        got = compile_graph(g, backend="triton", device="cuda")(*inputs)
        with torch.no_grad():
            want = module(*inputs)
        want = want if isinstance(want, tuple) else (want,)
        rtol, atol = TOL[DType.from_torch(dtype)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol * 4, atol=atol * 4, msg=name)
