"""llama.cpp's k-quants ``q4_k`` and ``q6_k``: super-blocks of 256 elements, quantized / dequantized in torch.

Layouts (GGML's ``block_q4_K`` / ``block_q6_K``, as the ``gguf`` package reads them):

* ``q4_k``, 144 bytes: f16 ``d``, f16 ``dmin``, 12 bytes of 6-bit scales ``sc[8]`` and mins ``m[8]`` (one
  pair per 32 elements), 128 bytes of nibbles: byte ``32 c + l`` holds element ``64 c + l`` in its low nibble
  and ``64 c + 32 + l`` in its high one. The value of ``q`` in sub-block ``j`` is ``(d sc_j) q - dmin m_j``.
* ``q6_k``, 210 bytes: ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), int8 ``scales[16]`` (one per 16
  elements), f16 ``d``; the value is ``(d scales_i) (q - 32)``.

The quantizers port llama.cpp's reference ones (``quantize_row_q4_K_ref`` with ``make_qkx2_quants``,
``quantize_row_q6_K_ref`` with ``make_qx_quants``), which the ``gguf`` package does not implement, vectorised
over the sub-blocks. Every sum runs element by element in the C code's order and every product is
evaluated as the C source writes it, in f32 (no fused multiply-add), so the bytes are what the reference
writes when compiled without floating-point contraction.

Example:
    >>> import torch
    >>> from kernelize.quant.formats import quantize, dequantize
    >>> p = quantize(torch.randn(2, 256), "q4_k")
    >>> p.data.shape
    torch.Size([2, 144])
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256  # the elements of one super-block
CHUNK = 1 << 16  # elements quantized at once (bounds the temporaries of a big weight)
_EPS = 1e-15  # llama.cpp's GROUP_MAX_EPS: a group below it is all zero


def _f32(v: float) -> float:
    """``v`` rounded to f32 (a Python float that is exactly an f32 value)."""
    return float(np.float32(v))


def _seqsum(t: torch.Tensor, from_zero: bool = True) -> torch.Tensor:
    """The f32 sum over the first dimension in order, as a C loop ``s += t[i]`` (``from_zero``: ``s = 0``
    first, else ``s = t[0]``); torch's own sums reassociate. Element-major ``[n, ...]`` keeps each step a
    contiguous add."""
    acc = t[0] + 0.0 if from_zero else t[0].clone()  # 0 + -0 is +0, as in C
    for i in range(1, t.shape[0]):
        acc += t[i]
    return acc


def _over(num: float, den: torch.Tensor) -> torch.Tensor:
    """The f32 quotient ``num / den`` elementwise."""
    return torch.full_like(den, num) / den


def _div(t: torch.Tensor, den: float) -> torch.Tensor:
    """The f32 quotient ``t / den`` by a true division (torch may multiply by the reciprocal of a scalar
    divisor, which rounds differently)."""
    return t / torch.full_like(t, den)


def _qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
          nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``make_qkx2_quants`` (squared error) over the columns of ``x`` [n, B] (element-major) with weights
    ``w``: the levels L [n, B], the scale and the min (positive, subtracted) [B]."""
    mn = x.amin(0).clamp(max=0)
    mx = x.amax(0)
    sum_w, sum_x = _seqsum(w, False), _seqsum(w * x, False)
    flat = mx == mn
    iscale = _over(float(nmax), mx - mn)
    scale = _over(1.0, iscale)
    levels = torch.round(iscale * (x - mn)).clamp(0, nmax)
    diff = scale * levels + mn - x
    best = _seqsum(w * (diff * diff))
    for step in range(nstep + 1):
        num = _f32(_f32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax))
        la = torch.round(_over(num, mx - mn) * (x - mn)).clamp(0, nmax)
        wl = w * la
        sum_l, sum_l2, sum_xl = _seqsum(torch.stack([wl, wl * la, wl * x], 1))
        d = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / d
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d
        pos = this_min > 0
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        diff = this_scale * la + this_min - x
        cur = _seqsum(w * (diff * diff))
        better = (d > 0) & (cur < best)
        levels = torch.where(better, la, levels)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    levels = torch.where(flat, torch.zeros_like(levels), levels)
    return levels, torch.where(flat, torch.zeros_like(scale), scale), -mn


def _first_top(x: torch.Tensor) -> torch.Tensor:
    """Per column of ``x`` [n, B], the first element of largest magnitude (C's ``if (ax > amax)`` scan)."""
    return x.gather(0, x.abs().argmax(0, keepdim=True))[0]


def _qx(x: torch.Tensor, nmax: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants`` with ``rmse_type`` 1 (weights ``x^2``) over the columns of ``x`` [n, B]: the
    levels (offset by ``nmax``) [n, B] and the scale [B]."""
    top = _first_top(x)
    zero = top.abs() < _EPS
    w = x * x
    wx = w * x

    def fit(num: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lv = torch.round(_over(num, top) * x).clamp(-nmax, nmax - 1)
        sumlx, suml2 = _seqsum(torch.stack([wx * lv, w * lv * lv], 1))
        return lv + nmax, sumlx, suml2

    levels, sumlx, suml2 = fit(-float(nmax))
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(suml2))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        lv, sumlx, suml2 = fit(-_f32(np.float32(nmax) + np.float32(0.1) * np.float32(step)))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = torch.where(better, lv, levels)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    levels = torch.where(zero, torch.zeros_like(levels), levels)
    return levels, torch.where(zero, torch.zeros_like(scale), scale)


def _half(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` as f16 bytes [..., 2] and the f32 value those hold."""
    h = v.to(torch.float16)
    return h.view(torch.uint8).reshape(*v.shape, 2), h.float()


def _pack_scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """The 12 bytes of q4_k's eight 6-bit scales and mins ([S, 8] each, uint8)."""
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    hi = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return torch.cat([lo, mid, hi], -1)


def unpack_scales_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k's scales and mins [S, 8] (int64) from their 12 bytes [S, 12] (llama.cpp's
    ``get_scale_min_k4``)."""
    b = b.long()
    sc = torch.cat([b[:, 0:4] & 63, (b[:, 8:12] & 15) | ((b[:, 0:4] >> 6) << 4)], -1)
    mn = torch.cat([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], -1)
    return sc, mn


def _six_bits(v: torch.Tensor) -> torch.Tensor:
    """``MIN(63, (uint8_t)nearest_int(v))``."""
    return (torch.round(v).long() & 255).clamp(max=63).to(torch.uint8)


def _q4_k_blocks(x: torch.Tensor) -> torch.Tensor:
    """``quantize_row_q4_K_ref`` of super-blocks ``x`` [S, 256] (f32): bytes [S, 144]."""
    s = x.shape[0]
    sub = x.reshape(s * 8, 32)
    xt = sub.T.contiguous()
    # sqrtf(sum / 32), through f64: torch's f32 sqrt is not correctly rounded
    av = torch.sqrt(_div(_seqsum(xt * xt), 32.0).double()).float()
    levels, scales, mins = _qkx2(xt, av + xt.abs())
    levels = levels.T
    scales, mins = scales.reshape(s, 8), mins.reshape(s, 8)
    top = torch.stack([scales.amax(-1), mins.amax(-1)])
    max_scale, max_min = torch.where(top > 0, top, torch.zeros_like(top))  # from +0, as C's scan
    inv_scale = torch.where(max_scale > 0, _over(63.0, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _over(63.0, max_min), torch.zeros_like(max_min))
    ls, lm = _six_bits(inv_scale[:, None] * scales), _six_bits(inv_min[:, None] * mins)
    d_bytes, d = _half(_div(max_scale, 63.0))
    m_bytes, dmin = _half(_div(max_min, 63.0))
    dl = (d[:, None] * ls.float()).reshape(-1, 1)
    dm = (dmin[:, None] * lm.float()).reshape(-1, 1)
    fresh = torch.round((sub + dm) / dl).clamp(0, 15)
    levels = torch.where(dl != 0, fresh, levels).to(torch.uint8).reshape(s, 4, 2, 32)
    qs = (levels[:, :, 0] | (levels[:, :, 1] << 4)).reshape(s, 128)
    return torch.cat([d_bytes, m_bytes, _pack_scales_k4(ls, lm), qs], -1)


def _q6_k_blocks(x: torch.Tensor) -> torch.Tensor:
    """``quantize_row_q6_K_ref`` of super-blocks ``x`` [S, 256] (f32): bytes [S, 210]."""
    s = x.shape[0]
    sub = x.reshape(s * 16, 16)
    levels, scales = _qx(sub.T.contiguous())
    levels = levels.T
    scales = scales.reshape(s, 16)
    top = _first_top(scales.T)
    zero = top.abs() < _EPS
    iscale = _over(-128.0, top)
    d_bytes, d = _half(_over(1.0, iscale))
    sc = torch.round(iscale[:, None] * scales).clamp(max=127)
    dl = (d[:, None] * sc).reshape(-1, 1)
    fresh = torch.round(sub / dl).clamp(-32, 31) + 32
    q = torch.where(dl != 0, fresh, levels).to(torch.uint8).reshape(s, 2, 4, 32)  # [half, quarter, l]
    low = q & 15
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    sc_bytes = sc.to(torch.int8).view(torch.uint8)
    out = torch.cat([ql.reshape(s, 128), qh.reshape(s, 64), sc_bytes, d_bytes], -1)
    return torch.where(zero[:, None], torch.zeros_like(out), out)


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """Super-blocks' bytes [S, 144] -> f32 [S, 256], as ``gguf.quants`` computes them."""
    s = b.shape[0]
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    sc, mn = unpack_scales_k4(b[:, 4:16])
    qs = b[:, 16:].reshape(s, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], 2).reshape(s, 8, 32).float()
    return ((d * sc.float())[..., None] * q - (dmin * mn.float())[..., None]).reshape(s, QK_K)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """Super-blocks' bytes [S, 210] -> f32 [S, 256], as ``gguf.quants`` computes them."""
    s = b.shape[0]
    ql, qh = b[:, :128].reshape(s, 2, 64), b[:, 128:192].reshape(s, 2, 1, 32)
    d = b[:, 208:210].contiguous().view(torch.float16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    lo = torch.cat([ql & 15, ql >> 4], -1)  # [S, 2, 128]
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    q = ((lo | (hi.reshape(s, 2, 128) << 4)).to(torch.int8) - 32).float().reshape(s, 16, 16)
    return ((d * scales)[..., None] * q).reshape(s, QK_K)


QUANTIZE = {"q4_k": _q4_k_blocks, "q6_k": _q6_k_blocks}
DEQUANTIZE = {"q4_k": _dequantize_q4_k, "q6_k": _dequantize_q6_k}


def quantize_rows(w: torch.Tensor, name: str) -> torch.Tensor:
    """``w`` [N, K] (f32, K a multiple of 256) as format ``name``'s bytes [N, K / 256 * bytes].

    The search runs thousands of small torch ops; it runs on one intra-op thread, since forking a team per
    op cost 7 to 10x its time on a loaded 2-core machine (0.45 s per million q4_k weights on one thread
    against 4.8 s on two)."""
    n, k = w.shape
    blocks = w.reshape(-1, QK_K)
    step = max(1, CHUNK // QK_K)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = torch.cat([QUANTIZE[name](blocks[i : i + step]) for i in range(0, blocks.shape[0], step)])
    finally:
        torch.set_num_threads(threads)
    return out.reshape(n, -1).contiguous()


def dequantize_rows(data: torch.Tensor, name: str, k: int) -> torch.Tensor:
    """Format ``name``'s bytes [M, K / 256 * bytes] as f32 [M, K]."""
    m = data.shape[0]
    return DEQUANTIZE[name](data.reshape(m * (k // QK_K), -1)).reshape(m, k)


__all__ = ["DEQUANTIZE", "QK_K", "QUANTIZE", "dequantize_rows", "quantize_rows", "unpack_scales_k4"]
