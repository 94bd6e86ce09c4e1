"""Backward graphs (IR autodiff, forward/backward split) planned and generated like forward ones on the GPU
backends: Triton under the interpreter and CUDA C under host emulation, against the reference executor;
their kernels compile to cubins (Triton AOT for sm_90, NVRTC for sm_90)."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from cuda_emu import run_plan

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.plan import plan
from kernelize.ir import evaluate, optimize, trace
from kernelize.ir.autodiff import split, vjp
from kernelize.runtime import compile_graph


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def layer_norm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def softmax(x):
    return torch.softmax(x * 0.5, dim=-1)


def rotary(x, cos, sin):
    """NeoX rotary over a flat hidden of 3 heads: cos / sin gradients are sums over the heads."""
    t, d = x.shape[0], cos.shape[-1]
    xh = x.view(t, -1, d)
    rot = torch.cat((-xh[..., d // 2 :], xh[..., : d // 2]), dim=-1)
    return (xh * cos[:, None, :] + rot * sin[:, None, :]).view(t, -1)


H = 32
CASES = {
    "rms_norm": (rms_norm, [(7, H), (H,)]),
    "layer_norm": (layer_norm, [(7, H), (H,), (H,)]),
    "silu_and_mul": (silu_and_mul, [(7, 2 * H)]),
    "gelu_tanh": (gelu_tanh, [(7, H)]),
    "softmax": (softmax, [(7, H)]),
    "rotary": (rotary, [(7, 3 * 16), (7, 16), (7, 16)]),
}


@functools.cache
def graphs(name: str, dtype: torch.dtype = torch.float32):
    """(forward graph, backward graph, primals_read, n_saved) of a case, both optimized."""
    fn, shapes = CASES[name]
    inputs = [torch.randn(s, dtype=dtype) for s in shapes]
    dyn = [{0: "n"} if len(s) == 2 else None for s in shapes]
    cut = split(vjp(optimize(trace(fn, *inputs, dynamic_dims=dyn))))
    return optimize(cut.forward), optimize(cut.backward), cut.primals_read, cut.saved_index


def _inputs(name: str, rows: int, dtype: torch.dtype):
    fn, shapes = CASES[name]
    gen = torch.Generator().manual_seed(rows)
    xs = [torch.randn((rows, *s[1:]) if len(s) == 2 else s, generator=gen).to(dtype) for s in shapes]
    fwd, _, read, saved = graphs(name, dtype)
    outs = evaluate(fwd, xs)
    n_out = len(CASES[name][0](*xs)) if isinstance(CASES[name][0](*xs), tuple) else 1
    cts = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs[:n_out]]
    return xs, [*(xs[i] for i in read), *(outs[i] for i in saved), *cts]


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreter_runs_forward_and_backward(name: str, rows: int) -> None:
    fwd, bwd, _, _ = graphs(name)
    xs, bwd_in = _inputs(name, rows, torch.float32)
    for graph, inputs in ((fwd, xs), (bwd, bwd_in)):
        got = compile_graph(graph, backend="triton", device="cpu")(*inputs)
        for a, b in zip(got, evaluate(graph, inputs)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_host_emulation_runs_backward(name: str, dtype: torch.dtype) -> None:
    _, bwd, _, _ = graphs(name, dtype)
    _, bwd_in = _inputs(name, 7, dtype)
    p = plan(bwd)
    assert any(k.kind is not KernelKind.LIBRARY for k in p.kernels)
    got = run_plan(p, bwd_in)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, evaluate(bwd, bwd_in)):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_backward_under_triton_interpreter(dtype: torch.dtype) -> None:
    """dx is one kernel, d cos and d sin (sums over the heads, through casts in bf16) share another."""
    _, bwd, _, _ = graphs("rotary", dtype)
    _, bwd_in = _inputs("rotary", 7, dtype)
    cg = compile_graph(bwd, backend="triton", device="cpu")
    assert sorted(len(k.writes) for k in cg.plan.kernels) == [1, 2], cg.plan
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(cg(*bwd_in), evaluate(bwd, bwd_in)):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * 4)


def test_weight_gradient_column_sums_are_generated_on_gpu_backends() -> None:
    """The dweight of a norm is a sum over rows: on the GPU backends it is a generated ROW kernel."""
    _, bwd, _, _ = graphs("layer_norm")
    kinds = [k.kind for k in plan(bwd).kernels]
    assert KernelKind.LIBRARY not in kinds and kinds.count(KernelKind.ROW) >= 2


def _backward_kernels():
    return [
        k
        for name in CASES
        for graph in graphs(name)[:2]
        for k in plan(graph).kernels
        if k.kind not in (KernelKind.LIBRARY, KernelKind.CONV)
    ]


def test_backward_kernels_compile_to_cubin_with_triton_aot() -> None:
    from kernelize.codegen import triton_aot

    kernels = _backward_kernels()
    for k, per_arch in zip(kernels, triton_aot.compile_ahead_many(kernels, archs=(90,))):
        assert per_arch[90]["cubin"][:4] == b"\x7fELF", k.name


def test_backward_kernels_compile_to_cubin_with_nvrtc() -> None:
    pytest.importorskip(
        "cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python: pip install '.[cuda]'"
    )
    from kernelize.codegen import nvrtc
    from kernelize.codegen.cuda import render

    for k in _backward_kernels():
        src = render(k)
        assert nvrtc.compile_cubin(src.source, src.name, "sm_90")[:4] == b"\x7fELF", k.name


def _slices_graph(dtype: str, width: int):
    """Pieces of a concat computed in one kernel and stored into slices of the output (an activation's
    gradient has this form: ``[d gate, d up]``)."""
    from kernelize.ir import Graph

    g = Graph()
    x = g.input("x", ("n", 2 * width), dtype)
    gy = g.input("gy", ("n", width), dtype)
    gate, up = g.slice(x, 1, 0, width), g.slice(x, 1, width, 2 * width)
    g.output(g.concat([g.mul(g.sigmoid(gate), gy), g.mul(up, gy), g.exp(gate)], 1))
    return g


def _slice_inputs(rows: int, width: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows)
    return [
        torch.randn(rows, 2 * width, generator=gen).to(dtype),
        torch.randn(rows, width, generator=gen).to(dtype),
    ]


def _assert_slices_planned(graph) -> None:
    p = plan(graph)
    assert len(p.kernels) == 1 and len(p.kernels[0].stores) == 3, p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 4097])
def test_slice_stores_on_cpu(rows: int, dtype: torch.dtype) -> None:
    g = _slices_graph(
        str(dtype).removeprefix("torch.").replace("float32", "f32").replace("bfloat16", "bf16"), 33
    )
    _assert_slices_planned(g)
    xs = _slice_inputs(rows, 33, dtype)
    got = compile_graph(g, backend="cpu")(*xs)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the reference rounds every bf16 intermediate
    torch.testing.assert_close(got.float(), evaluate(g, xs)[0].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 7])
def test_slice_stores_under_triton_interpreter(rows: int) -> None:
    g = _slices_graph("f32", 33)
    xs = _slice_inputs(rows, 33, torch.float32)
    got = compile_graph(g, backend="triton", device="cpu")(*xs)[0]
    torch.testing.assert_close(got, evaluate(g, xs)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slice_stores_under_cuda_host_emulation(dtype: torch.dtype) -> None:
    g = _slices_graph("f32" if dtype == torch.float32 else "bf16", 33)
    xs = _slice_inputs(7, 33, dtype)
    got = run_plan(plan(g), xs)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), evaluate(g, xs)[0].float(), rtol=tol, atol=tol)


def test_slice_store_kernels_compile_to_cubin() -> None:
    from kernelize.codegen import triton_aot

    (k,) = plan(_slices_graph("bf16", 33)).kernels
    assert triton_aot.compile_ahead_many([k], archs=(80, 90))[0][90]["cubin"][:4] == b"\x7fELF"
    if importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None:
        from kernelize.codegen import nvrtc
        from kernelize.codegen.cuda import render

        src = render(k)
        for arch in ("sm_80", "sm_90"):
            assert nvrtc.compile_cubin(src.source, src.name, arch)[:4] == b"\x7fELF"
