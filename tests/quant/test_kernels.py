"""The packed-weight kernels against references: the activation quantizer against the same scheme in
torch, the few-row kernel against the exact product of the quantized operands, the panel dequantizer
against formats.dequantize."""

from __future__ import annotations

import pytest
import torch

from kernelize.quant import kernels
from kernelize.quant.formats import BLOCK, FORMATS, dequantize, quantize


def _quantize_x(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation scheme in torch: blocks of ``block`` (the weight format's: 32, or the
    k-quants' 256), d = max|x| / 127, round half to even."""
    m, k = x.shape
    b = x.float().reshape(m, k // block, block)
    d = b.abs().amax(-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    return torch.round(b * inv[..., None]).to(torch.int8).reshape(m, k), d


def _exact(x: torch.Tensor, p, bias=None) -> torch.Tensor:
    """x @ W.T in f64 with x quantized as the kernel does: what the kernel computes up to f32 sums."""
    block = p.format.block_size
    q, d = _quantize_x(x, block)
    m, k = x.shape
    xq = (q.double().reshape(m, -1, block) * d.double()[..., None]).reshape(m, k)
    y = xq @ dequantize(p).double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_activation_quantizer_matches_torch(fmt: str) -> None:
    x = torch.randn(3, 512) * 5
    x[0, :256] = 0
    x[1, 32:64] = torch.arange(32) - 15.5  # halves after scaling: ties go to even
    x[1, 64] = 15.5
    q, d = kernels.quantize_activations(x, fmt)
    rq, rd = _quantize_x(x, FORMATS[fmt].block_size)
    assert torch.equal(q, rq) and torch.equal(d, rd)


# m = 1 with N >= 8: the 8-row decode kernel (q4_0 / q8_0), with a tail of 5 columns and of 1
CASES = [(1, 1, 32), (1, 7, 96), (1, 21, 96), (1, 33, 4096), (3, 33, 4096), (8, 33, 96), (2, 4097, 96),
         (5, 17, 4096), (7, 4, 32)]  # fmt: skip
K_CASES = [(1, 1, 256), (1, 7, 768), (3, 33, 4096), (8, 33, 512), (2, 4097, 256), (5, 17, 4096), (7, 4, 256)]


def _cases(fmt: str) -> list[tuple[int, int, int]]:
    """The shapes for ``fmt``: K a multiple of its block (the k-quants' 256)."""
    return K_CASES if FORMATS[fmt].block_size == 256 else CASES


def _k(fmt: str, k: int = 96) -> int:
    """``k`` rounded up to a multiple of ``fmt``'s block."""
    b = FORMATS[fmt].block_size
    return -(-k // b) * b


@pytest.mark.parametrize("fmt,m,n,k", [(f, *c) for f in sorted(FORMATS) for c in _cases(f)])
def test_gemv_matches_quantized_reference(fmt: str, m: int, n: int, k: int) -> None:
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    p = quantize(w, fmt)
    out = torch.empty(m, n)
    kernels.gemv(x, p, bias, out)
    ref = _exact(x, p, bias)
    scale = (x.abs() @ dequantize(p).abs().T).double() + 1  # the size of the terms summed
    assert ((out.double() - ref).abs() / scale).max() < 1e-5
    loose = x @ dequantize(p).T + bias  # the float product: off by the activations' rounding only
    assert ((out - loose).abs() / (scale.float())).max() < 2e-2


@pytest.mark.parametrize("xt,ot", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.bfloat16)])  # fmt: skip
def test_gemv_dtypes(xt: torch.dtype, ot: torch.dtype) -> None:
    for fmt in FORMATS:
        w, x = torch.randn(33, _k(fmt)), torch.randn(4, _k(fmt)).to(xt)
        p = quantize(w, fmt)
        out = torch.empty(4, 33, dtype=ot)
        kernels.gemv(x, p, None, out)
        ref = _exact(x.float(), p).to(ot)
        torch.testing.assert_close(out, ref, rtol=1e-2 if ot == torch.bfloat16 else 1e-5, atol=1e-4)


def test_gemv_zero_and_one_thread_agree() -> None:
    w, x = torch.randn(300, 256), torch.randn(2, 256)
    x[0] = 0
    p = quantize(w, "q4_0")
    a, b = torch.empty(2, 300), torch.empty(2, 300)
    kernels.gemv(x, p, None, a)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kernels.gemv(x, p, None, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a, b) and (a[0] == 0).all()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_rows_is_exact(fmt: str) -> None:
    k = _k(fmt, 768)
    p = quantize(torch.randn(37, k) * torch.logspace(-3, 3, k), fmt)  # scales over a wide range
    scratch = torch.empty(16 * k)
    panel = kernels.dequantize_rows(p, 20, 36, scratch)
    assert torch.equal(panel, dequantize(p)[20:36])
    low = kernels.dequantize_rows(p, 20, 36, torch.empty(16 * k, dtype=torch.bfloat16))
    assert low.dtype == torch.bfloat16 and torch.equal(low, panel.bfloat16())  # rounded as torch rounds


def test_one_template_per_format() -> None:
    for fmt in FORMATS:
        src = kernels.source(fmt)
        assert f"typedef kz_{fmt} kz_fmt;" in src


def test_portable_fallback_agrees() -> None:
    """The scalar code under `#else` (no AVX2), built here by defining KZ_QUANT_PORTABLE."""
    for fmt in ("q4_0", "q5_0", "int8", "q4_k", "q6_k"):
        w, x = torch.randn(9, _k(fmt, 512)), torch.randn(3, _k(fmt, 512))
        fn = _built(fmt, "KZ_QUANT_PORTABLE")
        p = quantize(w, fmt)
        scales = None if p.scales is None else p.scales.data_ptr()
        a, b = torch.empty(3, 9), torch.empty(3, 9)
        fn(x.data_ptr(), 3, x.shape[1], p.data.data_ptr(), scales, 9, None, a.data_ptr(), 1, 0, 0)
        kernels.gemv(x, p, None, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-4)
        assert (_exact(x, p) - a.double()).abs().max() < 1e-3


def _vnni() -> bool:
    """The kernel libraries are built with a VNNI dot product (the macros the template's `#if` sees)."""
    from kernelize.codegen import cpu_build

    macros = cpu_build.macros()
    return "__AVXVNNI__" in macros or {"__AVX512VNNI__", "__AVX512VL__"} <= macros


def _built(fmt: str, define: str | None):
    """The format's gemv entry point, built with `define` set (None: as the package builds it)."""
    import ctypes

    from kernelize.codegen import cpu_build

    src = kernels.source(fmt) if define is None else f"#define {define}\n" + kernels.source(fmt)
    lib = cpu_build.load(cpu_build.build_shared_object(src, f"kz_quant_{fmt}_{define or 'package'}"))
    fn = getattr(lib, f"kz_quant_{fmt}_f32_f32")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int, i64, ctypes.c_int]
    return fn


@pytest.mark.skipif(not _vnni(), reason="the kernels are built without a VNNI dot product")
def test_vnni_and_avx2_dot_products_agree_bit_for_bit() -> None:
    """vpdpbusd sums the same four products per lane as vpmaddubsw + vpmaddwd (which cannot saturate on these
    operands), so the VNNI build and the AVX2 build give equal outputs: 1 row (the 8-row kernels of q4_0
    and q8_0), 3 rows (the tile kernel), every format."""
    for fmt in FORMATS:
        k = _k(fmt, 512)
        p = quantize(torch.randn(19, k), fmt)
        scales = None if p.scales is None else p.scales.data_ptr()
        for m in (1, 3):
            x = torch.randn(m, k) * 3
            outs = []
            for define in (None, "KZ_QUANT_NO_VNNI"):
                out = torch.empty(m, 19)
                _built(fmt, define)(
                    x.data_ptr(), m, k, p.data.data_ptr(), scales, 19, None, out.data_ptr(), 1, 0, 0
                )
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (fmt, m)


@pytest.mark.parametrize("fmt,act", [("q8_0", "silu"), ("q4_0", "gelu"), ("int8", "gelu_pytorch_tanh"),
                                     ("q4_k", "silu"), ("q6_k", "gelu_new")])  # fmt: skip
@pytest.mark.parametrize("m,i", [(1, 7), (1, 19), (3, 33), (8, 4)])
def test_gemv_gate_up_epilogue(fmt: str, act: str, m: int, i: int) -> None:
    """act(x @ gate.T) * (x @ up.T) over a merged gate|up weight, against the exact products (odd I: a
    column block that repeats its last column in both halves)."""
    from kernelize.quant.fused import GLU_MATH

    k = _k(fmt)
    w, x, bias = torch.randn(2 * i, k), torch.randn(m, k), torch.randn(2 * i)
    p = quantize(w, fmt)
    out = torch.empty(m, i)
    kernels.gemv(x, p, bias, out, act)
    gate, up = _exact(x, p, bias).chunk(2, dim=-1)
    torch.testing.assert_close(out.double(), GLU_MATH[act](gate) * up, rtol=1e-5, atol=1e-4)
