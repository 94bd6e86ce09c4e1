"""Weights that stay packed: GGUF ``q8_0`` / ``q4_0`` / ``q4_k`` / ``q6_k`` and per-channel ``int8``
formats, CPU kernels for each and CUDA kernels (``q8_0``, ``q4_0``, ``int8``) that read the packed bytes,
and a module / model rewrite that uses them.

Example:
    >>> import torch
    >>> from kernelize import quant
    >>> lin = quant.QuantizedLinear.from_linear(torch.nn.Linear(64, 8), "q8_0")
    >>> lin(torch.randn(1, 64)).shape  # doctest: +SKIP
    torch.Size([1, 8])
"""

from __future__ import annotations

from kernelize.quant.formats import FORMATS, PackedWeight, QuantFormat, dequantize, quantize
from kernelize.quant.module import QuantizedLinear, QuantizeSummary, quantize_model
from kernelize.quant.ops import linear

__all__ = [
    "FORMATS",
    "PackedWeight",
    "QuantFormat",
    "QuantizeSummary",
    "QuantizedLinear",
    "dequantize",
    "linear",
    "quantize",
    "quantize_model",
]
