"""Canonicalize a graph for fusion: sink reshapes below elementwise ops, unflatten matmul batches.

Front ends flatten batch dims around a matmul (``x.view(B*S, D) @ W.T`` then ``.view(B, S, N)``), so the
matmul's elementwise epilogue (bias, activation) reads the matmul result through a view that splits an
axis: no single loop nest covers both with plain strides. Rewriting ``f(view(mm), b)`` as
``view(f(mm, view(b)))`` moves the epilogue into the matmul's index space, where it fuses; the reshape is
then only a view of the result (free).

The rewrite applies when an operand is a reshape of a computed value (not an input: reshaping inputs is
free anyway), and every other operand reads through the reshape with plain strides (a bias broadcast over
the last axis, a contiguous residual).

Row ops over the last axis (norms, softmax) follow their operand's reshape the same way when it keeps
that axis, so a residual add sunk into a matmul's index space still fuses into the norm after it.

A pad of a computed value becomes a concat with constant blocks, so the value is computed where it is
padded (a pad reads its operand with masked loads, which needs a buffer).

A float sum (or mean) over at most :data:`SMALL_SUM` elements of static non-last axes (rotary's cos / sin
gradient summed over the heads), where no max / min reduction runs over the same axes (those share a ROW
kernel), becomes adds of slices: they fuse like any elementwise op into the kernel
computing the terms, where a reduction over a strided axis would need the terms stored and a kernel of
its own.

A batched matmul whose operands are both reshapes merging the same batch dims (``q.view(B*H, S, D)``)
runs over the unmerged batch instead: merged dims of a transposed or sliced operand have no single
stride, the unmerged ones do.

Example (before / after)::

    %5 = matmul(%3, %4) : f32[10, 8]           %5 = matmul(%3, %4) : f32[10, 8]
    %9 = view(%5) : f32[2, 5, 8]               %9 = gelu(%5) : f32[10, 8]
    %10 = gelu(%9) : f32[2, 5, 8]              %10 = view(%9) : f32[2, 5, 8]
"""

from __future__ import annotations

from kernelize.autokernel.indexing import Affine, NotAffine
from kernelize.autokernel.partition import base
from kernelize.ir.dtypes import compute_dtype
from kernelize.ir.graph import ELEMENTWISE, LAYOUT, REDUCE, SOURCE, Graph, Node, Op
from kernelize.ir.shapes import numel


def _strided(o: Node, shape: tuple) -> bool:
    """Whether reading ``o`` reshaped to ``shape`` is a plain strided read of ``o``'s base."""
    m = Affine.identity(shape)
    v = Node(Op.VIEW, o.dtype, shape, (o,))
    try:
        while v.op in LAYOUT:
            m = m.through(v)
            v = v.src[0]
        m.flat(v.shape, v)
    except (NotAffine, NotImplementedError):
        return False
    return True


def sink_views(graph: Graph) -> Graph:
    """An equivalent graph (same inputs and outputs) with reshapes sunk below elementwise epilogues;
    ``graph`` itself when nothing applies."""
    out = Graph()
    new: dict[Node, Node] = {}
    changed = False
    # (operand shape, axes) of reductions that will be ROW kernels: sums over the same axes join them there
    rows = {(n.src[0].shape, n.arg) for n in graph.nodes if n.op in REDUCE and n.op not in (Op.SUM, Op.MEAN)}
    for n in graph.nodes:
        if n.op is Op.INPUT:
            new[n] = out.input(n.arg, n.shape, n.dtype)
            continue
        src = [new[s] for s in n.src]
        if n.op is Op.VIEW:
            new[n] = out.view(src[0], n.shape)  # a view of a view is one view
            continue
        if n.op is Op.PAD and src[0].op not in SOURCE and base(src[0]).op not in SOURCE:
            new[n] = _pad_as_concat(out, src[0], n)
            changed = True
            continue
        if n.op in (Op.SUM, Op.MEAN) and _small_sum(n) and (n.src[0].shape, n.arg) not in rows:
            new[n] = _unrolled_sum(out, src[0], n)
            changed = True
            continue
        mm = _unflattened_matmul(out, src) if n.op is Op.MATMUL else None
        if mm is not None:
            new[n] = out.view(mm, n.shape)
            changed = True
            continue
        row = _row_target(n, src)
        if row is not None:
            arg = row.rank - 1 if n.op in (Op.SOFTMAX, Op.LOG_SOFTMAX) else n.arg
            new[n] = out.view(out.push(n.op, n.dtype, row.shape, [row, *src[1:]], arg), n.shape)
            changed = True
            continue
        target = _target(n, src) if n.op in ELEMENTWISE else None
        if target is None:
            new[n] = out.push(n.op, n.dtype, n.shape, src, n.arg)
            continue
        inner = out.push(n.op, n.dtype, target, [out.view(s, target) for s in src], n.arg)
        new[n] = out.view(inner, n.shape)
        changed = True
    out.output(*(new[o] for o in graph.outputs))
    return out if changed else graph


def _target(n: Node, src: list[Node]) -> tuple | None:
    """The shape to compute ``n`` in, or None to leave it."""
    for s in src:
        if s.op is not Op.VIEW:
            continue
        q = s.src[0]
        if q.op in SOURCE or q.op in LAYOUT:
            continue
        others = [o for o in src if o is not s]
        if all(_strided(o, q.shape) for o in others) and not any(_merges_concat(o, q.shape) for o in others):
            return q.shape
    return None


def _merges_concat(o: Node, shape: tuple) -> bool:
    """Whether reading concat ``o`` at ``shape`` merges its axes: a concat is masked loads selecting on its
    axis, which a merged index no longer is (the planner would write the concat to memory instead)."""
    return o.op is Op.CONCAT and len(shape) < o.rank


def _unflattened_matmul(out: Graph, src: list[Node]) -> Node | None:
    """``matmul(view(A), view(B))`` whose views only merge the same batch dims, as a matmul over the
    unmerged batch (so a transposed or sliced operand needs no copy to merge its batch dims)."""
    a, b = src
    if a.op is not Op.VIEW or b.op is not Op.VIEW:
        return None
    big_a, big_b = a.src[0], b.src[0]
    if (
        big_a.rank < 3
        or big_b.rank < 3
        or big_a.shape[-2:] != a.shape[-2:]
        or big_b.shape[-2:] != b.shape[-2:]
    ):
        return None
    batch = [d for d in big_a.shape[:-2] if d != 1]
    if batch != [d for d in big_b.shape[:-2] if d != 1] or batch == [d for d in a.shape[:-2] if d != 1]:
        return None
    if numel(batch) != numel(a.shape[:-2]) or a.shape[:-2] != b.shape[:-2]:
        return None
    return out.matmul(
        out.view(big_a, (*batch, *big_a.shape[-2:])), out.view(big_b, (*batch, *big_b.shape[-2:]))
    )


def _row_target(n: Node, src: list[Node]) -> Node | None:
    """For a row op over the last axis of a reshape that keeps that axis: the reshaped value."""
    last = n.rank - 1
    if not (n.op in (Op.RMSNORM, Op.LAYERNORM) or (n.op in (Op.SOFTMAX, Op.LOG_SOFTMAX) and n.arg == last)):
        return None
    v = src[0]
    if v.op is not Op.VIEW or v.src[0].op in SOURCE or v.src[0].op in LAYOUT:
        return None
    q = v.src[0]
    return q if q.rank and q.shape[-1] == n.shape[-1] else None


# a sum over at most this many elements of non-last axes is unrolled into adds
SMALL_SUM = 32


def _small_sum(n: Node) -> bool:
    x = n.src[0]
    sizes = [x.shape[a] for a in n.arg]
    return (
        n.dtype.is_float
        and x.rank - 1 not in n.arg
        and all(isinstance(d, int) for d in sizes)
        and 2 <= numel(sizes) <= SMALL_SUM
    )


def _unrolled_sum(out: Graph, x: Node, n: Node) -> Node:
    """``x[.., 0, ..] + x[.., 1, ..] + ...`` accumulated in the compute dtype, rounded once (as the
    reduction is)."""
    parts = [x]
    for a in n.arg:
        parts = [out.slice(p, a, i, i + 1) for p in parts for i in range(x.shape[a])]
    wide = compute_dtype(x.dtype)
    total = out.cast(parts[0], wide)
    for p in parts[1:]:
        total = out.add(total, out.cast(p, wide))
    if n.op is Op.MEAN:
        total = out.mul(total, 1.0 / len(parts))
    return out.cast(total, n.dtype)


def _pad_as_concat(out: Graph, x: Node, n: Node) -> Node:
    """``pad(f(...))`` as concats of constant blocks around ``f(...)``: the padded value is then computed in
    the kernel that pads it (a pad of a buffer stays a masked load with ``other``)."""
    value = n.arg.value
    fill = out.scalar(value, x.dtype) if x.dtype.is_float else out.scalar(int(value), x.dtype)
    for axis, (lo, hi) in enumerate(n.arg.pads):
        parts = []
        for size in (lo, None, hi):
            if size is None:
                parts.append(x)
            elif size:
                parts.append(
                    out.broadcast(fill, tuple(size if a == axis else d for a, d in enumerate(x.shape)))
                )
        x = out.concat(parts, axis) if len(parts) > 1 else x
    return x
