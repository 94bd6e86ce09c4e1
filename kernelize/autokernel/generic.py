"""Loop kernels whose sizes are run-time arguments, so kernels that differ only in their sizes share one
compiled function.

A plan specialises every loop kernel to its static sizes: the sizes, strides and offsets are constants of
its source. That pays where a kernel has enough work for constant trip counts to matter; for the many small
kernels of a CNN (EfficientNet-B0 at batch 1: 15 squeeze-excitation matmuls of 8-1152 columns, 10 channel
scalings, 5 global means) it only makes distinct sources, each ~0.2 s of compiler time.
:func:`sizes_as_arguments` turns each integer of a kernel's indexing (domain, strides, offsets, mask bounds,
the contraction) above 1 into a symbol, named by first appearance, so two kernels of the same structure
render to the same source and take their sizes as arguments like a symbolic dimension's. 0 and 1 stay
literal: they are structure (a broadcast, a unit stride the loops vectorise along).

Example:
    >>> generic, values = sizes_as_arguments(kernel)  # doctest: +SKIP
    >>> values  # doctest: +SKIP
    {'kz_c0': 8, 'kz_c1': 32}
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from kernelize.autokernel.kernels import Compute, Kernel, Load, LoopKernel, Store
from kernelize.ir.graph import Op
from kernelize.ir.shapes import Dim, Sym

SMALL_WORK = 1 << 20  # domain elements a loop kernel made generic may have
SMALL_MACS = 1 << 16  # multiply-adds a matmul made generic may have (ShuffleNet v2's 1024 -> 1000 head,
# ~1M, ran 2.5x slower with its sizes as arguments: its column loops lost their constant bounds)


def small(kernel: Kernel) -> bool:
    """Whether ``kernel`` is a loop kernel of static sizes and little work (:data:`SMALL_WORK` elements,
    :data:`SMALL_MACS` for a matmul): where its run time is mostly the call's, so sizes as arguments cost
    nothing that shows. Not one whose loads are masked or gathered or that concatenates: the bounds they
    test, static, split its loops into plain pieces (ShuffleNet v2's channel shuffle: 24 -> 53 us with
    tests at every element)."""
    if not isinstance(kernel, LoopKernel) or not all(isinstance(d, int) for d in kernel.domain):
        return False
    if any(isinstance(e, Load) and (e.mask or e.indirect) for e in kernel.body):
        return False
    if any(isinstance(e, Compute) and e.op is Op.CONCAT for e in kernel.body):
        return False
    k = [e.arg for e in kernel.body if isinstance(e, Compute) and e.op is Op.MATMUL]
    if not all(isinstance(c, int) for c in k):
        return False
    return prod(kernel.domain) * max(k, default=1) <= (SMALL_MACS if k else SMALL_WORK)


def sizes_as_arguments(kernel: LoopKernel) -> tuple[LoopKernel, dict[str, int]]:
    """``kernel`` with each integer above 1 of its indexing a symbol ``kz_c<i>`` (one per distinct value, in
    order of appearance), and the symbols' values, which a launch passes beside the graph's own."""
    names: dict[int, str] = {}

    def dim(d: Dim) -> Dim:
        if isinstance(d, Sym):
            return d if d.coef < 2 else Sym(tuple(sorted((*d.names, *dim(d.coef).names))))
        if d < 2:
            return d
        return Sym((names.setdefault(d, f"kz_c{len(names)}"),))

    def dims(ds) -> tuple:
        return tuple(dim(d) for d in ds)

    def entry(e):
        if isinstance(e, Load):
            return replace(
                e,
                strides=dims(e.strides),
                offset=dim(e.offset),
                mask=tuple((axis, dim(lo), dim(hi)) for axis, lo, hi in e.mask),
                indirect=tuple(replace(i, stride=dim(i.stride), size=dim(i.size)) for i in e.indirect),
            )
        if isinstance(e, Store):
            return replace(e, strides=dims(e.strides), offset=dim(e.offset))
        if e.op is Op.MATMUL:
            return replace(e, arg=dim(e.arg))
        return e

    domain = dims(kernel.domain)
    body = tuple(entry(e) for e in kernel.body)
    stores = tuple(entry(s) for s in kernel.stores)
    return replace(kernel, domain=domain, body=body, stores=stores), {n: v for v, n in names.items()}


__all__ = ["SMALL_MACS", "SMALL_WORK", "sizes_as_arguments", "small"]
