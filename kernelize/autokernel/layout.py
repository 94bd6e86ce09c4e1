"""Channels-last buffers: which 4-D buffers the planner lays out NHWC, and their strides.

oneDNN convolutions read and write channels-last (NHWC) tensors; a buffer between two convolutions in
NCHW costs a copy on each side. Generated kernels index every buffer through the strides of their loads
and stores, so they can read and write NHWC as well as NCHW: the planner picks the buffers to keep NHWC
(:func:`channels_last_buffers`), lowers their loads and stores with :func:`nhwc_strides`, and reorders a
pointwise kernel's domain so that its inner loop runs along the channels of what it stores
(:func:`channels_inner`). A buffer is NHWC when it is 4-D with static channel and image sizes, is not (under)
a graph output, is written by a conv, a pool or a generated or matmul kernel feeding a conv or pool, and
every reader is a conv or pool reading it directly (its activation or residual; a conv's activation may
also be a view only reordering its channels, see :func:`channel_map`), a generated pointwise or
row kernel, or a matmul kernel's epilogue (a ConvNeXt block's residual: its output projection is a matmul
over (N, H, W, C) whose NHWC output oneDNN writes in place, and the next depthwise conv reads it as is).
The runtime allocates those buffers NHWC (``Plan.channels_last``).

Example (squeeze-excite between two convs)::

    y = conv(x, w1)            # CONV kernel, writes y NHWC
    s = sigmoid(mean(y) @ a)   # ROW kernel reads y with strides (H*W*C, 1, W*C, C)
    z = y * s                  # POINTWISE over (N, H, W, C): y and z contiguous, s broadcast
    conv(z, w2)                # reads z NHWC, no copy
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

import torch

from kernelize.autokernel.kernels import (
    Compute,
    Kernel,
    KernelKind,
    LibraryKernel,
    Load,
    PointwiseKernel,
    RowKernel,
)
from kernelize.autokernel.reasons import Rejection
from kernelize.ir.graph import LAYOUT, Node, Op
from kernelize.ir.reference import EVAL
from kernelize.ir.shapes import numel

GENERATED = frozenset({KernelKind.POINTWISE, KernelKind.ROW})
STRIDED_ROW_MAX = 256  # longest row a ROW kernel reads across an NHWC buffer's pixels (channel_rows)


def nhwc_strides(shape: Sequence) -> tuple:
    """Element strides of an NHWC buffer of logical shape ``(N, C, H, W)``."""
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _candidate(b: Node) -> bool:
    return b.rank == 4 and all(isinstance(d, int) for d in b.shape[1:]) and b.dtype.is_float


def _library(kind: KernelKind, node: Node) -> bool:
    """A conv, or a pool: the library kernels that take NHWC operands."""
    return kind is KernelKind.CONV or (kind is KernelKind.LIBRARY and node.op is Op.POOL)


def _direct_library_read(kind: KernelKind, u: Node, b: Node, epilogue) -> bool:
    """``u`` (of a conv or pool group) reads ``b`` as the library's activation or residual operand (a conv
    also through a view reordering ``b``'s channels: the replayed run gathers them, NHWC to NHWC)."""
    if kind is KernelKind.CONV:
        x = u.src[0]
        activation = u is epilogue.conv and (x is b or channel_map(x, b) is not None)
        return activation or (u is not epilogue.conv and epilogue.residual is b)
    return u.op is Op.POOL and u.src[0] is b


def channel_map(view: Node, b: Node) -> tuple[int, ...] | None:
    """When ``view`` is a chain of layout ops over the 4-D buffer ``b`` (static sizes) whose result is ``b``
    with its channels reordered or selected, the channel of ``b`` each of its channels reads; else None.
    ShuffleNet's channel shuffle (reshape to groups, transpose, reshape back) is one: read NHWC, it is a
    gather within each pixel's channels, though no strides express it.

    Example:
        >>> shuffled = g.view(g.transpose(g.view(x, (1, 2, 3, 5, 5)), 1, 2), (1, 6, 5, 5))  # doctest: +SKIP
        >>> channel_map(shuffled, x)  # x: (1, 6, 5, 5)  # doctest: +SKIP
        (0, 3, 1, 4, 2, 5)
    """
    sizes = (*view.shape, *b.shape)
    if view is b or view.rank != 4 or b.rank != 4 or not all(isinstance(d, int) for d in sizes):
        return None
    if view.shape[0] != b.shape[0] or view.shape[2:] != b.shape[2:]:
        return None
    chain, n = [], view
    while n is not b:
        if n.op not in LAYOUT or len(n.src) != 1:
            return None
        chain.append(n)
        n = n.src[0]
    index = torch.arange(numel(b.shape)).view(b.shape)
    t = index
    for n in reversed(chain):
        t = EVAL[n.op](n, [t], {})
    channels = t[0, :, 0, 0] // (b.shape[2] * b.shape[3])
    return tuple(channels.tolist()) if torch.equal(t, index[:, channels]) else None


def channels_last_buffers(
    buffers: Iterable[Node],
    users: Mapping[Node, Sequence[Node]],
    group_of: Callable[[Node], object],
    outputs: set[Node],
) -> frozenset[Node]:
    """The buffers to lay out NHWC (see the module docstring). ``group_of(node)`` is the partition group
    (``kind``, ``epilogue``) computing ``node``."""
    out = set()
    for b in buffers:
        if b in outputs or not _candidate(b):
            continue
        wg = group_of(b)
        library = _library(wg.kind, b)
        if not library and wg.kind not in (*GENERATED, KernelKind.MATMUL):
            continue
        feeds_library, ok = False, True
        for u in users.get(b, ()):
            g = group_of(u)
            if u.op is Op.MATMUL:  # matmul operands are loaded row-major (decided here, not when lowered)
                ok = False
            elif g is wg and not library:
                continue
            elif _library(g.kind, u):
                direct = _direct_library_read(g.kind, u, b, g.epilogue)
                feeds_library |= direct
                ok &= direct
            else:  # a generated kernel, or a matmul kernel's epilogue
                ok &= g.kind in GENERATED or g.kind is KernelKind.MATMUL
        if ok and (library or feeds_library or _nhwc_product(wg, b)):
            out.add(b)
    return frozenset(out)


def _nhwc_product(group, b: Node) -> bool:
    """Whether ``b`` is written by a matmul group computing it over (N, H, W, C): a linear layer over NHWC
    activations (ConvNeXt). Laid out NHWC, the store is row major, so oneDNN writes the output itself."""
    if group.kind is not KernelKind.MATMUL:
        return False
    n, c, h, w = b.shape
    return any(m.op is Op.MATMUL and tuple(m.shape) == (n, h, w, c) != tuple(b.shape) for m in group.sel)


def channels_inner(k: Kernel, nhwc: frozenset[Node]) -> Kernel:
    """A pointwise kernel storing an NHWC buffer, with its domain reordered so that the store is
    contiguous along the innermost axis (the generated loop runs over channels; an elementwise kernel over
    NHWC operands becomes one flat loop); masks and concats follow their axes, and a gather's index is a
    body value whatever the loop order (a nearest upsample concatenated with a pool, 96 x 57 x 57 NHWC, ran
    0.82 ms with pixels inner, 0.07 with channels). Other kernels are returned as they are."""
    if not isinstance(k, PointwiseKernel):
        return k
    store = next((s for s in k.stores if s.buffer in nhwc), None)
    if store is None:
        return k
    if not all(isinstance(s, int) for s in store.strides):
        return k
    # size-1 axes (stride 0 in every access) go outermost, where they cost no loop
    perm = sorted(range(len(k.domain)), key=lambda d: (k.domain[d] != 1, -store.strides[d]))
    if perm == list(range(len(k.domain))):
        return k

    def permuted(strides: tuple) -> tuple:
        return tuple(strides[d] for d in perm)

    body = tuple(_moved(e, perm.index, permuted) for e in k.body)
    stores = tuple(replace(s, strides=permuted(s.strides)) for s in k.stores)
    return replace(k, domain=permuted(k.domain), body=body, stores=stores)


def _moved(e: Load | Compute, axis, permuted) -> Load | Compute:
    """A body entry with its domain axes renamed by ``axis`` (old -> new index): a load's strides and mask
    axes, a concat's axis. (A concat of NHWC values along the channels then tests the innermost index,
    which the generated loop splits at the static bounds: DenseNet's BN-ReLU over the concat of a block's
    features ran 8.5 ms of 23 with the channel axis outer and pixels strided inner, at 1 thread.)"""
    if isinstance(e, Load):
        mask = tuple((axis(a), lo, hi) for a, lo, hi in e.mask)
        return replace(e, strides=permuted(e.strides), mask=mask)
    if e.op is Op.CONCAT:
        return replace(e, arg=replace(e.arg, axis=axis(e.arg.axis)))
    return e


def channel_rows(k: Kernel, nhwc: frozenset[Node]) -> Kernel | Rejection:
    """A ROW kernel whose rows run along an NHWC buffer's channels (a layernorm over channels): as it is.
    One whose rows run across an NHWC buffer's pixels (a mean over H and W) reads each row with a stride
    of C: fine for short rows (up to :data:`STRIDED_ROW_MAX`: a mean over 240 x 14 x 14 takes 15 us, a
    torch call costs about as much in Python), measured 5-15x slower than a dense row beyond (a mean over
    32 x 112 x 112: 367 us against 25 us). There a lone sum or mean of the buffer becomes a LIBRARY kernel
    (torch reduces NHWC along the channels, 26 us), and anything else returns a
    :class:`~kernelize.autokernel.reasons.Rejection` asking to keep the buffer dense. A lone sum or mean is
    a LIBRARY kernel also over a short row whose loads evict each other from L1 (:func:`_aliasing`)."""
    if not isinstance(k, RowKernel) or not set(k.reads) & nhwc:
        return k
    row = numel(k.domain[len(k.domain) - k.row_rank :])
    short = isinstance(row, int) and row <= STRIDED_ROW_MAX
    last = len(k.domain) - 1
    for e in k.body:
        if isinstance(e, Load) and e.buffer in nhwc and k.domain[last] != 1 and e.strides[last] not in (0, 1):
            node = k.computes[0] if len(k.computes) == 1 else None
            lone = node is not None and node.op in (Op.SUM, Op.MEAN) and node.src[0] is e.buffer
            if lone and (not short or _aliasing(e.buffer, row)):
                return LibraryKernel("", node.shape, node=node, inputs=(e.buffer,), computes=(node,))
            if not short:
                return Rejection.dense(e.buffer, "a row kernel would read it across channels")
    return k


def _aliasing(b: Node, row: int) -> bool:
    """Whether a row of ``row`` pixels across NHWC ``b`` evicts its own lines from L1 (32-48 KiB, 64 sets
    of 64-byte lines, 8-12 ways): a step of ``s`` bytes visits only 4096 / gcd(s, 4096) sets, and a row
    needing more than 8 lines per set misses on every load, again for each channel that shares the lines.
    ResNet-50's final mean over 2048 x 7 x 7 (8 KiB steps, one set) took 300 us as a row kernel, 16 us
    in torch; MobileNetV2's over 1280 x 7 x 7 (5 KiB steps, 4 sets) 84-148 us."""
    step = b.shape[1] * b.dtype.itemsize if isinstance(b.shape[1], int) else 0
    sets = min(64, 4096 // math.gcd(step, 4096)) if step else 64
    return row > 8 * sets


__all__ = ["channel_rows", "channels_inner", "channels_last_buffers", "nhwc_strides"]
