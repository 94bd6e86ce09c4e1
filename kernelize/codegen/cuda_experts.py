"""The CUDA C grouped-expert kernels: ``templates/cuda_experts.cu`` filled for one ``EXPERTS`` kernel.

The plan of :mod:`kernelize.codegen.triton_experts`: the pairs sorted by expert and padded to blocks of
``BM`` rows by torch ops on the device (:func:`kernelize.codegen.experts_align.align_pairs`), then two
shared-memory tiled grouped GEMMs, ``<name>_up`` (gathered rows of x against an expert's gate and up rows,
storing ``h = act(gate) * up`` in f32) and ``<name>_down`` (``h @ down[e]^T`` times the routing weight,
one f32 row per pair), and a torch sum over K. No atomics. Sizes H, I, K, E and the activation are baked
into the source; the pair count and every operand's strides are ``int64_t`` arguments.

Example:
    >>> source, name = render_experts(kernel)  # doctest: +SKIP  (no GPU needed)
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from kernelize.autokernel.kernels import ExpertsKernel
from kernelize.codegen.cpu_experts import C_ACTIVATIONS, c_glu, check_experts_kernel
from kernelize.codegen.cuda_attention import C_TYPES
from kernelize.codegen.experts_align import align_pairs
from kernelize.codegen.render import c_name
from kernelize.codegen.template import fill, load_template
from kernelize.runtime.backend import CompiledKernel

BM, BN, THREADS = 32, 32, 256  # KZ_BM, KZ_BN, KZ_THREADS of the template

Grid = tuple[int, int, int]


class ExpertsLaunch(NamedTuple):
    """One call's launches: per kernel (pointer values, int64 values, grid), and the temporaries the
    kernels write (``y``: the weighted rows per pair, summed over K by :func:`finish`)."""

    up: tuple[list[int], list[int], Grid]
    down: tuple[list[int], list[int], Grid]
    buffers: tuple[torch.Tensor, ...]
    y: torch.Tensor


def render_experts(kernel: ExpertsKernel) -> tuple[str, str]:
    """The CUDA C source of an ``EXPERTS`` kernel and its name (entry points ``<name>_up`` and
    ``<name>_down``)."""
    args = check_experts_kernel(kernel)
    x, index, weights, up, down = kernel.node.src[:5]
    name = c_name(kernel.name)
    source = fill(
        load_template("cuda_experts.cu"),
        KERNEL=kernel.name,
        NAME=name,
        PRELUDE=load_template("cuda_prelude.cuh"),
        T=C_TYPES[x.dtype],
        TW=C_TYPES[weights.dtype],
        H=str(x.shape[1]),
        I=str(down.shape[2]),
        K=str(index.shape[1]),
        E=str(up.shape[0]),
        GATED="true" if args.gated else "false",
        ACT=C_ACTIVATIONS[args.act],
        GLU=c_glu(args),
        BIAS="true" if args.bias else "false",
        INTERLEAVED="true" if args.interleaved else "false",
    )
    return source, name


def launch_args(kernel: ExpertsKernel, reads: Sequence[torch.Tensor]) -> ExpertsLaunch:
    """Sort and pad the pairs (no host sync), allocate h and y, and spell both launches' arguments."""
    x, index, weights, up, down, *biases = reads
    ub, db = biases or (None, None)
    bias_strides = (*ub.stride(), *db.stride()) if biases else (0, 0, 0, 0)
    experts, inter = int(kernel.node.src[3].shape[0]), int(kernel.node.src[4].shape[2])
    pairs, hidden = index.numel(), x.shape[1]
    al = align_pairs(index, experts, BM)
    h = torch.empty(al.blocks * BM, inter, dtype=torch.float32, device=x.device)
    y = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    ids, bexp = al.sorted_pair_ids, al.block_expert_ids
    up_call = (
        [x.data_ptr(), up.data_ptr(), h.data_ptr(), ids.data_ptr(), bexp.data_ptr()]
        + [ub.data_ptr() if biases else 0],
        [pairs, *x.stride(), *up.stride(), *bias_strides[:2]],
        (al.blocks, -(-inter // BN), 1),
    )
    down_call = (
        [h.data_ptr(), down.data_ptr(), weights.data_ptr(), y.data_ptr(), ids.data_ptr(), bexp.data_ptr()]
        + [db.data_ptr() if biases else 0],
        [pairs, *weights.stride(), *down.stride(), *bias_strides[2:]],
        (al.blocks, -(-hidden // BN), 1),
    )
    return ExpertsLaunch(up_call, down_call, (h, ids, bexp), y)


def finish(call: ExpertsLaunch, out: torch.Tensor) -> None:
    """out = the sum over each token's K weighted rows (f32, then x's dtype)."""
    tokens, hidden = out.shape
    out.copy_(call.y.view(tokens, -1, hidden).sum(1))


def compile_experts(kernel: ExpertsKernel, arch: str) -> CompiledKernel:
    """NVRTC-compile (disk-cached) and return the launch for the runtime."""
    from kernelize.codegen.nvrtc import CubinModule, compile_cubin, require_driver

    source, name = render_experts(kernel)
    cubin = compile_cubin(source, name, arch)
    up_fn, down_fn = CubinModule(cubin, f"{name}_up"), CubinModule(cubin, f"{name}_down")
    p, i64 = ctypes.c_void_p, ctypes.c_int64

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int] | None
    ) -> None:
        require_driver()
        (out,) = writes
        if not all(t.is_cuda for t in (*reads, out)):
            raise ValueError(f"cuda kernel {kernel.name}: every tensor must be on the CUDA device")
        if reads[1].numel() == 0:
            return
        dev = out.device.index or 0
        call = launch_args(kernel, reads)
        for fn, (ptrs, ints, grid) in ((up_fn, call.up), (down_fn, call.down)):
            fn.launch(grid, (THREADS, 1, 1), [(v, p) for v in ptrs] + [(v, i64) for v in ints], dev)
        finish(call, out)

    return CompiledKernel(kernel.name, "cuda", source, launch, kernel)


__all__ = ["ExpertsLaunch", "compile_experts", "finish", "launch_args", "render_experts"]
