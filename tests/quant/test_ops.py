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
