"""The CPU grouped-expert kernel: ``templates/cpu_experts.cpp`` filled for one ``EXPERTS`` kernel, and its
launcher.

Static in the source: the dtypes, the hidden and intermediate sizes, the expert count, K and the activation
(the loops over them have constant trip counts). At run time: the token count and every operand's strides.

Three paths, chosen per call by the number of routed (token, slot) pairs:

* up to ``FEW_PAIRS`` pairs (decode, short prompts): the generated kernel alone. It reads each selected
  expert's weights once for all of that expert's rows, at the rate of the few-row matmul kernels
  (``cpu_gemv.h``), and touches no other expert's bytes;
* more, where the generated GEMM tiles run the experts' f32 GEMMs (:func:`call_path`; unless
  ``KERNELIZE_CPU_GEMM`` names a library): the generated kernel still, with the GEMM library's entry as an
  argument; from :data:`TILE_ROWS` rows per expert on average (twice that for 16-bit weights, which it
  widens first) its many-pair path (``kz_many``): each selected expert on one thread, its products
  transposed, its weight rows the GEMM's left operand as stored, its tokens' rows packed into the column
  panels; with AMX (bf16 weights, sizes multiples of 32: :func:`amx_products`) every call past
  ``FEW_PAIRS`` takes it, its products on the tile unit instead of the GEMM library. Below that the
  dot blocks (Qwen3-MoE layout, one layer's experts, 2 threads, Zen 3: 512 tokens f32 73-85 ms against
  92-134 for ``grouped_mm`` and 103-124 for the library path below; 128 tokens 25 against 47; 64 tokens,
  the dot blocks, 22 against 40);
* more elsewhere: per selected expert a library GEMM over its rows (oneDNN / MKL through torch, in f32 for
  16-bit weights, which the CPU's 16-bit GEMMs run several times slower), with the activation and the
  weighted combine fused around them.

Example:
    >>> src, fn = render_experts(kernel)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import ExpertsKernel
from kernelize.codegen import cpu_build
from kernelize.codegen.cpu_attention import C_TYPES, unit_last
from kernelize.codegen.cpu_conv import panel
from kernelize.codegen.cpu_gemv import gemm_address, tiles_take
from kernelize.codegen.render import c_name
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.experts import split_gate
from kernelize.ir.ops import ExpertsArgs

# the activation in C++ (the formulas of kernelize.ir.experts.ACTIVATIONS)
C_ACTIVATIONS = {
    "silu": "v * kz_sigmoid(v)",
    "gelu": "kz_gelu(v)",
    "gelu_tanh": "kz_gelu_tanh(v)",
    "relu": "v > 0.0f ? v : 0.0f",
    "relu2": "v > 0.0f ? v * v : 0.0f",
}


def c_glu(args: ExpertsArgs, act: str = "kz_act") -> str:
    """The body of ``float kz_glu(float g, float u)`` in C (the CPU and CUDA kernels): the node's gate form
    (:func:`kernelize.ir.experts.split_gate`); a NaN passes the clamps as it does torch's."""

    def lit(v: float) -> str:
        return f"{float(v)!r}f"

    lines = []
    if args.gate_limit is not None:
        lines.append(f"g = g > {lit(args.gate_limit)} ? {lit(args.gate_limit)} : g;")
    alpha = f"g * kz_sigmoid({lit(args.alpha)} * g)" if args.alpha != 1.0 else f"{act}(g)"
    lines.append(f"float a = {alpha};")
    if args.act_limit is not None:
        lines.append(f"a = a > {lit(args.act_limit)} ? {lit(args.act_limit)} : a;")
    if args.up_limit is not None:
        hi, lo = lit(args.up_limit), lit(-args.up_limit)
        lines.append(f"u = u > {hi} ? {hi} : (u < {lo} ? {lo} : u);")
    if args.up_shift:
        lines.append(f"u += {lit(args.up_shift)};")
    return " ".join([*lines, "return a * u;"])


INDEX_TYPES = {DType.I64: "int64_t", DType.I32: "int32_t", DType.I16: "int16_t", DType.U8: "uint8_t"}
# Routed pairs up to which the generated kernel runs the call: its dot-product blocks read each weight
# once per 16 rows, which is what decode needs; a GEMM's register tiles win once experts have many rows.
FEW_PAIRS = 64
# mean routed rows per expert from which the many-pair path takes the tiles, by GEMM panel width (twice
# that for 16-bit weights): a panel with AVX2 (Zen 3: 128 tokens of top-4 over 32 experts, 25 against
# 47 ms); a quarter panel with AVX-512 (Xeon, 2 threads: 64 tokens 18.9 against 20.2 ms for the dot blocks,
# 128 tokens 21.6 against 29.6; bf16 128 tokens 24.9 against 27.2, 64 tokens 22.5 against 17.1)
TILE_ROWS = {16: 16, 32: 8}
PARALLEL_MIN = 1 << 16  # multiply-adds below which one thread beats waking the team
ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
ERRORS = {
    1: "out of memory for its scratch",
    2: "an expert index outside [0, {experts}]",
    3: "the GEMM library refused its sizes",
}


def check_experts_kernel(kernel: ExpertsKernel, plain_only: str | None = None) -> ExpertsArgs:
    """The node's args, after checking the generated kernels support its dtypes (and, for a backend named
    by ``plain_only``, that the node has no interleaved rows, biases or gate form)."""
    if plain_only and not kernel.node.arg.plain:
        raise ValueError(
            f"experts kernel {kernel.name}: the {plain_only} kernel takes only concatenated gate|up rows "
            f"without biases and the gate act(g) * u, not {kernel.node.arg!r}; the CPU kernel runs them"
        )
    x, index, weights, _, _ = kernel.node.src[:5]
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
    x, index, weights, up, down = kernel.node.src[:5]
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
        GLU=c_glu(args),
        BIAS="true" if args.bias else "false",
        INTERLEAVED="true" if args.interleaved else "false",
        PARALLEL_MIN=str(PARALLEL_MIN),
        PANEL=str(panel()),
    )
    return source, name


def experts_launcher(fn, kernel: ExpertsKernel):
    """A ``launch(operands, [out], sizes)`` running the call on the generated kernel or, past
    ``FEW_PAIRS`` routed pairs, on library GEMMs per expert (see the module docstring);
    ``launch.c_call(operands, [out])`` is the generated kernel's call for ``kz_replay`` (None past
    ``FEW_PAIRS``; its ``keep`` holds the strides array the arguments point to)."""
    from kernelize.runtime.backend import CCall

    fn.restype, fn.argtypes = ctypes.c_int, ARGTYPES
    args: ExpertsArgs = kernel.node.arg
    get_threads = cpu_build.threads
    address = ctypes.cast(fn, ctypes.c_void_p).value

    def arguments(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]):
        x, index, weights, up, down, *biases = reads
        (out,) = writes
        assert out.is_contiguous(), "experts output must be contiguous"
        up, down = unit_last(up), unit_last(down)
        ub, db = biases or (None, None)
        st = (*x.stride(), *index.stride(), *weights.stride(), *up.stride()[:2], *down.stride()[:2])
        st += (*ub.stride(), *db.stride()) if biases else (0,) * 4
        ptrs = [t.data_ptr() for t in (x, index, weights, up, down)]
        ptrs += [ub.data_ptr() if biases else 0, db.data_ptr() if biases else 0, out.data_ptr()]
        return ptrs, x.shape[0], (ctypes.c_int64 * 14)(*st), (up, down)

    def error(rc: int, tokens: int, experts: int) -> str:
        what = ERRORS.get(rc, f"error {rc}").format(experts=experts)
        return f"cpu experts kernel {kernel.name}: {what} in {tokens} tokens"

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int] | None = None
    ) -> None:
        x, index, weights, up, down, *biases = reads
        path = call_path(x, index, up, down)
        if path == "library":
            writes[0].copy_(gemm_experts(x, index, weights, up, down, args, *biases))
            return
        gemm = gemm_address() if path == "tiles" else None
        ptrs, tokens, strides, _ = arguments(reads, writes)
        rc = fn(*ptrs, tokens, strides, gemm, get_threads())
        if rc:
            raise ValueError(error(rc, tokens, up.shape[0]))

    def c_call(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> CCall | None:
        if reads[1].numel() > FEW_PAIRS:
            return None
        ptrs, tokens, strides, held = arguments(reads, writes)
        message = error(2, tokens, reads[3].shape[0]) + " (or out of memory for its scratch)"
        args = (*ptrs, tokens, ctypes.addressof(strides), 0)
        return CCall(address, args, message, raises=ValueError, keep=(strides, *held))

    launch.c_call = c_call
    return launch


def call_path(x: torch.Tensor, index: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> str:
    """Which path runs a call (see the module docstring): ``"dots"`` (the generated kernel's dot blocks),
    ``"tiles"`` (its many-pair path over the GEMM library) or ``"library"`` (:func:`gemm_experts`).
    The tiles need no library named for f32 GEMMs (:func:`~kernelize.codegen.cpu_gemv.tiles_take`), sizes
    within its tiles, f32 weights whose rows are dense (the GEMM reads them as stored), and on average
    :data:`TILE_ROWS` rows per expert (twice that for 16-bit weights, which it widens first). Where the
    products run on AMX tiles (:func:`amx_products`) every call past ``FEW_PAIRS`` takes them."""
    pairs, (e, _, h), i = index.numel(), up.shape, down.shape[2]
    if pairs <= FEW_PAIRS:
        return "dots"
    if amx_products(x.dtype, h, i):
        return "tiles"
    dense = x.dtype != torch.float32 or (up.stride()[1:] == (h, 1) and down.stride()[1:] == (i, 1))
    if not (tiles_take(True, max(h, i)) and x.dtype != torch.float64 and dense):
        return "library"
    rows = TILE_ROWS.get(panel(), panel()) * (1 if x.dtype == torch.float32 else 2)
    return "tiles" if pairs >= e * rows else "dots"


def amx_products(dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether the many-pair path's products run on AMX tiles (``KZ_AMX`` of ``templates/cpu_experts.cpp``):
    bf16 operands, both sizes multiples of 32, the tile instructions built in (``-march=native`` on a Xeon
    from Sapphire Rapids on)."""
    if dtype != torch.bfloat16 or hidden % 32 or intermediate % 32:  # (perf) f32 calls ask no compiler state
        return False
    return {"__AMX_TILE__", "__AMX_BF16__"} <= cpu_build.macros()


def gemm_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    args: ExpertsArgs,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
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
    start = 0
    for e, n in enumerate(counts[:experts]):
        if n:
            h = rows[start : start + n] @ up[e].to(acc).T
            h = split_gate(h if up_bias is None else h + up_bias[e].to(acc), args)
            torch.mm(h, down[e].to(acc).T, out=out[start : start + n])
            if down_bias is not None:
                out[start : start + n] += down_bias[e].to(acc)
        start += n
    out[:start] *= weights.reshape(-1)[order[:start]].to(acc)[:, None]
    summed = torch.zeros_like(out).index_copy_(0, order, out)  # back to (token, slot) order
    return summed.view(x.shape[0], k, -1).sum(1).to(x.dtype)


__all__ = [
    "FEW_PAIRS",
    "c_glu",
    "check_experts_kernel",
    "experts_launcher",
    "gemm_experts",
    "call_path",
    "render_experts",
]
