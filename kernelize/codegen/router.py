"""The ROUTER kernels (:class:`~kernelize.autokernel.kernels.RouterKernel`) of the three backends, from one
spec: ``templates/cpu_router.cpp`` (a row per iteration, rows across threads), ``triton_router.py.tmpl``
and ``cuda_router.cu`` (a row per program / warp). Each reads a row of E logits, scores it (softmax,
sigmoid or none, in f32), adds the choice bias, picks the top K by K first-best scans (the lowest index
wins a tie, NaN is the largest: :mod:`kernelize.ir.router`'s rule), renormalises and scales the chosen
scores and writes the weights and / or the int64 indices. E is at most a few hundred in every router
transformers has, so a row lives in registers or on the stack.

Example:
    >>> source, name = render_cpu(kernel, prelude)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from kernelize.autokernel.kernels import RouterKernel
from kernelize.codegen.render import Renderer, c_name
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.ops import ROUTE_RENORMS, ROUTE_SCORES
from kernelize.runtime.backend import CompiledKernel, KernelCompileError

FLOATS = (DType.F32, DType.F16, DType.BF16)
MAX_EXPERTS = 1024  # a row of scores per thread / program; routers have at most a few hundred experts
PARALLEL_MIN = 1 << 15  # row x E x K scans below which one thread beats waking the team


class RouterSpec(NamedTuple):
    """What every backend's router kernel is filled from."""

    name: str
    experts: int
    k: int
    score: int  # index in ROUTE_SCORES
    renorm: int  # index in ROUTE_RENORMS
    eps: float
    scale: float
    logits: DType
    bias: DType | None
    weights: DType | None  # None: the weights are not written
    index: bool  # the indices are written


def router_spec(kernel: RouterKernel) -> RouterSpec:
    """The kernel's spec; raises ValueError for what no backend's template runs (the planner's graph can
    hold it: the runtime then says which kernel and why)."""
    x = kernel.node.src[0]
    a = kernel.weights.arg if kernel.weights is not None else kernel.node.arg
    bias = kernel.node.src[1].dtype if a.bias else None
    w = kernel.weights
    if x.dtype not in FLOATS or (bias is not None and bias not in FLOATS) or (w and w.dtype not in FLOATS):
        raise ValueError(f"router kernel {kernel.name}: logits, bias and weights must be f32, f16 or bf16")
    if kernel.experts > MAX_EXPERTS:
        raise ValueError(
            f"router kernel {kernel.name}: {kernel.experts} experts, the kernels take <= {MAX_EXPERTS}"
        )
    return RouterSpec(
        c_name(kernel.name),
        kernel.experts,
        a.k,
        ROUTE_SCORES.index(a.score),
        ROUTE_RENORMS.index(a.renorm),
        a.eps,
        a.scale,
        x.dtype,
        bias,
        None if w is None else w.dtype,
        kernel.index is not None,
    )


def _c_float(v: float) -> str:
    return (
        f"{v!r}f"
        if v == v and abs(v) != float("inf")
        else ("NAN" if v != v else f"{'-' if v < 0 else ''}INFINITY")
    )


def _holes(sp: RouterSpec) -> dict[str, str]:
    """The template holes the C++ and CUDA C sources share: the name, sizes and the score / renorm choice."""
    return {
        "NAME": sp.name,
        "E": str(sp.experts),
        "K": str(sp.k),
        "SCORE": ROUTE_SCORES[sp.score],
        "RENORM": ROUTE_RENORMS[sp.renorm],
        "SCORE_CODE": str(sp.score),
        "RENORM_CODE": str(sp.renorm),
    }


def render_cpu(kernel: RouterKernel, renderer: Renderer, prelude: str) -> tuple[str, str]:
    """The C++ source of a ROUTER kernel and its exported function name."""
    sp = router_spec(kernel)
    types = renderer.STORAGE
    params = [f"const {types[sp.logits]}* __restrict kz_x, "]
    params += [f"const {types[sp.bias]}* __restrict kz_b, "] if sp.bias else []
    params += [f"{types[sp.weights]}* __restrict kz_w, "] if sp.weights else []
    params += ["int64_t* __restrict kz_i, "] if sp.index else []
    params += [f"int64_t {renderer.sym(s)}, " for s in kernel.symbols]
    stores = ["            for (int k = 0; k < K; ++k) {"]
    if sp.weights:
        scaled = "w[k]" if sp.scale == 1.0 else f"w[k] * {_c_float(sp.scale)}"
        stores.append(f"                kz_st(kz_w, r * K + k, {scaled});")
    if sp.index:
        stores.append("                kz_i[r * K + k] = ix[k];")
    stores.append("            }")
    source = fill(
        load_template("cpu_router.cpp"),
        PRELUDE=prelude,
        **_holes(sp),
        PARAMS="".join(params),
        ROWS=renderer.dim(kernel.rows),
        PARALLEL_MIN=str(PARALLEL_MIN),
        CHOICE_BIAS=" + kz_ld(kz_b, e)" if sp.bias else "",
        EPS=_c_float(sp.eps),
        STORES="\n".join(stores),
    )
    return source, sp.name


# ---- Triton: one program per row -------------------------------------------------------------------------
def triton_constants(sp: RouterSpec) -> dict:
    """The kernel's constexprs (the whole spec: the source is one per kind of router, the sizes constants)."""
    return {
        "E": sp.experts,
        "K": sp.k,
        "BE": 1 << max(0, sp.experts - 1).bit_length(),
        "BK": 1 << max(0, sp.k - 1).bit_length(),
        "SCORE": sp.score,
        "RENORM": sp.renorm,
        "EPS": sp.eps,
        "SCALE": sp.scale,
        "HAS_B": sp.bias is not None,
        "HAS_W": sp.weights is not None,
        "HAS_I": sp.index,
    }


def render_triton(kernel: RouterKernel) -> str:
    """The Triton module source of a ROUTER kernel (function ``kernel.name``)."""
    router_spec(kernel)
    prelude = fill(load_template("triton_prelude.py.tmpl"), KERNEL=kernel.name)
    return fill(load_template("triton_router.py.tmpl"), PRELUDE=prelude, NAME=kernel.name)


def _operands(kernel: RouterKernel, sp: RouterSpec, reads, writes) -> tuple:
    """(x, bias, weights, index) tensors; an absent one is x (never touched: its flag is off)."""
    x, *rest = reads
    b = rest[0] if sp.bias else x
    w = writes[0] if sp.weights else x
    i = writes[-1] if sp.index else x
    return x, b, w, i


def compile_triton(kernel: RouterKernel, interpret: bool) -> CompiledKernel:
    """Load the rendered module (disk + memory cached) and return the launch for the runtime."""
    from kernelize.codegen.triton_base import load_module
    from kernelize.runtime.cache import KERNELS

    sp = router_spec(kernel)
    source = render_triton(kernel)
    key = (hashlib.sha256(source.encode()).hexdigest(), "interpret" if interpret else "cuda")
    try:
        module = KERNELS.get_or_build(key, lambda: load_module(source, kernel.name, interpret))
    except Exception as e:
        raise KernelCompileError(kernel.name, key[0], f"{type(e).__name__}: {e}", source, "triton") from e
    fn, consts = getattr(module, kernel.name), triton_constants(sp)

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]
    ) -> None:
        rows = reads[0].numel() // sp.experts
        if rows:
            fn[(rows,)](
                *_operands(kernel, sp, reads, writes), **consts, num_warps=1 if sp.experts <= 256 else 4
            )

    return CompiledKernel(kernel.name, "triton", source, launch, kernel)


def triton_aot_job(kernel: RouterKernel, arch: int, path: str) -> dict:
    """The ``triton.compile`` job (:mod:`kernelize.codegen.triton_aot`) of a ROUTER kernel."""
    from kernelize.codegen.triton_base import SIG

    sp = router_spec(kernel)
    x = "*" + SIG[sp.logits]
    sig = {
        "x_ptr": x,
        "b_ptr": "*" + SIG[sp.bias] if sp.bias else x,
        "w_ptr": "*" + SIG[sp.weights] if sp.weights else x,
        "i_ptr": "*i64" if sp.index else x,
    }
    consts = triton_constants(sp)
    sig.update(dict.fromkeys(consts, "constexpr"))
    return {
        "path": path,
        "name": kernel.name,
        "signature": sig,
        "constexprs": consts,
        "arch": arch,
        "num_warps": 1,
    }


# ---- CUDA C: one warp per row ----------------------------------------------------------------------------
CUDA_TYPES = {DType.F32: "float", DType.F16: "__half", DType.BF16: "__nv_bfloat16"}
CUDA_GRID_MAX = 65535  # blocks; more rows are grid-strided


def render_cuda(kernel: RouterKernel) -> tuple[str, str]:
    """The CUDA C source of a ROUTER kernel and its entry point, ``(x, b, w, ix, rows)``."""
    sp = router_spec(kernel)
    source = fill(
        load_template("cuda_router.cu"),
        PRELUDE=load_template("cuda_prelude.cuh"),
        **_holes(sp),
        HAS_B=str(int(sp.bias is not None)),
        HAS_W=str(int(sp.weights is not None)),
        HAS_I=str(int(sp.index)),
        TX=CUDA_TYPES[sp.logits],
        TB=CUDA_TYPES[sp.bias or sp.logits],
        TW=CUDA_TYPES[sp.weights or sp.logits],
        EPS=_c_float(sp.eps),
        SCALE=_c_float(sp.scale),
    )
    return source, sp.name


def compile_cuda(kernel: RouterKernel, arch: str) -> CompiledKernel:
    """NVRTC-compile (disk-cached) and return the launch for the runtime: one 32-thread block per row."""
    from kernelize.codegen.nvrtc import CubinModule, compile_cubin, require_driver

    sp = router_spec(kernel)
    source, name = render_cuda(kernel)
    module = CubinModule(compile_cubin(source, name, arch), name)
    p, i64 = ctypes.c_void_p, ctypes.c_int64

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]
    ) -> None:
        require_driver()
        tensors = _operands(kernel, sp, reads, writes)
        if not all(t.is_cuda for t in tensors):
            raise ValueError(f"cuda kernel {kernel.name}: every tensor must be on the CUDA device")
        rows = reads[0].numel() // sp.experts
        if rows:
            grid = (min(rows, CUDA_GRID_MAX), 1, 1)
            args = [(t.data_ptr(), p) for t in tensors] + [(rows, i64)]
            module.launch(grid, (32, 1, 1), args, tensors[0].device.index or 0)

    return CompiledKernel(kernel.name, "cuda", source, launch, kernel)


__all__ = [
    "MAX_EXPERTS",
    "RouterSpec",
    "compile_cuda",
    "compile_triton",
    "render_cpu",
    "render_cuda",
    "render_triton",
    "router_spec",
    "triton_aot_job",
]
