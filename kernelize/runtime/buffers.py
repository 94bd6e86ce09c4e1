"""Memory planning of a compiled graph: which buffers are channels-last, which live in an arena and for
how long, which may be written in place, where outputs come from, and when outputs must be copied so that
none aliases an input or another output.

The allocators themselves (:class:`~kernelize.runtime.memory.OutputPool`,
:class:`~kernelize.runtime.memory.Arena`, huge pages) are in :mod:`kernelize.runtime.memory`; this module
decides, from the step list (:mod:`kernelize.runtime.schedule`), what goes where.

Example:
    >>> lives = arena_lifetimes(kernels, steps, outputs, keep, channels_last)  # doctest: +SKIP
    >>> arena = arena_for(arenas, bound.shapes, lives, residuals_in_place(steps))  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from kernelize.autokernel.kernels import Kernel
from kernelize.ir.graph import LAYOUT, Graph, Node, Op
from kernelize.runtime.library import view_bases
from kernelize.runtime.memory import Arena, OutputPool, empty_huge
from kernelize.runtime.replay import c_library
from kernelize.runtime.schedule import Step

ARENAS = 4  # input signatures whose arenas a compiled graph keeps


# ---- layouts ---------------------------------------------------------------------------------------------
def channels_last_layout(plan: Any, kernels: Sequence[Kernel]) -> frozenset[Node]:
    """The buffers kept channels-last: the plan's NHWC buffers when it laid them out (generated kernels
    index those NHWC), else what :func:`channels_last_buffers` finds among library-only buffers."""
    settings = getattr(plan, "settings", None)
    if settings is not None and settings.channels_last:
        return plan.channels_last
    return channels_last_buffers(kernels)


def channels_last_buffers(kernels: Sequence[Kernel]) -> frozenset[Node]:
    """4-D buffers kept channels-last: written by a CONV kernel or a pool, and read only as the direct
    activation or residual of CONV kernels or by pools (torch ops follow any strides; a plan that did not lay
    buffers out lowered its generated kernels for row-major buffers, so a buffer any of them reads stays
    NCHW)."""
    readers: dict[Node, list[Kernel]] = {}
    for k in kernels:
        for b in k.reads:
            readers.setdefault(b, []).append(k)

    return frozenset(
        b
        for k in kernels
        if k.nhwc_reads
        for b in k.writes
        if b.rank == 4 and all(b in r.nhwc_reads for r in readers.get(b, ()))
    )


# ---- the arena -------------------------------------------------------------------------------------------
def arena_lifetimes(
    kernels: Sequence[Kernel],
    steps: Sequence[Step],
    outputs: Container[Node],
    keep: Container[Node],
    channels_last: Container[Node],
) -> dict[Node, tuple[int, int, int, bool]]:
    """The buffers an arena holds: written by a generated kernel (or a generated conv, NHWC) and neither a
    graph output nor viewed by one (``keep``); per buffer (step writing it, index among its writes, last
    step reading it, whether it is stored NHWC). A step reads a buffer also through the layout views it
    materialises (its memory is reused after the last such read, whatever still references it)."""
    last: dict[Node, int] = {}
    for i, k in enumerate(kernels):
        for b in view_bases(k.touched):
            last[b] = i
    lives = {}
    for i, st in enumerate(steps):
        # a library op one of our C functions runs (a pool, a global mean) writes its output there when
        # replayed
        ours = st.library and c_library(st.kernel.node, channels_last)
        if not ours and (st.library or st.compiled is None):
            continue
        for j, b in enumerate(st.kernel.writes):
            # a conv writes NHWC: the output of one the plan reads NCHW is a copy made after the call
            if b not in outputs and b not in keep and (st.conv is None or b in channels_last):
                lives[b] = (i, j, last.get(b, i), b in channels_last)
    return lives


def residuals_in_place(steps: Sequence[Step]) -> dict[Node, Node]:
    """Per generated conv with a residual, its output -> the residual: a conv adds it element by element,
    so its output may overwrite the residual where nothing reads that later (the arena checks), as
    onnxruntime's fused Conv + Sum does. ResNet-50 (1 thread, thread CPU time, min of 12, side by side):
    batch 1 81.0-83.2 -> 79.7-80.1 ms, batch 8 654 -> 641 ms."""
    return {
        st.kernel.writes[0]: st.kernel.epilogue.residual
        for st in steps
        if st.conv is not None and st.compiled is not None and st.kernel.epilogue.residual is not None
    }


class ConcatSlices(NamedTuple):
    """Concats written in place (:func:`concats_in_place`)."""

    pieces: dict[Node, tuple[Node, int, int]]  # piece -> (concat, first channel, end channel)
    skip: frozenset[int]  # the concat steps, which have nothing left to do when the pieces are slices


def concats_in_place(
    kernels: Sequence[Kernel], steps: Sequence[Step], lives: Mapping[Node, tuple[int, int, int, bool]]
) -> ConcatSlices:
    """Channel concats of NHWC arena buffers whose pieces generated convs write straight into the concat's
    buffer: each piece is a view of its channels (pixel stride: the concat's channels), and the concat step
    copies nothing, as onnxruntime's and oneDNN's concat-in-place do for SqueezeNet's fire modules and
    GoogLeNet's inception blocks. A concat qualifies when its kernel computes only the concat (on the
    channels, of distinct pieces with static channel counts) and every piece is a generated conv's output in
    the arena, NHWC, that nothing but the concat reads."""
    touched: dict[Node, set[int]] = {}
    for i, k in enumerate(kernels):
        for b in (*view_bases(k.touched), *k.writes):
            touched.setdefault(b, set()).add(i)
    pieces: dict[Node, tuple[Node, int, int]] = {}
    skip = []
    for i, st in enumerate(steps):
        k = st.kernel
        c = k.computes[0] if len(k.computes) == 1 else None
        if c is None or c.op is not Op.CONCAT or c.arg not in (1, -3) or c.rank != 4 or k.writes != (c,):
            continue
        if st.library or st.conv is not None or st.compiled is None or not lives.get(c, (0,) * 4)[3]:
            continue
        if len(set(c.src)) != len(c.src) or set(k.reads) != set(c.src):
            continue
        if not all(_writes_slice(p, i, steps, lives, touched) for p in c.src):
            continue
        ends = list(itertools.accumulate(p.shape[1] for p in c.src))
        pieces.update((p, (c, end - p.shape[1], end)) for p, end in zip(c.src, ends, strict=True))
        skip.append(i)
    return ConcatSlices(pieces, frozenset(skip))


def _writes_slice(p: Node, reader: int, steps, lives, touched) -> bool:
    """Whether piece ``p`` can be a channel slice: an NHWC arena buffer of static channels that a generated
    conv writes and only step ``reader`` reads."""
    if p not in lives or not lives[p][3] or not isinstance(p.shape[1], int):
        return False
    writer = lives[p][0]
    st = steps[writer]
    return st.conv is not None and st.compiled is not None and touched.get(p, set()) == {writer, reader}


def arena_for(
    arenas: OrderedDict[tuple, Arena],
    shapes: tuple,
    lives: Mapping[Node, tuple[int, int, int, bool]],
    inplace: Mapping[Node, Node],
    slices: Mapping[Node, tuple[Node, int, int]] | None = None,
) -> Arena | None:
    """The arena for the per-step ``shapes`` of a signature, from ``arenas`` (the last :data:`ARENAS`
    signatures keep theirs) or made for ``lives`` (:func:`arena_lifetimes`); None when there are none.
    ``slices``: pieces that are channel slices of a concat's buffer (:func:`concats_in_place`): they take
    no memory of their own, and the concat's buffer lives from the first piece's step."""
    if not lives:
        return None
    arena = arenas.get(shapes)
    if arena is None:
        slices = slices or {}
        first = {b: i for b, (i, *_) in lives.items()}
        for p, (c, *_) in slices.items():
            first[c] = min(first[c], lives[p][0])
        buffers = {
            b: (shapes[i][j], b.dtype.torch, first[b], end)
            for b, (i, j, end, _) in lives.items()
            if b not in slices
        }
        layouts = {b: v[3] for b, v in lives.items()}
        arena = arenas[shapes] = Arena(buffers, layouts, inplace, slices)
        if len(arenas) > ARENAS:
            arenas.popitem(last=False)
    else:
        arenas.move_to_end(shapes)
    return arena


# ---- outputs ---------------------------------------------------------------------------------------------
class Buffers:
    """Where the buffers a step writes come from, outside the arena: the CPU's output pool (large buffers
    the caller dropped are handed out again: fresh ones cost more in page faults than the kernels), new
    huge-page tensors for the graph outputs in ``fresh``, else ``torch.empty``.

    Attributes:
        pool: the :class:`OutputPool`, or None (not the cpu backend on the CPU).
        channels_last: the buffers made NHWC (viewed as NCHW).
        fresh: buffers never taken from the pool (gradients autograd adopts).
    """

    def __init__(self, device: torch.device, pooled: bool, channels_last: frozenset[Node]) -> None:
        self.device = device
        self.pool = OutputPool() if pooled else None
        self.channels_last = channels_last
        self.fresh: frozenset[Node] = frozenset()

    def outputs(
        self,
        k: Kernel,
        shapes: Sequence[tuple[int, ...]],
        views: Mapping[Node, torch.Tensor] = {},  # noqa: B006 (read only)
    ) -> list[torch.Tensor]:
        """Buffers for what ``k`` writes: the arena's ``views`` where it has them, else new ones (the pool
        recycles large ones the caller dropped)."""
        if self.pool is not None:
            return [views[b] if b in views else self.empty(b, shape) for b, shape in zip(k.writes, shapes)]
        return [
            views[b] if b in views else torch.empty(shape, dtype=b.dtype.torch, device=self.device)
            for b, shape in zip(k.writes, shapes)
        ]

    def empty(self, b: Node, shape: tuple[int, ...], nhwc: bool | None = None) -> torch.Tensor:
        """A CPU buffer for ``b``: from the pool unless it is fresh, NHWC when the plan lays it out so (or
        ``nhwc`` says so)."""
        nhwc = b in self.channels_last if nhwc is None else nhwc
        if nhwc:
            n, c, h, w = shape
            shape = (n, h, w, c)
        if b in self.fresh:  # new tensors (gradients autograd adopts), huge pages asked for
            t = empty_huge(shape, b.dtype.torch)
        else:
            t = self.pool.empty(b, shape, b.dtype.torch)
        return t.permute(0, 3, 1, 2) if nhwc else t


# ---- aliasing --------------------------------------------------------------------------------------------
def outputs_own_buffers(steps: Sequence[Step], graph: Graph) -> bool:
    """Whether every output is (a view of) its own buffer that a generated kernel writes: then no output
    can be an input or share memory with another, and calls skip the alias check (:func:`no_alias` reads
    every input's and output's address: tens of microseconds of a cold training backward)."""
    writer = {b: st for st in steps for b in st.kernel.writes}
    bases = [[b for b in view_bases([o]) if b.op not in LAYOUT] for o in graph.outputs]
    if any(len(b) != 1 for b in bases) or len({b[0] for b in bases}) != len(bases):
        return False
    owners = [writer.get(b[0]) for b in bases]
    return all(
        st is not None and st.compiled is not None and not st.library and st.conv is None for st in owners
    )


def no_alias(outs: list[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Custom ops may not return inputs or the same tensor twice: copy those."""
    seen = {t.data_ptr() for t in inputs if t.numel()}
    out = []
    for t in outs:
        if not t.numel():
            t = torch.empty_like(t)  # empty tensors may still share storage with an input
        elif t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out.append(t)
    return out


__all__ = [
    "ARENAS",
    "Buffers",
    "ConcatSlices",
    "arena_for",
    "arena_lifetimes",
    "channels_last_buffers",
    "channels_last_layout",
    "concats_in_place",
    "no_alias",
    "outputs_own_buffers",
    "residuals_in_place",
]
