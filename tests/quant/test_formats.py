"""The packed formats: bit-exact against the gguf package (llama.cpp's reference), shapes and errors."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kernelize.quant.formats import FORMATS, dequantize, quantize, roundf

gguf = pytest.importorskip("gguf")
GGUF = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
GGUF["q5_0"] = gguf.GGMLQuantizationType.Q5_0
KQUANTS = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}


def _awkward_weight(n: int, k: int) -> torch.Tensor:
    """Random values with the blocks that test the rounding: all zero, ties of the largest magnitude of
    either sign, values just below .5 after scaling, huge and tiny scales."""
    w = torch.randn(n, k) * 3
    w[0, :32] = 0
    if n > 1:
        w[1, 5], w[1, 6] = 10.0, -10.0  # the first of equal magnitudes sets q4_0's sign
        w[1, 40 % k] = -1e-30
    if n > 2:
        w[2, :32] = 0.49999997
        w[2, -32:] = torch.linspace(-1e4, 1e4, 32)
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_0"])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (33, 4096)])
def test_bytes_and_values_match_gguf(fmt: str, shape: tuple[int, int]) -> None:
    w = _awkward_weight(*shape)
    p = quantize(w, fmt)
    ref = gguf.quants.quantize(w.numpy(), GGUF[fmt])
    assert p.data.dtype == torch.uint8 and tuple(p.data.shape) == ref.shape
    assert np.array_equal(p.data.numpy(), ref)
    values = gguf.quants.dequantize(ref, GGUF[fmt])
    assert np.array_equal(dequantize(p).numpy().view(np.uint32), values.view(np.uint32))  # bit for bit


def _kquant_weight(n: int, k: int) -> torch.Tensor:
    """Random rows with the super-blocks that test the scale search: all zero, constant, one sign only,
    one large sub-block, huge and tiny values."""
    w = torch.randn(n, k) * 3
    w[0, :256] = 0
    if n > 1:
        w[1, :256] = 1.5
        w[1, 256 % k : 256 % k + 32] = 0
    if n > 2:
        w[2] = w[2].abs()
        w[2, :16] = 40.0
    if n > 3:
        w[3] = -w[3].abs() * 1e-3
        w[3, -256:] = torch.linspace(-1e4, 1e4, 256)
    return w


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
@pytest.mark.parametrize("shape", [(1, 256), (5, 512), (33, 768), (4, 4096)])
def test_kquant_values_match_gguf(fmt: str, shape: tuple[int, int]) -> None:
    p = quantize(_kquant_weight(*shape), fmt)
    assert p.data.shape == (shape[0], shape[1] // 256 * FORMATS[fmt].bytes_per_block)
    values = gguf.quants.dequantize(p.data.numpy(), KQUANTS[fmt])
    assert np.array_equal(dequantize(p).numpy().view(np.uint32), values.view(np.uint32))  # bit for bit


def test_kquant_bytes_are_llama_cpps() -> None:
    """The bytes llama.cpp's quantize_row_q4_K_ref / quantize_row_q6_K_ref write for this weight (compiled
    with -ffp-contract=off, the source's own order of operations; the gguf package cannot quantize them)."""
    i = torch.arange(3 * 512)
    w = (((i * 7919) % 1013 - 506).float() / 97) * (((i * 31) % 17 + 1).float() / 8)
    w = w.reshape(3, 512)
    w[1, :256] = 0
    w[2, 256:288] = 1.5
    digests = {
        "q4_k": "def7cc8f7b44a0cca5142a965baeb25ef670ca7a5a189b02742458dfe7456e60",
        "q6_k": "cc417590526999465117dcb48be5c7102c06e40c53db78e7f6e3e7ab4961196e",
    }
    for fmt, digest in digests.items():
        assert hashlib.sha256(quantize(w, fmt).data.numpy().tobytes()).hexdigest() == digest, fmt


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
def test_kquant_error_is_small(fmt: str) -> None:
    w = torch.randn(16, 1024)
    err = (dequantize(quantize(w, fmt)) - w).pow(2).mean().sqrt().item()
    q4 = (dequantize(quantize(w, "q4_0")) - w).pow(2).mean().sqrt().item()
    assert err < {"q4_k": 0.9, "q6_k": 0.3}[fmt] * q4  # the scale search beats q4_0's absmax rounding


def test_kquant_layouts() -> None:
    assert FORMATS["q4_k"].row_bytes(4096) == 16 * 144 and FORMATS["q6_k"].row_bytes(4096) == 16 * 210
    w = torch.zeros(1, 256)
    w[0, 0], w[0, 32] = 15.0, 15.0  # sub-blocks 0 and 1: chunk 0's low and high nibbles of byte 16
    p = quantize(w, "q4_k")
    assert p.data[0, 16].item() == 0xFF and (p.data[0, 17:48] == 0).all()
    w = torch.zeros(1, 256)
    w[0, 64] = -1.0  # q6_k: element 64 is the high nibble of ql[0] and bits 4..5 of qh[0]
    p = quantize(w, "q6_k")
    assert p.data[0, 0].item() >> 4 == 0 and (p.data[0, 128].item() >> 4) & 3 == 0  # -32 + 32 = 0
    assert dequantize(p)[0, 64].item() == -1.0


def test_row_slices_and_bf16_input() -> None:
    w = torch.randn(40, 256).bfloat16()
    for fmt in FORMATS:
        p = quantize(w, fmt)
        assert torch.equal(dequantize(p, slice(8, 21)), dequantize(p)[8:21])
    ref = gguf.quants.quantize(w.float().numpy(), GGUF["q4_0"])
    assert np.array_equal(quantize(w, "q4_0").data.numpy(), ref)


def test_int8_per_row() -> None:
    w = torch.randn(5, 64)
    w[3] = 0
    p = quantize(w, "int8")
    assert p.data.shape == (5, 64) and p.scales.shape == (5,) and p.scales[3] == 0
    assert (p.data.view(torch.int8).abs().amax(1)[[0, 1, 2, 4]] == 127).all()
    assert (dequantize(p) - w).abs().max() <= p.scales.max() / 2 * 1.0001
    assert p.nbytes == 5 * 64 + 5 * 4


def test_layouts() -> None:
    assert FORMATS["q8_0"].bytes_per_block == 34 and FORMATS["q4_0"].bytes_per_block == 18
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16] = -8.0, 7.0  # d = 1: element 0 -> q 0 (low nibble of byte 0), 16 -> 15 (its high)
    p = quantize(w, "q4_0")
    assert p.data[0, :2].view(torch.float16).item() == 1.0 and p.data[0, 2].item() == 0xF0


def test_roundf_is_half_away_from_zero() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997])
    assert roundf(x).tolist() == [1.0, 2.0, 3.0, -1.0, -3.0, 0.0, -0.0]


@pytest.mark.parametrize("shape", [(4, 33), (4, 0 + 48), (32,)])
def test_errors_name_shape_and_remedy(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"quantize: .*shape") as e:
        quantize(torch.randn(shape), "q8_0")
    assert "multiple of" in str(e.value) or "reshape" in str(e.value)


def test_kquant_k_error_names_the_formats_that_fit() -> None:
    fits = r"shape \(4, 96\).*q4_k's block of 256.*take K = 96: int8, q4_0, q5_0, q8_0"
    with pytest.raises(ValueError, match=fits):
        quantize(torch.randn(4, 96), "q4_k")
    with pytest.raises(ValueError, match="unknown quantized format 'q5_k'"):
        quantize(torch.randn(4, 32), "q5_k")
