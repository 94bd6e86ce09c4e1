"""Triton code generation basics shared by the kernel writers (:mod:`~kernelize.codegen.triton`,
:mod:`~kernelize.codegen.triton_rows`, :mod:`~kernelize.codegen.triton_attention`) and the ahead-of-time
compiler (:mod:`~kernelize.codegen.triton_aot`): the expression renderer, index unflattening, and loading a
generated module from the checked cache folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kernelize.autokernel.kernels import Compute
from kernelize.codegen.render import Renderer, call, float_call
from kernelize.ir.dtypes import HALF, DType, compute_dtype
from kernelize.ir.graph import Op
from kernelize.ir.shapes import Dim
from kernelize.runtime import diskcache

TL = {
    DType.F16: "tl.float16",
    DType.BF16: "tl.bfloat16",
    DType.F32: "tl.float32",
    DType.F64: "tl.float64",
    DType.I8: "tl.int8",
    DType.I16: "tl.int16",
    DType.I32: "tl.int32",
    DType.I64: "tl.int64",
    DType.U8: "tl.uint8",
    DType.BOOL: "tl.int1",
}
# pointer element types for triton.compile signatures
SIG = {
    DType.F16: "fp16",
    DType.BF16: "bf16",
    DType.F32: "fp32",
    DType.F64: "fp64",
    DType.I8: "i8",
    DType.I16: "i16",
    DType.I32: "i32",
    DType.I64: "i64",
    DType.U8: "u8",
    DType.BOOL: "i1",
}
_NAN = "tl.PropagateNan.ALL"


def _minmax(fn: str):
    def render(r: Renderer, e: Compute, a: Sequence[str]) -> str:
        nan = f", propagate_nan={_NAN}" if e.dtype.is_float else ""
        return f"tl.{fn}({a[0]}, {a[1]}{nan})"

    return render


def _clamp(r: Renderer, e: Compute, a: Sequence[str]) -> str:
    lo, hi = e.arg.lo, e.arg.hi
    nan = f", propagate_nan={_NAN}" if e.dtype.is_float else ""
    out = a[0]
    if lo != float("-inf"):
        out = f"tl.maximum({out}, {r.literal(lo, e.dtype)}{nan})"
    if hi != float("inf"):
        out = f"tl.minimum({out}, {r.literal(hi, e.dtype)}{nan})"
    return out


class TritonRenderer(Renderer):
    """Triton expressions for elementwise ops (helpers ``kz_*`` live in ``triton_prelude.py.tmpl``)."""

    OP_RENDER = {
        **Renderer.OP_RENDER,
        Op.ABS: call("tl.abs"),
        Op.EXP: call("tl.exp"),
        Op.LOG: call("tl.log"),
        Op.SQRT: lambda r, e, a: f"tl.sqrt_rn({a[0]})" if e.dtype is DType.F32 else f"tl.sqrt({a[0]})",
        Op.RSQRT: call("tl.rsqrt"),
        Op.SIN: call("tl.sin"),
        Op.COS: call("tl.cos"),
        Op.TANH: call("kz_tanh"),
        Op.SIGMOID: call("tl.sigmoid"),
        Op.ERF: call("tl.math.erf"),
        Op.SOFTPLUS: call("kz_softplus"),
        Op.FLOOR: float_call("tl.floor"),
        Op.CEIL: float_call("tl.ceil"),
        Op.ROUND: float_call("kz_round"),
        Op.SIGN: call("kz_sign"),
        Op.NOT: lambda r, e, a: f"({a[0]} == 0)",
        Op.CLAMP: _clamp,
        Op.DIV: lambda r, e, a: f"({a[0]} / {a[1]})" if e.dtype.is_float else f"({a[0]} // {a[1]})",
        Op.MIN: _minmax("minimum"),
        Op.MAX: _minmax("maximum"),
        Op.POW: call("kz_pow"),
        Op.MOD: lambda r, e, a: f"({a[0]} % {a[1]})" if e.dtype.is_float else f"kz_imod({a[0]}, {a[1]})",
        Op.AND: lambda r, e, a: f"({a[0]} & {a[1]})",
        Op.OR: lambda r, e, a: f"({a[0]} | {a[1]})",
        Op.WHERE: lambda r, e, a: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    }

    def ctype(self, dtype: DType) -> str:
        return TL[compute_dtype(dtype)]

    def cast(self, value: str, dtype: DType) -> str:
        if dtype is DType.BOOL:
            return f"({value} != 0)"
        if dtype in HALF:  # an explicit cast rounds, even though arithmetic stays in f32
            return f"{value}.to({TL[dtype]}).to(tl.float32)"
        return f"{value}.to({TL[dtype]})"

    def literal(self, value: float | int | bool, dtype: DType) -> str:
        dtype = compute_dtype(dtype)
        if dtype is DType.BOOL:
            return "True" if value else "False"
        if not dtype.is_float:
            return str(int(value))
        value = float(value)
        if value != value:
            return 'float("nan")'
        if value in (float("inf"), float("-inf")):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)


class IndexCtx:
    """Index expressions of one kernel shape: per domain axis an expression (None: always 0) and whether
    it varies inside the program's tile."""

    def __init__(
        self, axes: list[str | None], vec: list[bool], shape: str, groups: Sequence[set[int]] = ()
    ) -> None:
        self.axes, self.vec, self.shape = axes, vec, shape
        # the axes spanning each dimension of the tile: an offset needs one of each to have the tile's shape
        self.groups = list(groups) or [{i for i, v in enumerate(vec) if v}]

    def is_vec(self, used: set[int]) -> bool:
        return any(self.vec[a] for a in used)

    def is_full(self, used: set[int]) -> bool:
        return all(used & g for g in self.groups)


def index_lines(
    domain: Sequence[Dim], base: str, prefix: str, r: Renderer, keep_ones: bool = False
) -> tuple[list[str], list]:
    """Unflatten ``base`` (a flat index over ``domain``) into per-axis names, innermost first; size-1 axes
    get no name (their index is 0) unless ``keep_ones``."""
    lines: list[str] = []
    names: list[str | None] = [None] * len(domain)
    live = [i for i, d in enumerate(domain) if d != 1 or keep_ones]
    rest = base
    for j, i in enumerate(reversed(live)):
        name = f"{prefix}{i}"
        if j == len(live) - 1:
            lines.append(f"    {name} = {rest}")
        else:
            lines.append(f"    {name} = {rest} % {r.dim(domain[i])}")
            lines.append(f"    {prefix}r{i} = {rest} // {r.dim(domain[i])}")
            rest = f"{prefix}r{i}"
        names[i] = name
    return lines, names


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def cache_dir() -> Path:
    """Where generated Triton modules live: ``<kernelize cache>/triton``, checked and with the same
    fallback as the compiled-code cache (:func:`kernelize.runtime.diskcache.cache_dir`)."""
    return diskcache.cache_dir("triton")


def module_file(source: str, name: str) -> Path:
    """The ``.py`` file holding exactly ``source`` in the checked cache folder (written when missing or
    different): an existing file is reused only with the same content, in a folder only this user writes
    (Python may also load its ``__pycache__`` bytecode)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return diskcache.cached_file("triton", f"{name}_{digest}.py", source.encode())


def load_module(source: str, name: str, interpret: bool) -> ModuleType:
    """Write ``source`` to the cache dir and import it (``triton.jit`` needs a real file to inspect)."""
    path = module_file(source, name)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"kernelize_triton_{name}_{digest}_{'interp' if interpret else 'jit'}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module


__all__ = [
    "SIG",
    "TL",
    "IndexCtx",
    "TritonRenderer",
    "cache_dir",
    "index_lines",
    "interpreting",
    "load_module",
    "module_file",
    "next_power_of_2",
]
