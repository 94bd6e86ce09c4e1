"""The CUDA C packed-weight matmul: ``templates/cuda_quant.cu`` filled for one format and x dtype (NVRTC).

``out = x @ W.T + bias`` with ``W`` a :class:`~kernelize.quant.formats.PackedWeight` read as its raw bytes.
A format is spelled once, as the body of ``kz_chunk`` (:data:`CHUNKS`): eight consecutive elements of a row
dequantized into registers. ``<name>_gemv1`` / ``_gemv4`` (up to :data:`GEMV_ROWS` rows, 8 a block: a warp
per 1 or 4 output columns reading the rows' blocks in order) serve decode, ``<name>_mm`` (64 x 64
shared-memory tiles, a 4 x 4 register tile a thread, f32 FMAs: no tensor cores) prefill. M, N and K are
run-time ``int64_t`` arguments: one cubin per (format, dtype, arch).

Example:
    >>> source, name = render_quant("q8_0", torch.bfloat16)
    >>> name, "kz_quant_q8_0_bf16_gemv1(" in source
    ('kz_quant_q8_0_bf16', True)
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch

from kernelize.codegen.template import fill, load_template
from kernelize.codegen.triton_quant import kernel_name
from kernelize.quant.formats import PackedWeight, get_format

_GGUF_HEAD = (
    "  const uint8_t* blk = w + n * rb + (c >> 2) * KZ_BPB;  // four chunks per block\n"
    "  const float d = kz_f16_at(blk);\n"
)
# the body of kz_chunk(w, s, n, rb, c, v): elements 8c .. 8c + 7 of row n into v
CHUNKS: dict[str, str] = {
    "q8_0": _GGUF_HEAD
    + "  const uint8_t* q = blk + 2 + (c & 3) * 8;\n"
    + "  for (int j = 0; j < 8; ++j) v[j] = d * (float)(int8_t)q[j];",
    # byte i holds element i (low nibble) and element i + 16 (high): chunks 0, 1 the low nibbles of bytes
    # 0..7, 8..15; chunks 2, 3 their high nibbles
    "q4_0": _GGUF_HEAD
    + "  const uint8_t* q = blk + 2 + (c & 1) * 8;\n"
    + "  const int shift = (c & 2) * 2;\n"
    + "  for (int j = 0; j < 8; ++j) v[j] = d * (float)(((q[j] >> shift) & 15) - 8);",
    "int8": "  const uint8_t* q = w + n * rb + c * 8;\n"
    "  const float d = s[n];\n"
    "  for (int j = 0; j < 8; ++j) v[j] = d * (float)(int8_t)q[j];",
}
_C_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
THREADS, WARPS, MT, BM, BN = 256, 8, 8, 64, 64  # KZ_THREADS, KZ_WARPS, KZ_MT, KZ_BM, KZ_BN of the template
GEMV_ROWS = 32  # rows up to which gemv (one pass over the weight per KZ_MT rows) beats the tiles
GEMV1_ROWS = 2  # rows up to which a warp takes one column (more warps), above four (x loads reused)


class QuantLaunch(NamedTuple):
    """One call: the entry point (``gemv1``, ``gemv4`` or ``mm``), pointer values, int64 values, the grid."""

    part: str
    ptrs: list[int]
    ints: list[int]
    grid: tuple[int, int, int]


def render_quant(fmt: str, dtype: torch.dtype) -> tuple[str, str]:
    """The CUDA C source of format ``fmt`` for x of ``dtype`` and its name (entry points ``<name>_gemv``
    and ``<name>_mm``)."""
    name, f = kernel_name(fmt, dtype), get_format(fmt)
    source = fill(
        load_template("cuda_quant.cu"),
        KERNEL=name,
        NAME=name,
        FORMAT=f.name,
        PRELUDE=load_template("cuda_prelude.cuh"),
        BPB=str(f.bytes_per_block),
        T=_C_TYPES[dtype],
        CHUNK=CHUNKS[f.name],
    )
    return source, name


def launch_args(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> QuantLaunch:
    """The launch of ``out = x @ W.T + bias`` (x ``[M, K]`` contiguous, bias f32 ``[N]`` or None)."""
    (m, k), n = x.shape, packed.shape[0]
    scales = 0 if packed.scales is None else packed.scales.data_ptr()
    ptrs = [
        x.data_ptr(),
        packed.data.data_ptr(),
        scales,
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
    ]
    if m <= GEMV_ROWS:
        cols = 1 if m <= GEMV1_ROWS else 4
        return QuantLaunch(f"gemv{cols}", ptrs, [m, n, k], (-(-n // (WARPS * cols)), -(-m // MT), 1))
    return QuantLaunch("mm", ptrs, [m, n, k], (-(-n // BN), -(-m // BM), 1))


def compile_quant(fmt: str, dtype: torch.dtype, arch: str) -> Callable[..., None]:
    """NVRTC-compile (disk-cached) and return ``launch(x, packed, bias, out)`` for CUDA tensors."""
    from kernelize.codegen.nvrtc import CubinModule, compile_cubin, require_driver

    source, name = render_quant(fmt, dtype)
    cubin = compile_cubin(source, name, arch)
    fns = {part: CubinModule(cubin, f"{name}_{part}") for part in ("gemv1", "gemv4", "mm")}
    p, i64 = ctypes.c_void_p, ctypes.c_int64

    def launch(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        require_driver()
        call = launch_args(x, packed, bias, out)
        args = [(v, p) for v in call.ptrs] + [(v, i64) for v in call.ints]
        fns[call.part].launch(call.grid, (THREADS, 1, 1), args, out.device.index or 0)

    return launch


__all__ = ["CHUNKS", "GEMV1_ROWS", "GEMV_ROWS", "QuantLaunch", "compile_quant", "launch_args", "render_quant"]
