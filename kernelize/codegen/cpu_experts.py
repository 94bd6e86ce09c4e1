"""The CPU grouped-expert kernel: ``templates/cpu_experts.cpp`` filled for one ``EXPERTS`` kernel, and its
launcher.

Static in the source: the dtypes, the hidden and intermediate sizes, the expert count, K and the activation
(the loops over them have constant trip counts). At run time: the token count and every operand's strides.

Two paths, chosen per call by the number of routed (token, slot) pairs:

* up to ``FEW_PAIRS`` pairs (decode, short prompts): the generated kernel alone. It reads each selected
  expert's weights once for all of that expert's rows, at the rate of the few-row matmul kernels
  (``cpu_gemv.h``), and touches no other expert's bytes;
* more: per selected expert a library GEMM over its rows (oneDNN / MKL through torch, in f32 for 16-bit
  weights, which the CPU's 16-bit GEMMs run several times slower), with the activation and the weighted
  combine fused around them.

Example:
    >>> src, fn = render_experts(kernel)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import ExpertsKernel
from kernelize.codegen.cpu_attention import C_TYPES, unit_last
from kernelize.codegen.render import c_name
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.experts import ACTIVATIONS
from kernelize.ir.ops import ExpertsArgs

# the activation in C++ (the formulas of kernelize.ir.experts.ACTIVATIONS)
C_ACTIVATIONS = {
    "silu": "v * kz_sigmoid(v)",
    "gelu": "kz_gelu(v)",
    "gelu_tanh": "kz_gelu_tanh(v)",
    "relu": "v > 0.0f ? v : 0.0f",
    "relu2": "v > 0.0f ? v * v : 0.0f",
}
INDEX_TYPES = {DType.I64: "int64_t", DType.I32: "int32_t", DType.I16: "int16_t", DType.U8: "uint8_t"}
# Routed pairs up to which the generated kernel runs the call: its dot-product blocks read each weight
# once per 16 rows, which is what decode needs; a GEMM's register tiles win once experts have many rows.
FEW_PAIRS = 64
PARALLEL_MIN = 1 << 16  # multiply-adds below which one thread beats waking the team
ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
ERRORS = {1: "out of memory for its scratch", 2: "an expert index outside [0, {experts}]"}


def check_experts_kernel(kernel: ExpertsKernel) -> ExpertsArgs:
    """The node's args, after checking the generated kernels support its dtypes."""
    x, index, weights, _, _ = kernel.node.src
    if x.dtype not in (DType.F32, DType.F16, DType.BF16) or weights.dtype not in C_TYPES:
        raise ValueError(
            f"experts kernel {kernel.name}: dtypes {x.dtype} (x, weights of the experts) and {weights.dtype} "
            "(routing weights) are not supported by the generated kernels (f32, f16, bf16)"
        )
    if index.dtype not in INDEX_TYPES:
        raise ValueError(f"experts kernel {kernel.name}: index dtype {index.dtype} is not supported")
    return kernel.node.arg


def render_experts(kernel: ExpertsKernel, prelude: str) -> tuple[str, str]:
    """The C++ source of an ``EXPERTS`` kernel and its exported function name."""
    args = check_experts_kernel(kernel)
    x, index, weights, up, down = kernel.node.src
    name = c_name(kernel.name)
    source = fill(
        load_template("cpu_experts.cpp"),
        PRELUDE=prelude,
        GEMV_LIB=load_template("cpu_gemv.h"),
        NAME=name,
        T=C_TYPES[x.dtype],
        TI=INDEX_TYPES[index.dtype],
        TW=C_TYPES[weights.dtype],
        H=str(x.shape[1]),
        I=str(down.shape[2]),
        E=str(up.shape[0]),
        K=str(index.shape[1]),
        GATED="true" if args.gated else "false",
        PAIRS="true" if x.dtype is DType.BF16 else "false",
        ACT=C_ACTIVATIONS[args.act],
        PARALLEL_MIN=str(PARALLEL_MIN),
    )
    return source, name


def experts_launcher(fn, kernel: ExpertsKernel):
    """A ``launch(operands, [out], sizes)`` running the call on the generated kernel or, past
    ``FEW_PAIRS`` routed pairs, on library GEMMs per expert (see the module docstring)."""
    fn.restype, fn.argtypes = ctypes.c_int, ARGTYPES
    args: ExpertsArgs = kernel.node.arg
    get_threads = torch.get_num_threads

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int] | None = None
    ) -> None:
        x, index, weights, up, down = reads
        (out,) = writes
        assert out.is_contiguous(), "experts output must be contiguous"
        if index.numel() > FEW_PAIRS:
            out.copy_(gemm_experts(x, index, weights, up, down, args))
            return
        up, down = unit_last(up), unit_last(down)
        st = (*x.stride(), *index.stride(), *weights.stride(), *up.stride()[:2], *down.stride()[:2])
        rc = fn(
            x.data_ptr(),
            index.data_ptr(),
            weights.data_ptr(),
            up.data_ptr(),
            down.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            (ctypes.c_int64 * 10)(*st),
            get_threads(),
        )
        if rc:
            what = ERRORS.get(rc, f"error {rc}").format(experts=up.shape[0])
            raise ValueError(f"cpu experts kernel {kernel.name}: {what} in {x.shape[0]} tokens")

    return launch


def gemm_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    args: ExpertsArgs,
) -> torch.Tensor:
    """The many-row path: the pairs sorted by expert, then per selected expert ``act(x @ up^T) @ down^T``
    by library GEMMs in f32 (or f64), the weighted rows summed per token. Bitwise independent of the thread
    count: each token's sum takes its slots in order."""
    experts, k = up.shape[0], index.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = index.reshape(-1)
    if bool(((flat < 0) | (flat > experts)).any()):
        raise ValueError(f"experts: an expert index outside [0, {experts}] in {index.shape[0]} tokens")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts + 1).tolist()
    rows = x.index_select(0, order // k).to(acc)
    out = torch.zeros(flat.numel(), x.shape[1], dtype=acc)
    act, start = ACTIVATIONS[args.act], 0
    for e, n in enumerate(counts[:experts]):
        if n:
            h = rows[start : start + n] @ up[e].to(acc).T
            h = act(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2 :] if args.gated else act(h)
            torch.mm(h, down[e].to(acc).T, out=out[start : start + n])
        start += n
    out[:start] *= weights.reshape(-1)[order[:start]].to(acc)[:, None]
    summed = torch.zeros_like(out).index_copy_(0, order, out)  # back to (token, slot) order
    return summed.view(x.shape[0], k, -1).sum(1).to(x.dtype)


__all__ = ["FEW_PAIRS", "check_experts_kernel", "experts_launcher", "gemm_experts", "render_experts"]
