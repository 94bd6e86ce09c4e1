"""``linear(x, packed, bias)``: a matmul against a packed weight, the torch-callable entry.

Up to :data:`FEW_ROWS` rows (decode) run the generated few-row kernel, which reads the packed bytes and
never widens the weight in memory. More rows (prefill) are compute-bound: the weight is dequantized a panel
of :data:`PANEL_ROWS` output rows at a time into one f32 scratch and each panel goes through ``torch.mm``
into its slice of the output, so no full float copy of the weight is ever held.

Example:
    >>> import torch
    >>> from kernelize.quant.formats import quantize
    >>> p = quantize(torch.randn(16, 64), "q8_0")
    >>> linear(torch.randn(2, 64), p).shape  # doctest: +SKIP
    torch.Size([2, 16])
"""

from __future__ import annotations

import torch

from kernelize.quant import kernels
from kernelize.quant.formats import PackedWeight

FEW_ROWS = 8  # rows up to which the packed kernel runs (decode); above, panels of dequantized weight
PANEL_ROWS = 256  # output rows per dequantized panel (256 x 4096 f32: 4 MiB, stays in the last-level cache)


def _check(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(packed, PackedWeight):
        raise TypeError(
            f"linear: `packed` must be a PackedWeight (from quantize()), got {type(packed).__name__}"
        )
    n, k = packed.shape
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(
            f"linear: input x has dtype {x.dtype}; the packed kernels take float32 or bfloat16, so "
            "convert it first (x.float() or x.bfloat16())"
        )
    if x.device.type != "cpu":
        raise ValueError(
            f"linear: input x is on {x.device}; the packed kernels run on the CPU, move it there"
        )
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(
            f"linear: input x of shape {tuple(x.shape)} does not match the packed weight [N={n}, K={k}]: x's "
            f"last dimension must be K = {k}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"linear: bias of shape {tuple(bias.shape)} must be 1-d of length N = {n}")


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` the packed weight's values.

    Args:
        x: ``[..., K]`` float32 or bfloat16 on the CPU.
        packed: the weight ``[N, K]`` (:func:`kernelize.quant.formats.quantize`).
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype. Decode rows quantize ``x`` to int8 blocks of 32 (the llama.cpp
        scheme), so they differ from a float product by that rounding; prefill rows multiply in f32.

    Example:
        >>> from kernelize.quant.formats import quantize
        >>> linear(torch.ones(1, 32), quantize(torch.ones(4, 32), "int8")).tolist()  # doctest: +SKIP
        [[32.0, 32.0, 32.0, 32.0]]
    """
    _check(x, packed, bias)
    n, k = packed.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return out.reshape(*lead, n)
    b = None if bias is None else bias.detach().float().contiguous()
    if m <= FEW_ROWS:
        kernels.gemv(x2, packed, b, out)
    else:
        _panels(x2.float(), packed, b, out)
    return out.reshape(*lead, n)


def _panels(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Prefill: ``out[:, n0:n1] = x @ W[n0:n1].T`` panel by panel from one f32 scratch. The product is
    built transposed (``[N, M]``) so each panel's result is a contiguous slice that ``torch.mm`` writes."""
    n, k = packed.shape
    rows = min(PANEL_ROWS, n)
    scratch = torch.empty(rows * k, dtype=torch.float32)
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    for n0 in range(0, n, rows):
        n1 = min(n0 + rows, n)
        torch.mm(kernels.dequantize_rows(packed, n0, n1, scratch), x.T, out=out_t[n0:n1])
    if bias is not None:
        out_t += bias[:, None]
    out.copy_(out_t.T)


__all__ = ["FEW_ROWS", "PANEL_ROWS", "linear"]
