"""Launching a compiled graph's generated kernels: the call itself, a named row in the user's profile
while the torch profiler records, and the kernels that return tensors of their own (``fresh``).

Example:
    >>> launch(step, reads, writes, sizes)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kernelize.autokernel.kernels import Kernel
from kernelize.runtime.schedule import Step


def label(k: Kernel) -> str:
    """``kernelize::<kind>[<ops>]:<name>``: what a generated kernel computes, for profiler tables."""
    ops = sorted({str(op) for op in k.ops})
    return f"kernelize::{k.kind}[{','.join(ops)}]:{k.name}"


def launch(
    step: Step, reads: list[torch.Tensor], writes: list[torch.Tensor], sizes: Mapping[str, int]
) -> None:
    """Run ``step``'s generated kernel on ``reads`` into ``writes``."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(label(step.kernel)):  # a named row in the user's profile
            step.compiled.launch(reads, writes, sizes)
    else:
        step.compiled.launch(reads, writes, sizes)


def launch_fresh(
    step: Step,
    reads: Sequence[torch.Tensor],
    sizes: Mapping[str, int],
    writes: Callable[[], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Run ``step``'s kernel through ``CompiledKernel.fresh`` (a library call that makes its outputs itself)
    and return its outputs; where it declines at these sizes, :func:`launch` it into ``writes()``. One row
    in the profile either way (a declined try of its own read as a second call of the kernel)."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(label(step.kernel)):
            return _fresh_or_launch(step, reads, sizes, writes)
    return _fresh_or_launch(step, reads, sizes, writes)


def _fresh_or_launch(
    step: Step,
    reads: Sequence[torch.Tensor],
    sizes: Mapping[str, int],
    writes: Callable[[], list[torch.Tensor]],
) -> list[torch.Tensor]:
    outs = step.compiled.fresh(reads, sizes)
    if outs is None:
        outs = writes()
        step.compiled.launch(reads, outs, sizes)
    return outs


__all__ = ["label", "launch", "launch_fresh"]
