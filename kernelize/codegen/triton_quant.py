"""The Triton packed-weight matmul: ``templates/triton_quant.py.tmpl`` filled for one format and x dtype.

``out = x @ W.T + bias`` with ``W`` a :class:`~kernelize.quant.formats.PackedWeight` read as its raw bytes
and dequantized in registers. A format is spelled here once, as data (:data:`SPELLING`): which bytes of a
block hold a part's integers, how to decode them, and where the scale is. One kernel, ``<name>_mm``, serves
decode and prefill: tl.dot tiles (tensor cores for 16-bit x; the integers are exact in bf16 / f16) of at
least 16 rows, and for few output tiles (decode) the K blocks split over several programs whose f32
partials ``<name>_reduce`` sums, so a 1-row product still spreads over every SM.

Example:
    >>> src = render_quant("q4_0", torch.bfloat16)
    >>> "def kz_quant_q4_0_bf16_mm(" in src
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
    """A format's spelling in the template: ``parts`` of ``part_elems`` elements per block of 32; ``xk``: the
    index in the block of element ``e`` (an arange) of part ``p``; ``load``: lines that set ``q`` [EP, BN],
    the stored integers of part ``p`` of the blocks at byte offsets ``base``; ``scale``: the f32 scale of
    those blocks (rows ``rn``)."""

    parts: int
    part_elems: int
    xk: str
    load: str
    scale: str


_F16_SCALE = "tl.load(w_ptr.to(tl.pointer_type(tl.float16)) + base // 2, mask=ok, other=0.0).to(tl.float32)"
_WORDS = (  # the int16 words [BN, n] after a block's scale
    "tl.load(w_ptr.to(tl.pointer_type(tl.int16)) + (base // 2 + 1)[:, None] + tl.arange(0, {n})[None, :], "
    "mask=ok[:, None], other=0)"
)
SPELLING: dict[str, TritonFormat] = {
    # the 32 bytes after the scale (int16 words and an interleave measured no faster on an H200)
    "q8_0": TritonFormat(
        1,
        32,
        "e",
        "b = tl.load(w_ptr + base[None, :] + (2 + e)[:, None], mask=ok[None, :], other=0)\n"
        "    q = b.to(tl.int8, bitcast=True)",
        _F16_SCALE,
    ),
    # byte i holds element i (low nibble, part 0) and element i + 16 (high nibble, part 1): in the 8 words
    # [BN, 8] after the scale, element 2i (+ 16p) is nibble p of word i's low byte, 2i + 1 of its high byte
    # (6% faster decode on an H200 than byte loads)
    "q4_0": TritonFormat(
        2,
        16,
        "16 * p + e",
        "v = " + _WORDS.format(n=8) + "\n"
        "    q = tl.trans(tl.interleave((v >> (4 * p)) & 15, (v >> (8 + 4 * p)) & 15)) - 8  # [16, BN]",
        _F16_SCALE,
    ),
    "int8": TritonFormat(
        1,
        32,
        "e",
        "b = tl.load(w_ptr + base[None, :] + e[:, None], mask=ok[None, :], other=0)\n"
        "    q = b.to(tl.int8, bitcast=True)",
        "tl.load(s_ptr + rn, mask=ok, other=0.0)",
    ),
}
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
NUM_WARPS = 4
BN = 64
PROGRAMS = 264  # programs a launch aims for (two per SM of a 132-SM H100 / H200): decode splits K for them
REDUCE_BLOCK = 1024


def kernel_name(fmt: str, dtype: torch.dtype) -> str:
    """The kernel's name: ``kz_quant_<format>_<x dtype>``."""
    if dtype not in _DTYPES:
        raise ValueError(f"packed-weight kernels take x in {sorted(_DTYPES.values())}, got {dtype}")
    return f"kz_quant_{get_format(fmt).name}_{_DTYPES[dtype]}"


def render_quant(fmt: str, dtype: torch.dtype) -> str:
    """The Triton module of format ``fmt`` for x of ``dtype`` (``<name>_mm`` and ``<name>_reduce``)."""
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
        XK=sp.xk,
        LOAD=sp.load,
        SCALE=sp.scale,
        PRECISION=', input_precision="ieee"' if dtype == torch.float32 else "",
    )


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def launch_config(m: int, n: int, k: int, dtype: torch.dtype, interpret: bool) -> tuple[dict, tuple]:
    """(constexprs, grid) for ``m`` rows, ``n`` columns and ``k`` features. Few output tiles (decode) split
    the K blocks over several programs (a power of two, at least two blocks each, and the f32 partials no
    larger than a sixteenth of a float copy of the weight)."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = -(-n // BN) * -(-m // bm)
    want = -(-PROGRAMS // tiles)
    split = min(_pow2_floor(2 * want - 1), _pow2_floor(k // 64), _pow2_floor(k // (16 * m)), 16)
    meta = {"BM": bm, "BN": BN, "SPLIT": split, "UPCAST": interpret or dtype == torch.float32}
    return meta, (-(-n // BN), -(-m // bm), split)


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
    fns = {part: getattr(module, f"{name}_{part}") for part in ("mm", "reduce")}

    def launch(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        (m, k), n = x.shape, packed.shape[0]
        meta, grid = launch_config(m, n, k, dtype, interpret)
        data = packed.data if packed.data.data_ptr() % 2 == 0 else packed.data.clone()  # 16-bit reads
        scales = data if packed.scales is None else packed.scales  # unread by the GGUF formats
        b = out if bias is None else bias  # unread without HAS_BIAS
        split, has_bias = meta["SPLIT"], bias is not None
        dst = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=out.device)
        fns["mm"][grid](x, data, scales, b, dst, m, n, k, HAS_BIAS=has_bias, num_warps=NUM_WARPS, **meta)
        if split > 1:
            fns["reduce"][(-(-m * n // REDUCE_BLOCK),)](
                dst, b, out, m * n, n, HAS_BIAS=has_bias, SPLIT=split, BLOCK=REDUCE_BLOCK, num_warps=NUM_WARPS
            )

    return launch


def aot_jobs(fmt: str, dtype: torch.dtype, arch: int, path: str) -> list[dict]:
    """``triton.compile`` jobs (see :mod:`kernelize.codegen.triton_aot`): the matmul as a 1-row product
    of a 4096 x 4096 weight launches it (K split), as a 512-row one does, and the partials' reduction."""
    name = kernel_name(fmt, dtype)
    t = "*" + {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}[_DTYPES[dtype]]
    mm_sig = {"x_ptr": t, "w_ptr": "*u8", "s_ptr": "*fp32", "b_ptr": "*fp32", "o_ptr": t, "M": "i32"}
    mm_sig.update({"N": "i32", "K": "i32"})
    red_sig = {"part_ptr": "*fp32", "b_ptr": "*fp32", "o_ptr": t, "MN": "i32", "N": "i32"}
    jobs = []
    for fn, sig, consts in (
        ("mm", mm_sig, launch_config(1, 4096, 4096, dtype, interpret=False)[0]),
        ("mm", mm_sig, launch_config(512, 4096, 4096, dtype, interpret=False)[0]),
        ("reduce", red_sig, {"SPLIT": 8, "BLOCK": REDUCE_BLOCK}),
    ):
        consts = {"HAS_BIAS": True, **consts}
        jobs.append(
            {
                "path": path,
                "name": f"{name}_{fn}",
                "signature": {**sig, **dict.fromkeys(consts, "constexpr")},
                "constexprs": consts,
                "arch": arch,
                "num_warps": NUM_WARPS,
            }
        )
    return jobs


__all__ = [
    "SPELLING",
    "TritonFormat",
    "aot_jobs",
    "compile_quant",
    "kernel_name",
    "render_quant",
]
