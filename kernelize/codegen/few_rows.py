"""Few-row matmuls on the GPU backends (Triton, CUDA C), from one MATMUL kernel of the plan.

Up to ``FEW_ROWS`` rows (decode), a tiled matmul leaves most of the GPU idle and reads each weight tile
once per row tile anyway; instead each matmul runs as a ``SPLITK`` kernel (a grid of column tiles x slices
of K, every row in one program, partial sums added to a zeroed f32 temporary) and the epilogue (bias,
activation, gate * up, residual) as a pointwise kernel over the temporaries. Above ``FEW_ROWS`` the
backend's tiled matmul kernel runs (when the kernel has one matmul; the split-K path serves any row count).

Example:
    >>> ck = compile_few_rows(kernel, backend._compile, "cuda")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from kernelize.autokernel.kernels import Kernel, Load, MatmulKernel
from kernelize.autokernel.matmul import (
    FEW_ROWS,
    epilogue_kernel,
    matmul_parts,
    rows_of,
    splitk_kernel,
    weights_shared,
)
from kernelize.ir.dtypes import DType
from kernelize.ir.shapes import bind
from kernelize.runtime.backend import CompiledKernel


def retype(k: Kernel, new: Mapping) -> Kernel:
    """``k`` reading buffers ``new[b]`` instead of ``b``."""
    body = tuple(
        replace(e, buffer=new[e.buffer]) if isinstance(e, Load) and e.buffer in new else e for e in k.body
    )
    return replace(k, body=body)


def few_rows_apply(kernel: MatmulKernel) -> bool:
    """Whether ``kernel`` multiplies rows by weights (the same right operand for every row), the case the
    few-row pair serves; a batched matmul keeps the tiled kernel alone."""
    return len(kernel.domain) >= 2 and weights_shared(kernel)


def compile_few_rows(
    kernel: MatmulKernel, compile_one: Callable[[Kernel], CompiledKernel], backend: str
) -> CompiledKernel:
    """One CompiledKernel for MATMUL ``kernel``: split-K + epilogue up to FEW_ROWS rows, tiled above."""
    tiled = compile_one(kernel) if len(matmul_parts(kernel).mms) == 1 else None
    epi, temps = epilogue_kernel(kernel)
    f32 = [replace(t, dtype=DType.F32) for t in temps]  # partial sums accumulate in f32
    epi = retype(epi, dict(zip(temps, f32)))
    parts = [compile_one(splitk_kernel(kernel, j, t)) for j, t in enumerate(f32)]
    epilogue = compile_one(epi)
    slots = [(b in f32, f32.index(b) if b in f32 else kernel.reads.index(b)) for b in epi.reads]
    index = {b: i for i, b in enumerate(kernel.reads)}

    def launch(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]):
        if tiled is not None and rows_of(kernel, sizes) > FEW_ROWS:
            return tiled.launch(reads, writes, sizes)
        dom = bind(kernel.domain, sizes)
        acc = [torch.zeros(dom, dtype=torch.float32, device=writes[0].device) for _ in f32]
        for part, t in zip(parts, acc):
            part.launch([reads[index[b]] for b in part.kernel.reads], [t], sizes)
        epilogue.launch([acc[i] if tmp else reads[i] for tmp, i in slots], writes, sizes)

    sources = [c.source for c in (*parts, epilogue, *([tiled] if tiled else []))]
    return CompiledKernel(kernel.name, backend, "\n".join(sources), launch, kernel)


__all__ = ["compile_few_rows", "retype"]
