"""The Triton packed-weight matmul: ``templates/triton_quant.py.tmpl`` filled for one format and x dtype.

``out = x @ W.T + bias`` with ``W`` a :class:`~kernelize.quant.formats.PackedWeight` read as its raw bytes
and dequantized in registers. A format is spelled here once, as data (:data:`SPELLING`): which bytes of a
block hold a part's integers, how to decode them, and where the scale is. Two kernels share it: ``_gemv``
for up to :data:`GEMV_ROWS` rows (decode; a broadcast multiply and a sum, no 16-row padding of tl.dot) and
``_dot`` for more (prefill; tl.dot tiles on tensor cores, the integers exact in x's 16-bit type).

Example:
    >>> src = render_quant("q4_0", torch.bfloat16)
    >>> "def kz_quant_q4_0_bf16_gemv(" in src
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernelize.codegen.template import fill, load_template
from kernelize.quant.formats import PackedWeight, get_format
from kernelize.runtime.backend import KernelCompileError


@dataclass(frozen=True)
class TritonFormat:
    """A format's spelling in the template: ``parts`` of ``part_elems`` elements per block of 32; ``byte``:
    the byte offset in the block of element ``e`` (an arange) of part ``p``; ``quant``: the stored integer
    from the loaded uint8 ``b``; ``scale``: the f32 scale of the blocks at ``base`` (rows ``rn``)."""

    parts: int
    part_elems: int
    byte: str
    quant: str
    scale: str


_F16_SCALE = "NAME_f16(w_ptr, base, ok)"  # the block's leading f16 (NAME: the kernel's, filled below)
SPELLING: dict[str, TritonFormat] = {
    "q8_0": TritonFormat(1, 32, "2 + e", "b.to(tl.int8, bitcast=True)", _F16_SCALE),
    # byte i holds element i (low nibble, part 0) and element i + 16 (high nibble, part 1)
    "q4_0": TritonFormat(2, 16, "2 + e", "((b >> (4 * p)) & 15).to(tl.int8) - 8", _F16_SCALE),
    "int8": TritonFormat(
        1, 32, "e", "b.to(tl.int8, bitcast=True)", "tl.load(s_ptr + rn, mask=ok, other=0.0)"
    ),
}
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
GEMV_ROWS = 8  # rows up to which the gemv kernel runs
NUM_WARPS = 4


def kernel_name(fmt: str, dtype: torch.dtype) -> str:
    """The kernel's name: ``kz_quant_<format>_<x dtype>``."""
    if dtype not in _DTYPES:
        raise ValueError(f"packed-weight kernels take x in {sorted(_DTYPES.values())}, got {dtype}")
    return f"kz_quant_{get_format(fmt).name}_{_DTYPES[dtype]}"


def render_quant(fmt: str, dtype: torch.dtype) -> str:
    """The Triton module of format ``fmt`` for x of ``dtype`` (``<name>_gemv`` and ``<name>_dot``)."""
    name, f = kernel_name(fmt, dtype), get_format(fmt)
    sp = SPELLING[f.name]
    return fill(
        load_template("triton_quant.py.tmpl"),
        PRELUDE=fill(load_template("triton_prelude.py.tmpl"), KERNEL=name),
        NAME=name,
        FORMAT=f.name,
        BPB=str(f.bytes_per_block),
        P=str(sp.parts),
        EP=str(sp.part_elems),
        BYTE=sp.byte,
        QUANT=sp.quant,
        SCALE=sp.scale.replace("NAME", name),
        PRECISION=', input_precision="ieee"' if dtype == torch.float32 else "",
    )


def launch_config(m: int, n: int, dtype: torch.dtype, interpret: bool) -> tuple[str, dict, tuple[int, int]]:
    """(kernel suffix, constexprs, grid) for ``m`` rows and ``n`` columns."""
    if m <= GEMV_ROWS:
        bm = 1 << max(0, m - 1).bit_length()
        bn = 64 if bm <= 2 else 32  # the [BM, 32, BN] product stays within 16 f32 registers a thread
        meta = {"BM": bm, "BN": bn, "G": 4}
        return "gemv", meta, (-(-n // bn), -(-m // bm))
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    meta = {"BM": bm, "BN": 64, "UPCAST": interpret or dtype == torch.float32}
    return "dot", meta, (-(-n // 64), -(-m // bm))


def compile_quant(fmt: str, dtype: torch.dtype, interpret: bool) -> Callable[..., None]:
    """Load format ``fmt``'s module for x of ``dtype`` (disk + memory cached) and return
    ``launch(x, packed, bias, out)``: x ``[M, K]`` contiguous, bias f32 ``[N]`` or None, out ``[M, N]`` in
    x's dtype, every tensor on one device (CPU tensors only under the interpreter)."""
    from kernelize.codegen.triton_base import load_module
    from kernelize.runtime.cache import KERNELS

    source, name = render_quant(fmt, dtype), kernel_name(fmt, dtype)
    key = (hashlib.sha256(source.encode()).hexdigest(), "interpret" if interpret else "cuda")
    try:
        module = KERNELS.get_or_build(key, lambda: load_module(source, name, interpret))
    except Exception as e:
        raise KernelCompileError(name, key[0], f"{type(e).__name__}: {e}", source, "triton") from e
    fns = {part: getattr(module, f"{name}_{part}") for part in ("gemv", "dot")}

    def launch(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        (m, k), n = x.shape, packed.shape[0]
        part, meta, grid = launch_config(m, n, dtype, interpret)
        scales = packed.data if packed.scales is None else packed.scales  # unread by the GGUF formats
        b = out if bias is None else bias  # unread without HAS_BIAS
        fns[part][grid](
            x, packed.data, scales, b, out, m, n, k, HAS_BIAS=bias is not None, num_warps=NUM_WARPS, **meta
        )

    return launch


def aot_jobs(fmt: str, dtype: torch.dtype, arch: int, path: str) -> list[dict]:
    """``triton.compile`` jobs (see :mod:`kernelize.codegen.triton_aot`) for the decode kernel at one row
    and the prefill kernel at 64-row tiles."""
    name = kernel_name(fmt, dtype)
    t = "*" + {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}[_DTYPES[dtype]]
    sig = {"x_ptr": t, "w_ptr": "*u8", "s_ptr": "*fp32", "b_ptr": "*fp32", "o_ptr": t}
    sig.update({"M": "i32", "N": "i32", "K": "i32"})
    jobs = []
    for part, m in (("gemv", 1), ("dot", 512)):
        _, meta, _ = launch_config(m, 4096, dtype, interpret=False)
        consts = {"HAS_BIAS": True, **meta}
        jobs.append(
            {
                "path": path,
                "name": f"{name}_{part}",
                "signature": {**sig, **dict.fromkeys(consts, "constexpr")},
                "constexprs": consts,
                "arch": arch,
                "num_warps": NUM_WARPS,
            }
        )
    return jobs


__all__ = [
    "GEMV_ROWS",
    "SPELLING",
    "TritonFormat",
    "aot_jobs",
    "compile_quant",
    "kernel_name",
    "render_quant",
]
