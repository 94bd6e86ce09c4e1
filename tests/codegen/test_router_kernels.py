"""The ROUTER kernels (:mod:`kernelize.codegen.router`) against the reference executor on awkward shapes: E
not a multiple of any vector width, K = 1, K = E, ties, f32 and bf16 logits, a choice bias, the renorms. The
CPU C++ runs as built, Triton under the interpreter, the CUDA C through the host emulation; Triton lowers to
PTX / cubin and the CUDA C to NVRTC cubins for sm_80 and sm_90."""

from __future__ import annotations

import pytest
import torch

from kernelize.autokernel.kernels import RouterKernel
from kernelize.autokernel.plan import plan
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph
from kernelize.ir.reference import evaluate
from kernelize.runtime.compiled import compile_graph, make_backend

# (rows, E, K, logits dtype, score, renorm, bias, scale)
CASES = [
    (5, 13, 3, "f32", "softmax", "sum", False, 1.0),
    (1, 60, 8, "bf16", "softmax", "sum", False, 1.0),
    (3, 7, 1, "f32", "sigmoid", "none", True, 2.5),
    (4, 9, 9, "f32", "none", "softmax", False, 1.0),
    (2, 33, 4, "bf16", "sigmoid", "sum", True, 1.0),
    (6, 128, 8, "f32", "softmax", "none", False, 1.0),
]


def router_graph(
    e: int, k: int, dtype: str, score: str, renorm: str, bias: bool, scale: float, out: str = "f32"
):
    g = Graph()
    x = g.input("x", ("rows", e), dtype)
    b = g.input("b", (e,), "f32") if bias else None
    w, i = g.route(x, k, b, dtype=out, score=score, renorm=renorm, scale=scale)
    g.output(w, i)
    return g


def operands(rows: int, e: int, dtype: str, bias: bool, ties: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + e)
    x = torch.randn(rows, e, generator=gen)
    if ties:  # whole rows of few distinct values: every pick is a tie broken by the index
        x = (x * 2).round() / 2
    ops = [x.to(DType(dtype).torch)]
    return ops + ([torch.randn(e, generator=gen) * 0.1] if bias else [])


def router_kernel(g: Graph) -> RouterKernel:
    (k,) = [k for k in plan(g).kernels if isinstance(k, RouterKernel)]
    assert len(k.writes) == 2  # the two twins run as one kernel
    return k


def check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert torch.equal(got[1], want[1]), (got[1], want[1])  # indices exactly, ties included
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_cpu_matches_reference(case, ties):
    rows, e, k, dtype, score, renorm, bias, scale = case
    g = router_graph(e, k, dtype, score, renorm, bias, scale)
    ops = operands(rows, e, dtype, bias, ties)
    check(compile_graph(g, backend="cpu")(*ops), evaluate(g, ops))


def test_cpu_writes_bf16_weights_and_one_twin_alone():
    g = router_graph(20, 4, "bf16", "softmax", "sum", False, 1.0, out="bf16")
    ops = operands(3, 20, "bf16", False)
    check(compile_graph(g, backend="cpu")(*ops), evaluate(g, ops))
    only = Graph()
    x = only.input("x", ("rows", 20), "bf16")
    only.output(only.route(x, 4)[1])
    (k,) = plan(only).kernels
    assert isinstance(k, RouterKernel) and k.weights is None
    assert torch.equal(compile_graph(only, backend="cpu")(ops[0])[0], evaluate(only, ops[:1])[0])


@pytest.mark.parametrize("case", CASES[:5])
def test_triton_interpreter_matches_reference(case, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows, e, k, dtype, score, renorm, bias, scale = case
    g = router_graph(e, k, dtype, score, renorm, bias, scale)
    ops = operands(rows, e, dtype, bias, ties=True)
    kernel = router_kernel(g)
    writes = [torch.empty(rows, k, dtype=n.dtype.torch) for n in kernel.writes]
    make_backend("triton").compile(kernel).launch(ops, writes, {"rows": rows})
    check(writes, evaluate(g, ops))


@pytest.mark.parametrize("case", CASES)
def test_cuda_emulated_matches_reference(case):
    from cuda_emu import emulate_router

    rows, e, k, dtype, score, renorm, bias, scale = case
    g = router_graph(e, k, dtype, score, renorm, bias, scale)
    ops = operands(rows, e, dtype, bias, ties=True)
    kernel = router_kernel(g)
    writes = [torch.empty(rows, k, dtype=n.dtype.torch) for n in kernel.writes]
    emulate_router(kernel, ops, writes)
    check(writes, evaluate(g, ops))


def test_triton_lowers_to_ptx_and_cubin_for_sm80_and_sm90():
    pytest.importorskip("triton")
    from kernelize.codegen.router import render_triton, triton_aot_job
    from kernelize.codegen.triton_aot import run_jobs
    from kernelize.codegen.triton_base import module_file

    kernel = router_kernel(router_graph(60, 8, "bf16", "softmax", "sum", False, 1.0, out="bf16"))
    path = str(module_file(render_triton(kernel), kernel.name))
    results = run_jobs([triton_aot_job(kernel, arch, path) for arch in (80, 90)])
    for arch, r in zip((80, 90), results, strict=True):
        assert r["cubin"][:4] == b"\x7fELF" and f".target sm_{arch}" in r["ptx"]


def test_cuda_nvrtc_cubins_for_sm80_and_sm90():
    nvrtc = pytest.importorskip("kernelize.codegen.nvrtc")
    pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python")
    from kernelize.codegen.router import render_cuda

    for case in (CASES[1], CASES[4]):
        rows, e, k, dtype, score, renorm, bias, scale = case
        source, name = render_cuda(
            router_kernel(router_graph(e, k, dtype, score, renorm, bias, scale, "bf16"))
        )
        for arch in ("sm_80", "sm_90"):
            assert nvrtc.compile_cubin(source, name, arch, cache=False)[:4] == b"\x7fELF"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_router_matches_reference(backend):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the lead runs this on a lent GPU")
    for case in CASES:
        rows, e, k, dtype, score, renorm, bias, scale = case
        g = router_graph(e, k, dtype, score, renorm, bias, scale)
        ops = operands(rows, e, dtype, bias, ties=True)
        got = compile_graph(g, backend=backend)(*(o.cuda() for o in ops))
        check([t.cpu() for t in got], evaluate(g, ops))
