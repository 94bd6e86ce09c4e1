"""The Triton grouped-expert kernels: ``templates/triton_experts.py.tmpl`` filled for one ``EXPERTS`` kernel.

vLLM's ``fused_moe`` layout. The launcher sorts the (token, slot) pairs by expert and pads each expert's
segment to whole blocks of ``BM`` rows (:func:`kernelize.codegen.experts_align.align_pairs`, torch ops on
the device, no host sync), then runs two grouped GEMMs over (block of ``BM`` sorted pairs, ``BN`` columns):

* ``<name>_up`` gathers the pairs' token rows of x and computes the gate and up tiles together, storing
  ``h = act(gate) * up`` (f32 accumulation; h in x's dtype, f32 for f32);
* ``<name>_down`` computes ``h @ down[e]^T`` and multiplies the routing weight in its epilogue, writing one
  f32 row per pair into a ``[T * K, H]`` buffer; a torch sum over K then gives the output.

Every output element has one writer (no atomics): the result does not depend on the schedule. Static in
the source: the sizes H, I, K, E and the activation; at run time: the pair count and every operand's
strides (expert weights are read in place).

Example:
    >>> ck = compile_experts(kernel, interpret=True)  # doctest: +SKIP
    >>> ck.launch([x, index, weights, up, down], [out], {"tokens": 7})  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import ExpertsKernel
from kernelize.codegen.cpu_experts import check_experts_kernel
from kernelize.codegen.experts_align import align_pairs
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.ops import ExpertsArgs
from kernelize.runtime.backend import CompiledKernel, KernelCompileError

# the activation of an f32 tile `v` (the formulas of kernelize.ir.experts.ACTIVATIONS; kz_*: the prelude)
TRITON_ACTIVATIONS = {
    "silu": "v * tl.sigmoid(v)",
    "gelu": "kz_gelu(v)",
    "gelu_tanh": "kz_gelu_tanh(v)",
    "relu": "tl.maximum(v, 0.0)",
    "relu2": "tl.maximum(v, 0.0) * tl.maximum(v, 0.0)",
}
BN, NUM_WARPS = 64, 4
BK = {DType.F32: 32, DType.F16: 64, DType.BF16: 64}  # reduction step: 16-bit tiles take twice the elements


def triton_glu(args: ExpertsArgs, act: str) -> str:
    """The body of ``<name>_glu(g, u)`` (f32 tiles; ``act``: the name of the kernel's activation function):
    the node's gate form, as ``cpu_experts.c_glu`` spells it in C."""
    lines = []
    if args.gate_limit is not None:
        lines.append(f"g = tl.minimum(g, {args.gate_limit!r})")
    lines.append(f"a = g * tl.sigmoid({args.alpha!r} * g)" if args.alpha != 1.0 else f"a = {act}(g)")
    if args.act_limit is not None:
        lines.append(f"a = tl.minimum(a, {args.act_limit!r})")
    if args.up_limit is not None:
        lines.append(f"u = tl.minimum(tl.maximum(u, {-args.up_limit!r}), {args.up_limit!r})")
    if args.up_shift:
        lines.append(f"u = u + {args.up_shift!r}")
    return "\n".join(f"    {line}" for line in [*lines, "return a * u"])


def block_m(pairs: int, experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while experts get few pairs each (decode), more for prefill."""
    per_expert = pairs / max(1, min(experts, pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def render_experts(kernel: ExpertsKernel) -> str:
    """The Triton module source of an ``EXPERTS`` kernel (functions ``<name>_up`` and ``<name>_down``)."""
    args = check_experts_kernel(kernel)
    x, index, _, up, down = kernel.node.src[:5]
    return fill(
        load_template("triton_experts.py.tmpl"),
        PRELUDE=fill(load_template("triton_prelude.py.tmpl"), KERNEL=kernel.name),
        NAME=kernel.name,
        H=str(x.shape[1]),
        I=str(down.shape[2]),
        K=str(index.shape[1]),
        E=str(up.shape[0]),
        GATED=str(args.gated),
        ACT=TRITON_ACTIVATIONS[args.act],
        GLU=triton_glu(args, f"{kernel.name}_act"),
        BIAS=str(args.bias),
        GS="2" if args.interleaved else "1",
        UOFF="1" if args.interleaved else str(down.shape[2]),
        PRECISION=', input_precision="ieee"' if x.dtype is DType.F32 else "",
    )


def h_dtype(kernel: ExpertsKernel) -> torch.dtype:
    """The intermediate h's storage: x's dtype (16-bit tiles for the second GEMM's tensor cores)."""
    return kernel.node.dtype.torch


def compile_experts(kernel: ExpertsKernel, interpret: bool) -> CompiledKernel:
    """Load the rendered module (disk + memory cached) and return the launch for the runtime."""
    from kernelize.codegen.triton_base import load_module
    from kernelize.runtime.cache import KERNELS

    source = render_experts(kernel)
    key = (hashlib.sha256(source.encode()).hexdigest(), "interpret" if interpret else "cuda")
    try:
        module = KERNELS.get_or_build(key, lambda: load_module(source, kernel.name, interpret))
    except Exception as e:
        raise KernelCompileError(kernel.name, key[0], f"{type(e).__name__}: {e}", source, "triton") from e
    up_fn, down_fn = getattr(module, f"{kernel.name}_up"), getattr(module, f"{kernel.name}_down")
    x_node, index_node, _, up_node, _ = kernel.node.src[:5]
    hidden, k, experts = int(x_node.shape[1]), int(index_node.shape[1]), int(up_node.shape[0])
    inter = int(kernel.node.src[4].shape[2])
    bk = BK[kernel.node.dtype]
    upcast = interpret or kernel.node.dtype is DType.F32

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int] | None
    ) -> None:
        x, index, weights, up, down, *biases = reads
        ub, db = biases or (x, x)  # without biases: never read (BIAS is False), any pointer will do
        bias_strides = (*ub.stride(), *db.stride()) if biases else (0, 0, 0, 0)
        (out,) = writes
        pairs = index.numel()
        if pairs == 0:
            return
        al = align_pairs(index, experts, block_m(pairs, experts))
        h = torch.empty(al.blocks * al.block_m, inter, dtype=h_dtype(kernel), device=x.device)
        y = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
        meta = {"BM": al.block_m, "BN": BN, "BK": bk, "UPCAST": upcast, "num_warps": NUM_WARPS}
        ids, bexp = al.sorted_pair_ids, al.block_expert_ids
        up_fn[(al.blocks, -(-inter // BN))](
            x, up, h, ids, bexp, ub, pairs, *x.stride(), *up.stride(), *bias_strides[:2], **meta
        )
        down_fn[(al.blocks, -(-hidden // BN))](
            h,
            down,
            weights,
            y,
            ids,
            bexp,
            db,
            pairs,
            *weights.stride(),
            *down.stride(),
            *bias_strides[2:],
            **meta,
        )
        out.copy_(y.view(x.shape[0], k, hidden).sum(1))

    return CompiledKernel(kernel.name, "triton", source, launch, kernel)


def aot_jobs(kernel: ExpertsKernel, arch: int, path: str, bm: int = 16) -> list[dict]:
    """``triton.compile`` jobs (see :mod:`kernelize.codegen.triton_aot`) for both kernels at ``BM = bm``."""
    from kernelize.codegen.triton_base import SIG

    x, _, weights, _, _ = kernel.node.src[:5]
    t = "*" + SIG[x.dtype]
    consts = {"BM": bm, "BN": BN, "BK": BK[x.dtype], "UPCAST": x.dtype is DType.F32}
    ptrs = {
        "up": {"x_ptr": t, "up_ptr": t, "h_ptr": t},
        "down": {"h_ptr": t, "down_ptr": t, "w_ptr": "*" + SIG[weights.dtype], "y_ptr": "*fp32"},
    }
    bias = {"up": {"ub_ptr": t}, "down": {"db_ptr": t}}
    ints = {
        "up": ("sxt", "sxh", "sue", "sun", "suh", "sbe", "sbn"),
        "down": ("swt", "swk", "sde", "sdn", "sdi", "sbe", "sbn"),
    }
    jobs = []
    for part in ("up", "down"):
        sig = {**ptrs[part], "ids_ptr": "*i32", "bexp_ptr": "*i32", **bias[part], "S": "i32"}
        sig.update(dict.fromkeys(ints[part], "i32"))
        sig.update(dict.fromkeys(consts, "constexpr"))
        jobs.append(
            {
                "path": path,
                "name": f"{kernel.name}_{part}",
                "signature": sig,
                "constexprs": consts,
                "arch": arch,
                "num_warps": NUM_WARPS,
            }
        )
    return jobs


__all__ = ["TRITON_ACTIVATIONS", "aot_jobs", "block_m", "compile_experts", "render_experts", "triton_glu"]
