"""NVRTC compilation of the generated CUDA C (real NVRTC, no GPU needed) and the driver launch path.

Every kernel of the layer corpus compiles to a cubin for sm_80 and sm_90; a compile failure carries the
NVRTC log and the numbered source; cubins are cached on disk; launching without a driver says so clearly.
``@pytest.mark.cuda`` tests launch on a real GPU and compare with the reference.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python: pip install '.[cuda]'")

from cuda_emu import pointwise_kernel  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from test_cuda import (  # noqa: E402
    LAYERS,
    PLANNED,
    SIZES,
    corpus_inputs,
    elementwise_case,
    gather_kernel,
    oracle,
    planned,
)

from kernelize.autokernel.kernels import Compute, KernelKind, Load, RowKernel, Store  # noqa: E402
from kernelize.codegen import nvrtc  # noqa: E402
from kernelize.codegen.cuda import CudaBackend, render  # noqa: E402
from kernelize.ir.dtypes import DType  # noqa: E402
from kernelize.ir.graph import Graph, Op
from kernelize.ir.ops import NormArgs  # noqa: E402
from kernelize.ir.shapes import (
    Sym,  # noqa: E402
    bind,  # noqa: E402
)
from kernelize.runtime.backend import KernelCompileError  # noqa: E402

HAS_GPU = torch.cuda.is_available() and nvrtc.driver_error() is None
GPU_REASON = f"needs an NVIDIA GPU and driver ({nvrtc.driver_error() or 'no GPU visible to torch'})"

CORPUS = [(layer, dtype) for layer in sorted(LAYERS) for dtype in (DType.F32, DType.F16, DType.BF16)]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # one cache folder for this session: the first compile fills it, reruns within the session hit it
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kz-cache"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("layer,dtype", CORPUS, ids=[f"{a}-{b}" for a, b in CORPUS])
def test_corpus_compiles_to_cubin(layer, dtype, arch):
    _, kernels = LAYERS[layer](dtype)
    for k in kernels:
        src = render(k)
        cubin = nvrtc.compile_cubin(src.source, src.name, arch)
        assert cubin[:4] == b"\x7fELF", "NVRTC must return an ELF cubin"
        assert src.name.encode() in cubin  # the extern "C" entry point is in the symbol table


@pytest.mark.parametrize("layer,dtype", PLANNED, ids=[f"{a}-{b}" for a, b in PLANNED])
def test_planned_corpus_compiles_for_sm80_and_sm90(layer, dtype):
    """The kernels the real pipeline (trace -> optimize -> plan) makes for each layer compile with NVRTC."""
    p, _, _ = planned(layer, dtype)
    generated = [k for k in p.kernels if k.kind not in (KernelKind.LIBRARY, KernelKind.CONV)]
    assert generated
    for k in generated:
        src = render(k)
        for arch in ("sm_80", "sm_90"):
            assert nvrtc.compile_cubin(src.source, src.name, arch)[:4] == b"\x7fELF"


REDUCTIONS = [Op.SUM, Op.MEAN, Op.PROD, Op.REDUCE_MAX, Op.REDUCE_MIN, Op.ARGMAX, Op.ARGMIN]
ROW_DTYPES = [DType.F32, DType.F16, DType.BF16, DType.F64, DType.I32, DType.I64, DType.I8, DType.BOOL]


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_every_row_statistic_compiles(dtype):
    """One row kernel per dtype holding every reduction (and every row op for floats) compiles for sm_90."""
    g = Graph()
    x = g.input("x", ("rows", 300), dtype)
    body: list = [Load(x, (300, 1))]
    stores = []
    for op in REDUCTIONS:
        if op is Op.MEAN and not dtype.is_float:
            continue
        out = g.reduce(op, x, -1, keepdim=True)
        body.append(Compute(op, out.dtype, (0,), (1,)))
        stores.append(Store(len(body) - 1, out, (1, 0)))
    if dtype.is_float:
        w = g.input("w", (300,), dtype)
        body.append(Load(w, (0, 1)))
        nodes = [
            (Op.SOFTMAX, g.softmax(x), (0,), 1),
            (Op.LOG_SOFTMAX, g.log_softmax(x), (0,), 1),
            (
                Op.LAYERNORM,
                g.layernorm(x, w, w),
                (0, len(body) - 1, len(body) - 1),
                NormArgs(1e-5, True, True),
            ),
            (Op.RMSNORM, g.rmsnorm(x, w), (0, len(body) - 1), NormArgs(1e-6, True)),
        ]
        for op, node, src, arg in nodes:
            body.append(Compute(op, dtype, src, arg))
            stores.append(Store(len(body) - 1, node, (300, 1)))
    k = RowKernel(f"stats_{dtype}", (Sym.of("rows"), 300), tuple(body), tuple(stores), row_rank=1)
    src = render(k)
    assert nvrtc.compile_cubin(src.source, src.name, "sm_90")[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_gather_kernel_with_its_error_flag_compiles(arch):
    src = render(gather_kernel()[1])
    assert "int* kz_err" in src.source and "kz_wrap(v0, 10, kz_err)" in src.source
    assert nvrtc.compile_cubin(src.source, src.name, arch)[:4] == b"\x7fELF"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(elementwise_case())
def test_random_elementwise_kernels_compile(case):
    _, _, g, _ = case
    src = render(pointwise_kernel(g))
    assert nvrtc.compile_cubin(src.source, src.name, "sm_80")[:4] == b"\x7fELF"


def test_cubin_cache_hits_and_keys():
    _, (k,) = LAYERS["softmax"](DType.F16)
    src = render(k)
    t0 = time.perf_counter()
    first = nvrtc.compile_cubin(src.source, src.name, "sm_90")
    t1 = time.perf_counter()
    second = nvrtc.compile_cubin(src.source, src.name, "sm_90")
    t2 = time.perf_counter()
    assert first == second
    assert t2 - t1 < max(0.05, (t1 - t0) / 5), (t1 - t0, t2 - t1)  # a hit does not run NVRTC
    key90, key80 = nvrtc.cubin_key(src.source, "sm_90"), nvrtc.cubin_key(src.source, "sm_80")
    assert key90 != key80 and key90 != nvrtc.cubin_key(src.source + "\n", "sm_90")
    from kernelize.runtime.diskcache import cache_dir

    assert (cache_dir() / f"{key90}.cubin").read_bytes() == first


def test_compile_error_carries_log_and_numbered_source():
    _, (k,) = LAYERS["rmsnorm"](DType.F32)
    src = render(k)
    broken = src.source.replace("kz_rsqrt(acc2.v", "kz_rsqrt(undeclared_thing + acc2.v")
    assert broken != src.source
    with pytest.raises(KernelCompileError) as info:
        nvrtc.compile_cubin(broken, src.name, "sm_80")
    err = info.value
    assert "undeclared_thing" in err.log and "identifier" in err.log  # NVRTC's own words
    line = next(i for i, t in enumerate(broken.splitlines(), 1) if "undeclared_thing" in t)
    assert f"{line:4d} | " in str(err) and err.kernel_name == src.name and err.backend == "cuda"
    assert err.key == nvrtc.cubin_key(broken, "sm_80")


def test_backend_compile_without_gpu_and_clear_launch_error():
    _, (k,) = LAYERS["silu_and_mul"](DType.BF16)
    ck = CudaBackend(arch="sm_90").compile(k)
    assert ck.backend == "cuda" and ck.source == render(k).source and len(ck.source_hash) == 16
    if HAS_GPU:
        pytest.skip("a driver is present: the no-driver error path does not apply")
    x = torch.randn(3, 96).bfloat16()
    with pytest.raises(RuntimeError, match="no CUDA driver: compiled kernels can be inspected but not"):
        ck.launch([x], [torch.empty(3, 48, dtype=torch.bfloat16)], {"batch": 3})


def test_nvrtc_environment():
    major, minor = map(int, nvrtc.nvrtc_version().split("."))
    assert major >= 12
    assert nvrtc.include_dirs(), "cuda_fp16.h not found: install nvidia-cuda-runtime"


# -- real GPU -----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
@pytest.mark.parametrize("layer,dtype", CORPUS, ids=[f"{a}-{b}" for a, b in CORPUS])
def test_corpus_on_gpu_matches_reference(layer, dtype):
    g, kernels = LAYERS[layer](dtype)
    backend = CudaBackend()
    ins = corpus_inputs(g)
    env = {**SIZES}
    vals = {n: t.cuda() for n, t in zip(g.inputs, ins)}
    for n in g.nodes:
        if n.op == "const":
            vals[n] = n.arg.tensor.cuda()
    for k in kernels:
        ck = backend.compile(k)
        writes = [torch.empty(bind(b.shape, env), dtype=b.dtype.torch, device="cuda") for b in k.writes]
        ck.launch([vals[b] for b in k.reads], writes, {s: env[s] for s in k.symbols})
        vals.update(zip(k.writes, writes))
    torch.cuda.synchronize()
    want = oracle(lambda dt: LAYERS[layer](dt)[0], dtype, ins)
    for o, w in zip(g.outputs, want):
        torch.testing.assert_close(vals[o].cpu().double(), w.double(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
def test_compile_graph_cuda_backend_on_gpu():
    from kernelize.ir import Graph, evaluate
    from kernelize.runtime import compile_graph

    g = Graph()
    x = g.input("x", ("batch", 256), "f16")
    g.output(g.softmax(x))
    cg = compile_graph(g, backend="cuda")
    xs = torch.randn(7, 256, dtype=torch.float16, device="cuda")
    (got,) = cg(xs)
    torch.testing.assert_close(got.cpu().float(), evaluate(g, [xs.cpu()])[0].float(), rtol=2e-3, atol=1e-3)
