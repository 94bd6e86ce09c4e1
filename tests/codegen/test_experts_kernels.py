"""The grouped-expert kernels (``Op.EXPERTS``) of every backend against ``reference_experts``: Triton
under the interpreter and lowered to PTX / cubin for sm_80 and sm_90, CUDA C through the host emulation
and NVRTC cubins for sm_80 and sm_90, the CPU kernel on each of its paths (its dot blocks; past a GEMM
panel of rows per expert its transposed GEMMs over the generated tiles; library GEMMs per expert), and
``grouped_experts`` on a real GPU. Sizes stay small and awkward (the interpreter and the emulation are
slow); some routed slots hold the sentinel expert E.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kernelize.autokernel.kernels import ExpertsKernel
from kernelize.autokernel.plan import plan
from kernelize.codegen import cpu_experts
from kernelize.codegen.cpu_experts import FEW_PAIRS
from kernelize.codegen.experts_align import align_pairs, max_blocks
from kernelize.codegen.triton import TritonBackend
from kernelize.experts import grouped_experts
from kernelize.ir.dtypes import DType
from kernelize.ir.experts import reference_experts
from kernelize.ir.graph import Graph
from kernelize.ir.ops import ExpertsArgs

TOL = {DType.F32: 1e-4, DType.F16: 4e-3, DType.BF16: 2e-2}
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="host emulation needs g++")


def _kernel(h, i, e, k, dtype, act="silu", gated=True, index=DType.I64) -> ExpertsKernel:
    g = Graph()
    x = g.input("x", ("tokens", h), dtype)
    idx = g.input("index", ("tokens", k), index)
    w = g.input("weights", ("tokens", k), DType.F32)
    up = g.input("up", (e, 2 * i if gated else i, h), dtype)
    down = g.input("down", (e, h, i), dtype)
    g.output(g.experts(x, idx, w, up, down, act=act, gated=gated))
    (kernel,) = plan(g).kernels
    assert isinstance(kernel, ExpertsKernel)
    return kernel


def _inputs(kernel: ExpertsKernel, t: int, seed: int = 0, views: bool = False) -> list[torch.Tensor]:
    """x, index (distinct experts per token, some slots the sentinel E), weights, up, down; ``views``: x,
    weights and up as strided views (x and up transposed in memory, weights a column slice)."""
    gen = torch.Generator().manual_seed(seed)
    x_n, idx_n, _, up_n, down_n = kernel.node.src[:5]
    (h,), (k,), (e, n, _), i = x_n.shape[1:], idx_n.shape[1:], up_n.shape, down_n.shape[2]
    dt = kernel.node.dtype.torch
    index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    sentinel = torch.rand(t, k, generator=gen) < 0.2
    sentinel[-1, -1], sentinel[0, 0] = t * k > 1, False  # a sentinel slot where there are two; a real pair
    index = index.masked_fill(sentinel, e).to(idx_n.dtype.torch)
    weights = torch.rand(t, k + 1, generator=gen)[:, 1:] if views else torch.rand(t, k, generator=gen)
    if views:
        x = torch.randn(h, t, generator=gen).to(dt).T
        up = (torch.randn(e, h, n, generator=gen) / h**0.5).to(dt).transpose(1, 2)
    else:
        x = torch.randn(t, h, generator=gen).to(dt)
        up = (torch.randn(e, n, h, generator=gen) / h**0.5).to(dt)
    down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dt)
    return [x, index, weights, up, down]


def _check(kernel: ExpertsKernel, out: torch.Tensor, ins) -> None:
    ref = reference_experts(*ins, kernel.node.arg)
    assert ref.abs().max() > 0.1  # the inputs route real pairs: a kernel writing zeros fails
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[kernel.node.dtype] * max(1.0, ref.float().abs().max().item()), err


# (tokens, hidden, intermediate, experts, K, dtype, activation, gated)
CASES = [
    (1, 40, 24, 5, 1, DType.F32, "silu", True),
    (7, 64, 72, 8, 2, DType.BF16, "gelu", True),
    (33, 40, 72, 5, 3, DType.F32, "gelu_tanh", False),
    (7, 40, 24, 8, 3, DType.F16, "relu", True),
    (33, 64, 24, 8, 2, DType.BF16, "silu", False),
    (1, 64, 72, 8, 2, DType.F32, "relu2", False),
]
IDS = [f"t{c[0]}-h{c[1]}-i{c[2]}-e{c[3]}-k{c[4]}-{c[5]}-{c[6]}{'' if c[7] else '-ungated'}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_interpreter_matches_reference(case):
    t, h, i, e, k, dtype, act, gated = case
    kernel = _kernel(h, i, e, k, dtype, act, gated)
    ins = _inputs(kernel, t, views=t == 7)
    out = torch.empty(t, h, dtype=dtype.torch)
    TritonBackend().compile(kernel).launch(ins, [out], {"tokens": t})
    _check(kernel, out, ins)


def test_triton_many_pairs_per_expert_take_64_row_blocks():
    from kernelize.codegen.triton_experts import block_m

    assert (block_m(2, 8), block_m(60, 2), block_m(330, 5)) == (16, 32, 64)
    kernel = _kernel(40, 24, 5, 2, DType.F32, "silu", True, index=DType.I32)
    ins = _inputs(kernel, 165, seed=3)
    out = torch.empty(165, 40)
    TritonBackend().compile(kernel).launch(ins, [out], {"tokens": 165})
    _check(kernel, out, ins)


def test_grouped_experts_runs_the_triton_backend_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("KERNELIZE_HUB_BACKEND", "triton")
    kernel = _kernel(64, 24, 8, 2, DType.F32, "gelu", True)
    ins = _inputs(kernel, 7, seed=1)
    _check(kernel, grouped_experts(*ins, act="gelu"), ins)


@needs_gxx
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_emulated_matches_reference(case):
    from cuda_emu import emulate_experts

    t, h, i, e, k, dtype, act, gated = case
    kernel = _kernel(h, i, e, k, dtype, act, gated)
    ins = _inputs(kernel, t, views=t == 7)
    out = torch.full((t, h), float("nan"), dtype=dtype.torch)
    emulate_experts(kernel, ins, out)
    _check(kernel, out, ins)


# (tokens, strided views, the path an f32 call takes, a bf16 call's) over 9 experts, top-2, the generated
# GEMM tiles chosen for f32 GEMMs (TILE_ROWS: 16 rows per expert with AVX2, 8 with AVX-512)
PATHS = [
    (1, False, "dots", "dots"),
    (7, True, "dots", "dots"),
    (FEW_PAIRS // 2 + 1, False, "dots", "dots"),  # past FEW_PAIRS, under TILE_ROWS rows per expert
    (170, False, "tiles", "tiles"),  # 340 pairs: past twice TILE_ROWS rows per expert
    (170, True, "library", "tiles"),  # f32 rows the GEMM cannot read as stored; bf16 rows are widened
]


@pytest.mark.parametrize("t,views,f32_path,bf16_path", PATHS)
@pytest.mark.parametrize("dtype,act,gated", [(DType.F32, "silu", True), (DType.BF16, "gelu_tanh", False)])
def test_cpu_backend_every_path_matches_reference(
    monkeypatch, t, views, f32_path, bf16_path, dtype, act, gated
):
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "generated")
    kernel = _kernel(40, 72, 9, 2, dtype, act, gated)
    ins = _inputs(kernel, t, seed=t, views=views)
    assert cpu_experts.call_path(*ins[:2], *ins[3:5]) == (f32_path if dtype == DType.F32 else bf16_path)
    _check(kernel, grouped_experts(*ins, act=act, gated=gated), ins)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_cpu_transposed_gemm_path_is_bitwise_the_same_at_any_thread_count(monkeypatch, dtype):
    """Each expert runs on one thread and each token sums its slots in order: the threads only share the
    work out."""
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "generated")
    kernel = _kernel(40, 72, 5, 2, dtype)
    ins = _inputs(kernel, 170, seed=11)
    assert cpu_experts.call_path(*ins[:2], *ins[3:5]) == "tiles"
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(grouped_experts(*ins))
    finally:
        torch.set_num_threads(threads)
    _check(kernel, outs[0], ins)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_cpu_experts_take_the_tiles_unless_a_library_is_named(monkeypatch):
    """The experts' transposed products run in the generated tiles wherever no library is named (the
    default GEMM library, `test_cpu_gemv`); ``KERNELIZE_CPU_GEMM`` naming a library sends them there."""
    from kernelize.codegen import cpu_gemv

    monkeypatch.delenv("KERNELIZE_CPU_GEMM", raising=False)
    assert cpu_gemv.tiles_take(True, 64) and not cpu_gemv.tiles_take(False, 64)
    for library in ("onednn", "torch"):
        monkeypatch.setenv("KERNELIZE_CPU_GEMM", library)
        assert not cpu_gemv.tiles_take(True, 64) and cpu_gemv.cpu_gemm() == library


amx = pytest.mark.skipif(
    not cpu_experts.amx_products(torch.bfloat16, 64, 96), reason="the CPU (or the compiler) has no AMX-BF16"
)


@amx
@pytest.mark.parametrize("t", [FEW_PAIRS // 2 + 1, 170])
@pytest.mark.parametrize("form", ["plain", "ungated", "oss"])
def test_cpu_amx_tiles_match_reference(t, form):
    """bf16 experts with sizes multiple of 32 run their many-pair products on AMX tiles (rows 32 at a time,
    tokens padded to 32): gated or not, and gpt-oss's interleaved, biased, clamped form."""
    g = Graph()
    x, idx = g.input("x", ("tokens", 64), DType.BF16), g.input("index", ("tokens", 2), DType.I64)
    w = g.input("weights", ("tokens", 2), DType.F32)
    n = 96 if form == "ungated" else 192
    up, down = g.input("up", (6, n, 64), DType.BF16), g.input("down", (6, 64, 96), DType.BF16)
    keywords = {"oss": dict(OSS, act="silu"), "ungated": dict(act="gelu", gated=False)}
    keywords = keywords.get(form, {"act": "silu"})
    biases, extra = {}, {}
    if form == "oss":
        biases = dict(up_bias=g.input("ub", (6, n), DType.BF16), down_bias=g.input("db", (6, 64), DType.BF16))
    g.output(g.experts(x, idx, w, up, down, **biases, **keywords))
    (kernel,) = plan(g).kernels
    ins = _inputs(kernel, t, seed=t)
    assert cpu_experts.call_path(*ins[:2], *ins[3:5]) == "tiles"
    if form == "oss":
        gen = torch.Generator().manual_seed(5)
        sizes = (("up_bias", n), ("down_bias", 64))
        extra = {k: torch.randn(6, s, generator=gen).bfloat16() for k, s in sizes}
    got = grouped_experts(*ins, **extra, **keywords)
    ref = reference_experts(*ins, kernel.node.arg, *extra.values())
    assert ref.float().abs().max() > 0.1
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= TOL[DType.BF16] * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_cpu_many_pairs_without_the_gemm_tiles_take_the_library_path(monkeypatch, dtype):
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "onednn")
    kernel = _kernel(40, 72, 5, 2, dtype)
    ins = _inputs(kernel, 170, seed=3)
    assert cpu_experts.call_path(*ins[:2], *ins[3:5]) == "library"
    _check(kernel, grouped_experts(*ins), ins)


@pytest.mark.parametrize("t", [1, FEW_PAIRS])
@pytest.mark.parametrize("bad", [-1, 6])
def test_cpu_index_outside_the_experts_is_a_value_error(t, bad):
    kernel = _kernel(40, 24, 5, 2, DType.F32)
    ins = _inputs(kernel, t)
    ins[1][t // 2, 0] = bad
    with pytest.raises(ValueError, match="expert index outside"):
        grouped_experts(*ins)


# gpt-oss's experts: interleaved gate/up rows, biases, gate and up clamped (low limits: many values cross
# them), silu with a sigmoid scale, up shifted by one
OSS = dict(interleaved=True, alpha=1.702, gate_limit=0.5, up_limit=0.4, up_shift=1.0)


def _biased(kernel: ExpertsKernel, t: int, seed: int):
    ins = _inputs(kernel, t, seed=seed, views=t == 7)
    gen = torch.Generator().manual_seed(seed + 1)
    (e, n, h), dt = ins[3].shape, ins[0].dtype
    up_bias, down_bias = torch.randn(e, n, generator=gen).to(dt), torch.randn(e, h, generator=gen).to(dt)
    return ins, up_bias, down_bias


@pytest.mark.parametrize("t", [1, 7, FEW_PAIRS // 2 + 1, 170])
@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_cpu_biases_interleaved_rows_and_a_clamped_gate_match_reference(monkeypatch, t, dtype):
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "generated")
    kernel = _kernel(40, 72, 9, 2, dtype)
    ins, up_bias, down_bias = _biased(kernel, t, seed=t)
    assert (cpu_experts.call_path(*ins[:2], *ins[3:5]) == "tiles") == (t == 170)
    got = grouped_experts(*ins, up_bias=up_bias, down_bias=down_bias, **OSS)
    args = ExpertsArgs("silu", bias=True, **OSS)
    ref = reference_experts(*ins, args, up_bias, down_bias)
    plain = reference_experts(*ins, ExpertsArgs("silu"))
    assert (ref.float() - plain.float()).abs().max() > 0.1  # the form and the biases change the result
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


def _oss_kernel(dtype: DType) -> ExpertsKernel:
    g = Graph()
    x, idx = g.input("x", ("tokens", 40), dtype), g.input("index", ("tokens", 2), DType.I64)
    w = g.input("weights", ("tokens", 2), DType.F32)
    up, down = g.input("up", (5, 48, 40), dtype), g.input("down", (5, 40, 24), dtype)
    ub, db = g.input("up_bias", (5, 48), dtype), g.input("down_bias", (5, 40), dtype)
    g.output(g.experts(x, idx, w, up, down, act="silu", up_bias=ub, down_bias=db, **OSS))
    (kernel,) = plan(g).kernels
    assert isinstance(kernel, ExpertsKernel) and kernel.node.arg.bias
    return kernel


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_triton_and_cuda_biases_interleaved_rows_and_a_clamped_gate_match_reference(dtype):
    from cuda_emu import emulate_experts

    kernel = _oss_kernel(dtype)
    ins, up_bias, down_bias = _biased(kernel, 7, seed=5)
    ref = reference_experts(*ins, kernel.node.arg, up_bias, down_bias)
    for run in (
        lambda out: TritonBackend().compile(kernel).launch([*ins, up_bias, down_bias], [out], {"tokens": 7}),
        lambda out: emulate_experts(kernel, [*ins, up_bias, down_bias], out),
    ):
        out = torch.full((7, 40), float("nan"), dtype=dtype.torch)
        run(out)
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


def test_the_gate_forms_compile_to_sm80_and_sm90_cubins(tmp_path, monkeypatch):
    from kernelize.codegen.triton_aot import compile_experts_ahead

    kernel = _oss_kernel(DType.BF16)
    assert all(r["cubin"][:4] == b"\x7fELF" for r in compile_experts_ahead(kernel, (80, 90), bm=16))
    nvrtc = pytest.importorskip("kernelize.codegen.nvrtc")
    pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python")
    from kernelize.codegen.cuda_experts import render_experts

    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path))
    source, name = render_experts(kernel)
    assert "1.702f" in source and "0.4f" in source  # the gate form is in the source
    for arch in ("sm_80", "sm_90"):
        assert nvrtc.compile_cubin(source, name, arch, cache=False)[:4] == b"\x7fELF"


def test_align_pairs_sorts_and_pads_each_expert_to_whole_blocks():
    gen = torch.Generator().manual_seed(0)
    e, k, bm = 6, 3, 4
    index = torch.randint(0, e + 1, (11, k), generator=gen)
    index[3] = torch.tensor([-2, e + 1, 0])  # out of range: the device assert (raised here, on the CPU)
    with pytest.raises(RuntimeError, match="expert index outside"):
        align_pairs(index, e, bm)
    index[3] = torch.tensor([e, 2, 0])
    al = align_pairs(index, e, bm)
    pairs = index.numel()
    assert al.blocks == max_blocks(pairs, e, bm) and al.sorted_pair_ids.numel() == al.blocks * bm
    ids, bexp = al.sorted_pair_ids.view(al.blocks, bm), al.block_expert_ids
    flat = index.reshape(-1)
    seen = []
    for b in range(al.blocks):
        rows = [int(p) for p in ids[b] if p < pairs]
        if int(bexp[b]) == e:  # a block without work holds no pair
            assert not rows
            continue
        assert rows and all(int(flat[p]) == int(bexp[b]) for p in rows)
        seen += rows
    assert bexp.tolist() == sorted(bexp.tolist())  # experts in order, the idle blocks last
    assert sorted(seen) == [p for p in range(pairs) if int(flat[p]) < e]


def test_backends_render_experts_through_their_tables():
    from kernelize.codegen.cuda import CudaBackend
    from kernelize.codegen.cuda_experts import render_experts as cuda_render
    from kernelize.codegen.triton_experts import render_experts as triton_render

    kernel = _kernel(40, 24, 5, 2, DType.BF16, "gelu_tanh", False)
    assert TritonBackend().render(kernel) == triton_render(kernel)
    assert "def k0_up(" in triton_render(kernel) and "def k0_down(" in triton_render(kernel)
    assert CudaBackend(arch="sm_80").render(kernel) == cuda_render(kernel)[0]
    assert "kz_gelu_tanh(v)" in cuda_render(kernel)[0]


def test_triton_lowers_to_ptx_and_cubin_for_sm80_and_sm90():
    from kernelize.codegen.triton_aot import compile_experts_ahead

    kernel = _kernel(64, 72, 8, 2, DType.BF16, "gelu", True)
    results = compile_experts_ahead(kernel, (80, 90), bm=16)
    assert [(r["name"], r["arch"]) for r in results] == [
        ("k0_up", 80),
        ("k0_down", 80),
        ("k0_up", 90),
        ("k0_down", 90),
    ]
    for r in results:
        assert r["cubin"][:4] == b"\x7fELF" and f".target sm_{r['arch']}" in r["ptx"]
        assert "mma" in r["ptx"]  # both grouped GEMMs run on tensor cores


def test_cuda_nvrtc_cubins_for_sm80_and_sm90(tmp_path, monkeypatch):
    nvrtc = pytest.importorskip("kernelize.codegen.nvrtc")
    pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python")
    from kernelize.codegen.cuda_experts import render_experts

    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path))
    for dtype, act, gated in (
        (DType.F32, "silu", True),
        (DType.BF16, "gelu", False),
        (DType.F16, "relu", True),
    ):
        source, name = render_experts(_kernel(64, 72, 8, 2, dtype, act, gated))
        for arch in ("sm_80", "sm_90"):
            cubin = nvrtc.compile_cubin(source, name, arch, cache=False)
            assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_gpu_grouped_experts_match_reference(backend, dtype, monkeypatch):
    monkeypatch.setenv("KERNELIZE_CUDA_BACKEND", backend)
    kernel = _kernel(256, 176, 16, 4, dtype, "silu", True)
    for t in (1, 7, 300):  # decode (16-row blocks), a short and a long prompt
        ins = [a.cuda() for a in _inputs(kernel, t, seed=t, views=t == 7)]
        _check(kernel, grouped_experts(*ins), ins)
