"""quant.linear: the decode kernel up to 8 rows, dequantized panels above, shapes, dtypes and errors."""

from __future__ import annotations

import pytest
import torch

from kernelize.quant import ops
from kernelize.quant.formats import FORMATS, dequantize, quantize


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_the_float_product(fmt: str, rows: int, dtype: torch.dtype) -> None:
    k = 3 * FORMATS[fmt].block_size
    w, b = torch.randn(300, k), torch.randn(300)
    x = torch.randn(rows, k).to(dtype)
    p = quantize(w, fmt)
    y = ops.linear(x, p, b)
    assert y.shape == (rows, 300) and y.dtype == dtype
    ref = x.float() @ dequantize(p).T + b
    if rows > ops.FEW_ROWS and dtype == torch.float32:  # prefill multiplies the dequantized weight in f32
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    else:  # decode rounds the activations to int8 blocks, bf16 the result
        assert ((y.float() - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("native", [False, True])
def test_bf16_prefill_panels_are_bf16_where_the_cpu_gemms_are(monkeypatch, native: bool) -> None:
    """Where the CPU's bf16 GEMMs are native, a bf16 prefill multiplies bf16 panels (its weights rounded
    once), else f32 ones; both within bf16's rounding of the float product, every panel covered."""
    monkeypatch.setattr(ops, "native_panels", lambda dtype: native and dtype == torch.bfloat16)
    monkeypatch.setattr(ops, "PANEL_ROWS", 16)
    w, b, x = torch.randn(33, 64), torch.randn(33), torch.randn(12, 64).bfloat16()
    p = quantize(w, "q8_0")
    y = ops.linear(x, p, b)
    panel = dequantize(p).bfloat16() if native else dequantize(p)
    ref = x.float() @ panel.float().T + b
    assert y.dtype == torch.bfloat16 and ((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2


def test_prefill_panels_cover_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "PANEL_ROWS", 16)  # N = 33: panels of 16, 16, 1
    w, x = torch.randn(33, 64), torch.randn(2, 6, 64)
    p = quantize(w, "q8_0")
    y = ops.linear(x, p)
    assert y.shape == (2, 6, 33)
    torch.testing.assert_close(y, x @ dequantize(p).T, rtol=1e-5, atol=1e-5)


def test_leading_dims_noncontiguous_and_empty() -> None:
    p = quantize(torch.randn(7, 64), "q4_0")
    x = torch.randn(64, 3).T  # not contiguous
    torch.testing.assert_close(ops.linear(x, p), ops.linear(x.contiguous(), p))
    assert ops.linear(torch.randn(0, 64), p).shape == (0, 7)
    assert ops.linear(torch.randn(2, 1, 64), p).shape == (2, 1, 7)


def test_errors_name_the_tensor_and_the_remedy() -> None:
    p = quantize(torch.randn(7, 64), "q8_0")
    with pytest.raises(TypeError, match=r"input x has dtype torch.float16.*x.float\(\)"):
        ops.linear(torch.randn(1, 64).half(), p)
    with pytest.raises(ValueError, match=r"input x of shape \(1, 32\).*K = 64"):
        ops.linear(torch.randn(1, 32), p)
    with pytest.raises(ValueError, match=r"bias of shape \(6,\).*N = 7"):
        ops.linear(torch.randn(1, 64), p, torch.randn(6))
    with pytest.raises(TypeError, match="must be a PackedWeight"):
        ops.linear(torch.randn(1, 64), torch.randn(7, 64))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_is_linear_and_glu_bit_for_bit(fmt: str, dtype: torch.dtype) -> None:
    """The resolved call is the same kernel call as linear() / glu(): identical bits, bias and epilogue."""
    from kernelize.quant.fused import glu

    k = 256
    gen = torch.Generator().manual_seed(5)
    p = quantize(torch.randn(96, k, generator=gen), fmt)
    bias = torch.randn(96, generator=gen)
    for rows in (1, 3, ops.FEW_ROWS):
        x = torch.randn(1, rows, k, generator=gen).to(dtype)
        assert torch.equal(ops.FewRows(p, bias)(x), ops.linear(x, p, bias))
        assert torch.equal(ops.FewRows(p)(x), ops.linear(x, p))
        assert torch.equal(ops.FewRows(p, bias, "silu")(x), glu(x, p, "silu", bias))


def test_few_rows_declines_what_it_does_not_take() -> None:
    p = quantize(torch.randn(16, 64), "q8_0")
    call = ops.FewRows(p)
    assert call(torch.randn(ops.FEW_ROWS + 1, 64)) is None  # prefill rows: linear's panels
    assert call(torch.randn(64, 2).t()) is None  # not contiguous
    assert call(torch.randn(2, 32)) is None and call(torch.randn(64)) is None  # wrong K, 1-d
    assert call(torch.randn(2, 64, dtype=torch.float16)) is None
    assert not ops.FewRows.takes(p, torch.randn(16, dtype=torch.bfloat16))  # the kernel's bias is f32
    assert not ops.FewRows.takes(p, torch.randn(32, 2)[:, 0])
