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

from typing import NamedTuple

from kernelize.autokernel.kernels import RouterKernel
from kernelize.codegen.render import Renderer, c_name
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.ops import ROUTE_RENORMS, ROUTE_SCORES

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


def render_cpu(kernel: RouterKernel, renderer: Renderer, prelude: str) -> tuple[str, str]:
    """The C++ source of a ROUTER kernel and its exported function name."""
    sp = router_spec(kernel)
    types = renderer.STORAGE
    params = [f"const {types[sp.logits]}* __restrict kz_x, "]
    params += [f"const {types[sp.bias]}* __restrict kz_b, "] if sp.bias else []
    params += [f"{types[sp.weights]}* __restrict kz_w, "] if sp.weights else []
    params += ["int64_t* __restrict kz_i, "] if sp.index else []
    params += [f"int64_t {renderer.sym(s)}, " for s in kernel.symbols]
    stores = ["            for (int k = 0; k < KZ_K; ++k) {"]
    if sp.weights:
        scaled = "w[k]" if sp.scale == 1.0 else f"w[k] * {_c_float(sp.scale)}"
        stores.append(f"                kz_st(kz_w, r * KZ_K + k, {scaled});")
    if sp.index:
        stores.append("                kz_i[r * KZ_K + k] = ix[k];")
    stores.append("            }")
    source = fill(
        load_template("cpu_router.cpp"),
        PRELUDE=prelude,
        NAME=sp.name,
        E=str(sp.experts),
        K=str(sp.k),
        SCORE=ROUTE_SCORES[sp.score],
        RENORM=ROUTE_RENORMS[sp.renorm],
        SCORE_CODE=str(sp.score),
        RENORM_CODE=str(sp.renorm),
        PARAMS="".join(params),
        ROWS=renderer.dim(kernel.rows),
        PARALLEL_MIN=str(PARALLEL_MIN),
        CHOICE_BIAS=" + kz_ld(kz_b, e)" if sp.bias else "",
        EPS=_c_float(sp.eps),
        STORES="\n".join(stores),
    )
    return source, sp.name


__all__ = ["MAX_EXPERTS", "RouterSpec", "render_cpu", "router_spec"]
