"""The packed-weight matmul kernels (``kernelize.codegen.triton_quant`` / ``cuda_quant``) against the product
with the dequantized weight in f64: Triton under the interpreter and lowered to cubins for sm_80 / sm_90, CUDA
C through the host emulation and NVRTC cubins for sm_80 / sm_90, and ``quant.linear`` on a real GPU with
both backends. Shapes are small and awkward: N not a multiple of any tile, K of 2, 3 and 5 blocks.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kernelize.quant import QuantizedLinear, gpu, ops
from kernelize.quant.formats import dequantize, quantize
from kernelize.quant.gpu import GPU_FORMATS

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # of max |ref|: the output's rounding
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="host emulation needs g++")


def _case(fmt: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = quantize(torch.randn(n, k, generator=gen), fmt)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, p, torch.randn(n, generator=gen) if bias else None


def _to(p, device: str):
    """The packed weight ``p`` with its tensors on ``device``."""
    return type(p)(p.data.to(device), p.format, p.shape, None if p.scales is None else p.scales.to(device))


def _check(out: torch.Tensor, x: torch.Tensor, p, bias: torch.Tensor | None) -> None:
    ref = x.double() @ dequantize(p).double().T
    if bias is not None:
        ref += bias.double()
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert ref.abs().max() > 1  # a kernel writing zeros fails
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[x.dtype] * ref.abs().max().item(), err


# (M, K), K of 2 or 3 blocks. Triton: 16-row tiles (1, 3), 32 (17), 64 (40). CUDA C: gemv in one pass (1, 3)
# and three (17), the tiled kernel (40)
SHAPES = [(1, 64), (3, 96), (17, 64), (40, 96)]
# every path in bf16; f32 on the one-pass gemv and the tiled kernel (the suite's time: ~1 s a case)
CASES = [(m, k, torch.bfloat16) for m, k in SHAPES] + [(1, 64, torch.float32), (40, 96, torch.float32)]


@pytest.mark.parametrize("fmt", sorted(GPU_FORMATS))
@pytest.mark.parametrize("m,k,dtype", CASES)
def test_triton_interpreter_matches_the_dequantized_product(fmt, m, k, dtype):
    x, p, b = _case(fmt, m, 37, k, dtype, bias=m != 3, seed=m)
    out = torch.full((m, 37), float("nan"), dtype=dtype)
    gpu.launcher("triton", fmt, dtype, torch.device("cpu"))(x, p, b, out)  # CPU tensors: the interpreter
    _check(out, x, p, b)


@pytest.mark.parametrize("fmt", sorted(GPU_FORMATS))
@pytest.mark.parametrize("m,k,split", [(5, 160, 2), (2, 640, 8), (70, 160, 1)])
def test_triton_interpreter_split_k_several_tiles_and_float16(fmt, m, k, split):
    from kernelize.codegen.triton_quant import launch_config

    x, p, b = _case(fmt, m, 130, k, torch.float16, seed=m)  # 3 column tiles; K 5 or 20 blocks
    assert launch_config(m, 130, k, torch.float16, True)[0]["SPLIT"] == split  # 5 blocks: 3 + 2
    out = torch.empty(m, 130, dtype=torch.float16)
    gpu.launcher("triton", fmt, torch.float16, torch.device("cpu"))(x, p, b, out)
    _check(out, x, p, b)


def test_triton_reads_packed_bytes_at_an_odd_address():
    x, p, b = _case("q4_0", 2, 9, 64, torch.bfloat16)
    buf = torch.zeros(p.data.numel() + 1, dtype=torch.uint8)
    odd = buf[1:].view(p.data.shape)  # a view one byte in: the 16-bit reads take a copy
    odd.copy_(p.data)
    assert odd.data_ptr() % 2 == 1
    p = type(p)(odd, p.format, p.shape)
    out = torch.empty(2, 9, dtype=torch.bfloat16)
    gpu.launcher("triton", "q4_0", torch.bfloat16, torch.device("cpu"))(x, p, b, out)
    _check(out, x, p, b)


@needs_gxx
@pytest.mark.parametrize("fmt", sorted(GPU_FORMATS))
@pytest.mark.parametrize("m,k,dtype", CASES)
def test_cuda_emulated_matches_the_dequantized_product(fmt, m, k, dtype):
    from cuda_emu import emulate_quant

    x, p, b = _case(fmt, m, 37, k, dtype, bias=m != 3, seed=m)
    out = torch.full((m, 37), float("nan"), dtype=dtype)
    emulate_quant(fmt, x, p, b, out)
    _check(out, x, p, b)


@needs_gxx
@pytest.mark.parametrize("fmt", ["q8_0", "int8"])
def test_cuda_emulated_several_tiles_and_float16(fmt):
    from cuda_emu import emulate_quant

    x, p, b = _case(fmt, 70, 130, 160, torch.float16)  # 2 x 3 tiles of 64, K: five steps of 32
    out = torch.empty(70, 130, dtype=torch.float16)
    emulate_quant(fmt, x, p, b, out)
    _check(out, x, p, b)


def test_triton_lowers_to_cubins_for_sm80_and_sm90():
    from kernelize.codegen.triton_aot import compile_quant_ahead

    results = compile_quant_ahead("q4_0", torch.bfloat16, (80, 90))
    names = [(r["name"], r["arch"]) for r in results]
    assert names == [(f"kz_quant_q4_0_bf16_{p}", a) for a in (80, 90) for p in ("mm", "mm", "reduce")]
    for r in results:
        assert r["cubin"][:4] == b"\x7fELF" and f".target sm_{r['arch']}" in r["ptx"]
    assert all("mma" in r["ptx"] for r in results if r["name"].endswith("_mm"))  # decode too: tensor cores


def test_cuda_nvrtc_cubins_for_sm80_and_sm90(tmp_path, monkeypatch):
    nvrtc = pytest.importorskip("kernelize.codegen.nvrtc")
    pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python")
    from kernelize.codegen.cuda_quant import render_quant

    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path))
    cases = [(f, torch.bfloat16) for f in sorted(GPU_FORMATS)] + [
        ("q4_0", torch.float32),
        ("int8", torch.float16),
    ]
    for fmt, dtype in cases:
        source, name = render_quant(fmt, dtype)
        for arch in ("sm_80", "sm_90"):
            cubin = nvrtc.compile_cubin(source, name, arch, cache=False)
            assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000, (fmt, dtype, arch)


def test_launchers_by_backend_and_their_errors():
    x, p, b = _case("int8", 2, 9, 64, torch.float32)
    out = torch.empty(2, 9)
    gpu.launcher("reference", "int8", torch.float32, torch.device("cpu"))(x, p, b, out)
    _check(out, x, p, b)
    with pytest.raises(ValueError, match="backend 'cpu' has no packed-weight kernels"):
        gpu.launcher("cpu", "int8", torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        gpu.launcher("cuda", "int8", torch.float32, torch.device("cpu"))


def test_linear_refuses_devices_without_kernels():
    p = quantize(torch.randn(7, 64), "q8_0")
    with pytest.raises(ValueError, match=r"input x is on meta.*run on cpu and cuda"):
        ops.linear(torch.randn(1, 64, device="meta"), p)


# -- on a real GPU (each backend well under 10 s) -----------------------------------------------------------

GPU_CASES = [(f, torch.bfloat16, m) for f in sorted(GPU_FORMATS) for m in (1, 300)] + [
    ("q8_0", torch.float32, 5),
    ("q4_0", torch.float16, 1),
    ("int8", torch.float16, 64),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_linear_matches_the_dequantized_product(backend, monkeypatch):
    monkeypatch.setenv("KERNELIZE_CUDA_BACKEND", backend)
    for fmt, dtype, m in GPU_CASES:  # decode (1, 5 rows), prefill (64, 300); K = 11 blocks, N = 300
        x, p, b = _case(fmt, m, 300, 352, dtype, bias=m != 5, seed=m)
        out = ops.linear(x.cuda(), _to(p, "cuda"), None if b is None else b.cuda())
        _check(out.cpu(), x, p, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_module_moves_and_never_widens_the_weight(backend, monkeypatch):
    monkeypatch.setenv("KERNELIZE_CUDA_BACKEND", backend)
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(torch.nn.Linear(2048, 1024), "q4_0")
    x = torch.randn(2, 16, 2048)
    with pytest.raises(ValueError, match=r"packed weight is on cpu.*module.to\('cuda:0'\)"):
        q(x.cuda())
    q = q.to("cuda")
    assert q.qweight.is_cuda and q.bias.is_cuda
    for rows in (x[:1, :1], x):  # decode and prefill
        xc = rows.cuda().bfloat16()
        q(xc)  # compiled and warm
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = q(xc)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < 1 << 20  # an f32 copy of W: 8 MiB, bf16 4 MiB
        _check(
            y.cpu().reshape(-1, 1024), rows.reshape(-1, 2048).bfloat16(), _to(q.packed, "cpu"), q.bias.cpu()
        )


def test_the_gpu_formats_are_the_ones_both_generators_spell_and_others_are_refused_by_name() -> None:
    from kernelize.codegen.cuda_quant import CHUNKS
    from kernelize.codegen.triton_quant import SPELLING
    from kernelize.quant import gpu
    from kernelize.quant.formats import quantize

    assert set(gpu.GPU_FORMATS) == set(SPELLING) == set(CHUNKS)
    packed = quantize(torch.randn(8, 256), "q4_k")
    with pytest.raises(ValueError, match="'q4_k' has no GPU kernels yet.*q8_0, q4_0, int8"):
        gpu.run(torch.randn(1, 256), packed, None, torch.empty(1, 8))
