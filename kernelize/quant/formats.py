"""Quantized weight formats: the block layouts, and quantize / dequantize in torch.

A weight ``W[N, K]`` (an ``nn.Linear``'s: N output rows, K input features) is stored as raw bytes that the
decode kernels (:mod:`kernelize.quant.kernels`) read as they are:

* ``q8_0`` (GGUF / llama.cpp ``block_q8_0``): per 32 elements of a row, an f16 scale ``d`` and 32 int8
  values ``q``; the value is ``q * d``. 34 bytes per block.
* ``q4_0`` (``block_q4_0``): an f16 scale ``d`` and 16 bytes of nibbles: byte ``i`` holds element ``i`` in
  its low nibble and element ``i + 16`` in its high nibble; the value is ``(q - 8) * d``. 18 bytes per block.
* ``q5_0`` (``block_q5_0``): an f16 scale ``d``, 4 bytes ``qh`` whose bit ``j`` is bit 4 of element ``j``, and
  16 bytes of low nibbles laid out as ``q4_0``'s; the value is ``(q - 16) * d``. 22 bytes per block (llama.cpp
  stores the tensors of a ``Q4_K_M`` file whose rows are not a multiple of 256 as ``q5_0``).
* ``q4_k`` / ``q6_k`` (``block_q4_K`` / ``block_q6_K``): super-blocks of 256 elements with 6-bit scales
  and mins per 32 (q4_k, 144 bytes) or int8 scales per 16 (q6_k, 210 bytes); see
  :mod:`kernelize.quant.kquants`.
* ``int8``: per output row, symmetric int8 (``q * s``) with one f32 scale ``s`` per row, kept apart from the
  bytes (:attr:`PackedWeight.scales`).

The GGUF formats' bytes are laid out ``[N, K / block_size * bytes_per_block]``: row ``n``'s blocks are
contiguous, which is a GGUF tensor's layout too. Quantization is llama.cpp's reference rounding
(``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref``, ``quantize_row_q5_0_ref``) and agrees with the
``gguf`` package byte for byte; the k-quants port ``quantize_row_q4_K_ref`` / ``quantize_row_q6_K_ref``
(the ``gguf`` package only dequantizes those), and every format dequantizes bit for bit as the ``gguf``
package does.

Example:
    >>> import torch
    >>> p = quantize(torch.randn(64, 128), "q8_0")
    >>> p.data.shape, tuple(dequantize(p).shape)
    (torch.Size([64, 136]), (64, 128))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernelize.quant import kquants

BLOCK = 32  # the elements of one block, in every format (and of one block of a quantized activation row)


@dataclass(frozen=True)
class QuantFormat:
    """A weight format's layout.

    Attributes:
        name: the format's name (``FORMATS`` key).
        block_size: elements per block along K.
        bits: bits per stored value.
        scale_dtype: the scales' storage type.
        scale_per: ``"block"`` (inside each block's bytes) or ``"row"`` (one per output row, apart).
        has_min: whether a block also stores an offset subtracted from its values (q4_k's mins).
        bytes_per_block: the bytes of one block in the row's data (scales included when per block).

    Example:
        >>> FORMATS["q4_0"].row_bytes(4096)
        2304
    """

    name: str
    block_size: int
    bits: int
    scale_dtype: torch.dtype
    scale_per: str
    has_min: bool
    bytes_per_block: int

    def row_bytes(self, k: int) -> int:
        """The bytes of one stored row of ``k`` elements."""
        return k // self.block_size * self.bytes_per_block


FORMATS: dict[str, QuantFormat] = {
    "q8_0": QuantFormat("q8_0", BLOCK, 8, torch.float16, "block", False, 2 + BLOCK),
    "q4_0": QuantFormat("q4_0", BLOCK, 4, torch.float16, "block", False, 2 + BLOCK // 2),
    "q5_0": QuantFormat("q5_0", BLOCK, 5, torch.float16, "block", False, 2 + 4 + BLOCK // 2),
    "q4_k": QuantFormat("q4_k", kquants.QK_K, 4, torch.float16, "block", True, 144),
    "q6_k": QuantFormat("q6_k", kquants.QK_K, 6, torch.float16, "block", False, 210),
    "int8": QuantFormat("int8", BLOCK, 8, torch.float32, "row", False, BLOCK),
}


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A quantized ``[N, K]`` weight: its raw bytes (uint8 ``[N, format.row_bytes(K)]``), the format, the
    logical shape, and (``int8``) the f32 scale of each row.

    Example:
        >>> p = quantize(torch.ones(2, 32), "int8")
        >>> p.shape, p.scales.tolist()
        ((2, 32), [0.007874015718698502, 0.007874015718698502])
    """

    data: torch.Tensor
    format: QuantFormat
    shape: tuple[int, int]
    scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The bytes held: data plus separate scales."""
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() + extra


def apply_keeping_f32(
    module: torch.nn.Module, names: Sequence[str], apply: Any, fn: Any, recurse: bool
) -> torch.nn.Module:
    """``module._apply(fn)`` (``apply``: the base class's) with the f32 tensors ``names`` (row scales,
    biases: the packed kernels read them as f32) moved but never cast: ``model.to(torch.bfloat16)`` gave an
    int8 layer's outputs of 1e36 when its scales became bf16."""
    before = {n: t.detach() for n in names if isinstance(t := getattr(module, n), torch.Tensor)}
    apply(fn, recurse)  # (a parameter's data is replaced in place: `before` holds the old data)
    for name, old in before.items():
        new = getattr(module, name)
        if isinstance(new, torch.Tensor) and new.dtype != old.dtype:
            kept = old.to(new.device)
            if isinstance(new, torch.nn.Parameter):
                new.data = kept
            else:
                module._buffers[name] = kept
    return module


def get_format(fmt: str | QuantFormat) -> QuantFormat:
    """The :class:`QuantFormat` named ``fmt`` (or ``fmt`` itself); an unknown name is a ValueError."""
    if isinstance(fmt, QuantFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def check_weight(w: torch.Tensor, fmt: QuantFormat) -> None:
    """A weight ``fmt`` can hold: 2-d floating point with K a multiple of the block size."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(
            f"quantize: the weight must be a 2-d floating-point tensor [N, K], got shape {tuple(w.shape)} "
            f"dtype {w.dtype}; reshape it to [out_features, in_features]"
        )
    if w.shape[1] % fmt.block_size:
        fits = sorted(f.name for f in FORMATS.values() if w.shape[1] % f.block_size == 0)
        raise ValueError(
            f"quantize: weight of shape {tuple(w.shape)} has K = {w.shape[1]} input features, not a multiple "
            f"of {fmt.name}'s block of {fmt.block_size}; formats that take K = {w.shape[1]}: "
            f"{', '.join(fits) or 'none'}; or pad K to a multiple of {fmt.block_size} with zeros "
            "(and the input likewise), or leave this layer unquantized"
        )


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (half away from zero) in f32, the way gguf spells it: ``floor(a) + floor(2 (a -
    floor(a)))`` is exact where ``floor(a + 0.5)`` rounds 0.49999997 up."""
    a = x.abs()
    f = a.floor()
    return x.sign() * (f + (2 * (a - f)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def quantize(w: torch.Tensor, fmt: str | QuantFormat) -> PackedWeight:
    """``w`` [N, K] in format ``fmt``; rounding as llama.cpp's reference quantizers.

    Args:
        w: the weight, any floating dtype (quantized from its f32 values).
        fmt: ``"q8_0"``, ``"q4_0"``, ``"q5_0"``, ``"q4_k"``, ``"q6_k"``, ``"int8"`` or a :class:`QuantFormat`.

    Returns:
        The packed weight (its tensors on ``w``'s device, CPU for the kernels).

    Example:
        >>> quantize(torch.zeros(1, 32), "q4_0").data.shape
        torch.Size([1, 18])
    """
    fmt = get_format(fmt)
    check_weight(w, fmt)
    n, k = w.shape
    wf = w.detach().float()
    if fmt.name == "int8":
        d = wf.abs().amax(-1) / 127
        q = roundf(wf * _inverse(d)[:, None]).to(torch.int8)
        return PackedWeight(q.view(torch.uint8).contiguous(), fmt, (n, k), d.contiguous())
    if fmt.name in kquants.QUANTIZE:
        return PackedWeight(kquants.quantize_rows(wf, fmt.name), fmt, (n, k))
    b = wf.reshape(n, k // BLOCK, BLOCK)
    if fmt.name == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        qs = roundf(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    else:  # q4_0 / q5_0: d = (the first element of largest magnitude) / -2^(bits - 1)
        half = 1 << (fmt.bits - 1)
        d = b.gather(-1, b.abs().argmax(-1, keepdim=True)) / -half
        q = torch.trunc(b * _inverse(d) + (half + 0.5)).clamp(0, 2 * half - 1).to(torch.uint8)
        qs = (q[..., : BLOCK // 2] & 15) | ((q[..., BLOCK // 2 :] & 15) << 4)
        if fmt.name == "q5_0":  # bit 4 of element j as bit j of a little-endian u32
            bit = (q.to(torch.int64) >> 4) << torch.arange(BLOCK)
            qh = bit.sum(-1, keepdim=True)  # (distinct bits: the sum is the or)
            qh = ((qh >> torch.tensor([0, 8, 16, 24])) & 255).to(torch.uint8)
            qs = torch.cat([qh, qs], -1)
    blocks = torch.cat([d.to(torch.float16).view(torch.uint8), qs], -1)
    return PackedWeight(blocks.reshape(n, fmt.row_bytes(k)).contiguous(), fmt, (n, k))


def dequantize(packed: PackedWeight, rows: slice | None = None) -> torch.Tensor:
    """The f32 values of ``packed`` (of its rows ``rows`` only when given), exactly: every value is the
    product of a small integer and its scale.

    Example:
        >>> w = torch.tensor([[1.0] * 16 + [-2.0] * 16])
        >>> dequantize(quantize(w, "q4_0"))[0, [0, 16]].tolist()
        [1.0, -2.0]
    """
    fmt, (n, k) = packed.format, packed.shape
    rows = rows or slice(0, n)
    data = packed.data[rows]
    m = data.shape[0]
    if fmt.name == "int8":
        return data.view(torch.int8).float() * packed.scales[rows, None]
    if fmt.name in kquants.DEQUANTIZE:
        return kquants.dequantize_rows(data, fmt.name, k)
    b = data.reshape(m, k // BLOCK, fmt.bytes_per_block)
    d = b[..., :2].contiguous().view(torch.float16).float()
    qs = b[..., 2:]
    if fmt.name == "q8_0":
        q = qs.contiguous().view(torch.int8).float()
    elif fmt.name == "q5_0":
        qh = (qs[..., :4].to(torch.int64) << torch.tensor([0, 8, 16, 24])).sum(-1, keepdim=True)
        high = ((qh >> torch.arange(BLOCK)) & 1) << 4
        q = (torch.cat([qs[..., 4:] & 15, qs[..., 4:] >> 4], -1).to(torch.int64) | high).float() - 16
    else:
        q = torch.cat([qs & 15, qs >> 4], -1).float() - 8
    return (q * d).reshape(m, k)


__all__ = [
    "BLOCK",
    "FORMATS",
    "PackedWeight",
    "QuantFormat",
    "apply_keeping_f32",
    "check_weight",
    "dequantize",
    "get_format",
    "quantize",
]
