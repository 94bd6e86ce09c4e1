"""The CUDA C attention kernel: ``templates/cuda_attention.cu`` filled for one ``ATTENTION`` kernel.

A warp per (query row, batch x head, key split); decode shapes (few rows, long keys) split the keys and a
second kernel, ``<name>_combine``, merges the splits. The scale is baked into the source; sizes and every
operand's strides are ``int64_t`` arguments, so transposed views are read in place.

Example:
    >>> src = render_attention(kernel)  # doctest: +SKIP  (no GPU needed)
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

from kernelize.autokernel.kernels import Kernel
from kernelize.codegen.cpu_attention import MASK_CODES, check_attention_kernel
from kernelize.codegen.render import Renderer, c_name, score_mod_lines
from kernelize.codegen.template import fill, load_template
from kernelize.ir.attention import split_operands
from kernelize.ir.dtypes import DType
from kernelize.ir.ops import AttentionArgs
from kernelize.runtime.backend import CompiledKernel

C_TYPES = {DType.F32: "float", DType.F16: "__half", DType.BF16: "__nv_bfloat16", DType.BOOL: "bool"}
WARP = 32
MIN_SPLIT = 256  # keys per split, at least
# pointers, then int64 sizes and strides (kernel); pointers, then int64 sizes (combine)
N_PTRS, N_INTS, COMBINE_PTRS, COMBINE_INTS = 7, 21, 2, 2


def render_attention(kernel: Kernel) -> tuple[str, str]:
    """The CUDA C source of an ``ATTENTION`` kernel and its entry point (``<name>_combine`` also exists)."""
    args = check_attention_kernel(kernel)
    node = kernel.node
    q, _, v = node.src[:3]
    name = c_name(kernel.name)
    mask = split_operands(node.src, args)[3]
    lines, result = score_mod_lines(Renderer(), args.score_mod, ("sm0", "sm1", "sm2", "sm3"))
    source = fill(
        load_template("cuda_attention.cu"),
        KERNEL=kernel.name,
        NAME=name,
        PRELUDE=load_template("cuda_prelude.cuh"),
        D=str(q.shape[-1]),
        DV=str(v.shape[-1]),
        CAUSAL=str(int(args.causal)),
        MASK=str(MASK_CODES[args.mask]),
        HAS_MOD=str(int(args.score_mod is not None)),
        SINKS=str(int(args.sinks)),
        SCORE_MOD="\n".join(f"  {line}" for line in [*lines, f"return {result};"]),
        T=C_TYPES[node.dtype],
        TM=C_TYPES[mask.dtype] if mask is not None else "float",
        SCALE=f"(float){args.scale.hex()}",  # exact: a hex literal rounds to f32 as the CPU kernel's does
    )
    return source, name


def plan_splits(rows: int, lk: int, processors: int) -> int:
    """Key splits: enough warps to fill ``processors`` x 32 warp slots, none shorter than MIN_SPLIT keys."""
    if rows >= processors * 32 or lk < 2 * MIN_SPLIT:
        return 1
    return max(1, min(-(-processors * 32 // rows), lk // MIN_SPLIT))


def launch_args(
    reads: Sequence[torch.Tensor], out: torch.Tensor, part: torch.Tensor, nsplit: int, args: AttentionArgs
) -> tuple[list[int], list[int], tuple[int, int, int]]:
    """Pointer values, int64 values and the grid of the attention kernel for one call (f32 sinks: the
    caller keeps them alive)."""
    q, k, v, m, sinks = split_operands(reads, args)
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    split_len = -(-lk // nsplit)
    ptrs = [
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        m.data_ptr() if m is not None else 0,
        out.data_ptr(),
        part.data_ptr(),
        sinks.data_ptr() if sinks is not None else 0,
    ]
    mst = m.stride() if m is not None else (0, 0, 0, 0)
    ints = [hq, lq, lk, hq // hkv, split_len, *q.stride(), *k.stride(), *v.stride(), *mst]
    return ptrs, ints, (lq, b * hq, nsplit)


def compile_attention(kernel: Kernel, arch: str) -> CompiledKernel:
    """NVRTC-compile (disk-cached) and return the launch for the runtime."""
    from kernelize.codegen.nvrtc import CubinModule, compile_cubin, require_driver, sm_count

    source, name = render_attention(kernel)
    cubin = compile_cubin(source, name, arch)
    main, combine = CubinModule(cubin, name), CubinModule(cubin, f"{name}_combine")
    p, i64 = ctypes.c_void_p, ctypes.c_int64

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int] | None
    ):
        require_driver()
        (out,) = writes
        q = reads[0]
        if not all(t.is_cuda for t in (*reads, out)):
            raise ValueError(f"cuda kernel {kernel.name}: every tensor must be on the CUDA device")
        dev = q.device.index or 0
        b, hq, lq, _ = q.shape
        nsplit = plan_splits(b * hq * lq, reads[1].shape[2], sm_count(dev))
        part = (
            out
            if nsplit == 1
            else torch.empty(b * hq * nsplit * lq * (out.shape[-1] + 2), dtype=torch.float32, device=q.device)
        )
        reads = [*reads[:-1], reads[-1].float().contiguous()] if kernel.node.arg.sinks else reads
        ptrs, ints, grid = launch_args(reads, out, part, nsplit, kernel.node.arg)
        main.launch(grid, (WARP, 1, 1), [(x, p) for x in ptrs] + [(x, i64) for x in ints], dev)
        if nsplit > 1:
            args = [(part.data_ptr(), p), (out.data_ptr(), p), (lq, i64), (nsplit, i64)]
            combine.launch((lq, b * hq, 1), (WARP, 1, 1), args, dev)

    return CompiledKernel(kernel.name, "cuda", source, launch, kernel)


__all__ = ["compile_attention", "launch_args", "plan_splits", "render_attention"]
