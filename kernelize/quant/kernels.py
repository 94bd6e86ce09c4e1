"""The packed-weight CPU kernels: ``templates/cpu_quant_gemv.cpp`` filled per format, compiled and cached
through the CPU backend's build (:mod:`kernelize.codegen.cpu_build`), called through ctypes.

One shared library per format holds the few-row matmul for f32 / bf16 inputs and outputs, the routed
experts' few-pair kernel (:mod:`kernelize.quant.experts`), the dequantizer of a panel of weight rows
(prefill) and the activation quantizer (tests).

Example:
    >>> lib = library("q8_0")  # doctest: +SKIP
    >>> gemv(x, packed, None, out)  # x [m, k] f32 / bf16, out [m, n]  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernelize.codegen import cpu_build
from kernelize.codegen.template import fill, load_template
from kernelize.quant.formats import PackedWeight, get_format

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def source(fmt: str) -> str:
    """The C++ source of format ``fmt``'s library.

    Example:
        >>> "typedef kz_q4_0 kz_fmt;" in source("q4_0")
        True
    """
    name = get_format(fmt).name
    return fill(
        load_template("cpu_quant_gemv.cpp"),
        PRELUDE=load_template("cpu_prelude.h"),
        FORMAT=f"kz_{name}",
        NAME=f"kz_quant_{name}",
    )


@functools.cache
def library(fmt: str) -> ctypes.CDLL:
    """Format ``fmt``'s compiled library (disk-cached; loaded once per process), its entry points typed."""
    name = get_format(fmt).name
    lib = cpu_build.load(cpu_build.build_shared_object(source(name), f"kz_quant_{name}"))
    for xn in _DTYPES.values():
        for on in _DTYPES.values():
            fn = getattr(lib, f"kz_quant_{name}_{xn}_{on}")
            fn.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _P, ctypes.c_int, _I64, ctypes.c_int]
            fn.restype = ctypes.c_int
    for entry in ("dequant", "dequant_bf16"):
        getattr(lib, f"kz_quant_{name}_{entry}").argtypes = [_P, _P, _I64, _I64, _I64, _P, ctypes.c_int]
    getattr(lib, f"kz_quant_{name}_quantize_x").argtypes = [_P, _I64, _I64, _P, _P]
    for xn in _DTYPES.values():  # x, index, weights, out, sizes, weight addresses, gate form, threads
        fn = getattr(lib, f"kz_quant_{name}_experts_{xn}")
        fn.argtypes, fn.restype = [_P] * 7 + [ctypes.c_int], ctypes.c_int
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# a gated activation's name -> the kernel's code for it (the template's KZ_SILU ...)
GLU_ACTS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "gelu_new": 2}


@functools.cache
def entry(name: str, x_dtype: torch.dtype, out_dtype: torch.dtype) -> ctypes._CFuncPtr:
    """Format ``name``'s few-row kernel for ``x_dtype`` inputs and ``out_dtype`` outputs (f32 / bf16): the
    arguments :func:`gemv` passes it."""
    return getattr(library(name), f"kz_quant_{name}_{_DTYPES[x_dtype]}_{_DTYPES[out_dtype]}")


def gemv(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    act: str | None = None,
) -> None:
    """``out = x @ W.T (+ bias)`` by the few-row kernel; every tensor contiguous on the CPU, ``x`` [m, k]
    f32 / bf16, ``bias`` f32 [n] or None, ``out`` [m, n] f32 / bf16 (checked by the caller).

    ``act`` (a :data:`GLU_ACTS` name): ``W`` is a merged gate|up weight [2I, k] and ``out`` [m, I] gets
    ``act(x @ gate.T) * (x @ up.T)``, both halves read in one pass, the product in the kernel's epilogue.
    """
    m, k = x.shape
    n = packed.shape[0]
    up = 0 if act is None else n // 2
    entry(packed.format.name, x.dtype, out.dtype)(
        x.data_ptr(), m, k, packed.data.data_ptr(), _ptr(packed.scales), n - up, _ptr(bias), out.data_ptr(),
        cpu_build.threads(), up, GLU_ACTS.get(act, 0),
    )  # fmt: skip


@functools.cache
def experts_entry(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    """Format ``name``'s routed-experts kernel for ``dtype`` (f32 / bf16) activations and outputs:
    ``(x, index, weights, out, sizes, weight addresses, gate form, threads)``
    (:class:`kernelize.quant.experts.QuantizedExperts` passes them)."""
    return getattr(library(name), f"kz_quant_{name}_experts_{_DTYPES[dtype]}")


DEQUANT_ENTRIES = {torch.float32: "dequant", torch.bfloat16: "dequant_bf16"}


def dequantize_rows(packed: PackedWeight, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
    """Rows ``[n0, n1)`` of the weight in ``out``'s dtype (f32, or bf16 rounded to nearest even) into
    ``out`` (contiguous, at least ``(n1 - n0) * K`` elements); returns the ``[n1 - n0, K]`` view written."""
    name, k = packed.format.name, packed.shape[1]
    panel = out.view(-1)[: (n1 - n0) * k].view(n1 - n0, k)
    entry = getattr(library(name), f"kz_quant_{name}_{DEQUANT_ENTRIES[out.dtype]}")
    if entry(packed.data.data_ptr(), _ptr(packed.scales), n0, n1, k, panel.data_ptr(), cpu_build.threads()):
        raise MemoryError(f"{name} dequantization: out of memory for a row of {k} values")
    return panel


def quantize_activations(x: torch.Tensor, fmt: str = "q8_0") -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's quantized activations of f32 ``x`` [m, k] for weights in ``fmt``: int8 values [m, k]
    and f32 scales [m, k / B], one per block of B = the format's block (32; the k-quants' 256).

    Example:
        >>> q, d = quantize_activations(torch.ones(1, 32))  # doctest: +SKIP
        >>> q[0, 0].item(), d[0, 0].item()  # doctest: +SKIP
        (127, 0.007874...)
    """
    x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // get_format(fmt).block_size, dtype=torch.float32)
    getattr(library(fmt), f"kz_quant_{get_format(fmt).name}_quantize_x")(
        x.data_ptr(), m, k, q.data_ptr(), d.data_ptr()
    )
    return q, d


__all__ = [
    "GLU_ACTS",
    "dequantize_rows",
    "entry",
    "experts_entry",
    "gemv",
    "library",
    "quantize_activations",
    "source",
]
