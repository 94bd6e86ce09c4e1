"""Fusion legality: when an intermediate value may stay unmaterialized.

:func:`can_absorb` is the one rule: an intermediate is absorbed into a group (computed there and never
written to memory) only if every user is in the group, or recomputing it in each outside user is cheaper
than the round trip to memory (one write plus one read per reader). Recomputation is for cheap trees only:
elementwise ops (and concat / pad / gather) over materialized values, at most ``max_ops`` of them, never a
reduction or matmul, and reading no more bytes than the round trip would move (a reader of a slice of the
value recomputes, and would load, only that slice). Kyanite recomputes shared
values blindly; a shared ``exp`` of a big product would then run once per reader.

Example:
    >>> g = Graph(); x = g.input("x", (8, 64), "f32"); y = g.mul(x, 2.0)
    >>> s, e = g.reduce(Op.SUM, y, 1), g.exp(y)
    >>> can_absorb(y, {y, s}, {y: [s, e]})  # exp recomputes x*2: one read instead of a write and a read
    True
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from kernelize.autokernel.partition import POINTWISE_OPS, base
from kernelize.ir.graph import LAYOUT, SOURCE, Node
from kernelize.ir.shapes import Dim, Sym

# symbolic sizes count as this many elements per symbol when weighing bytes
NOMINAL_SYMBOL = 256


def _count(d: Dim) -> int:
    return d.coef * NOMINAL_SYMBOL ** len(d.names) if isinstance(d, Sym) else d


def nbytes(node: Node) -> int:
    """Bytes of ``node``'s value (symbols at :data:`NOMINAL_SYMBOL`)."""
    n = 1
    for d in node.shape:
        n *= _count(d)
    return n * node.dtype.itemsize


def read_bytes(v: Node, stop: Collection[Node] = ()) -> int:
    """Bytes a reader of ``v`` moves: the smallest value along its layout chain (a broadcast bias is
    read once, a slice reads only its part)."""
    out = nbytes(v)
    while v.op in LAYOUT and v not in stop:
        v = v.src[0]
        out = min(out, nbytes(v))
    return out


def recompute_cost(
    node: Node,
    is_buffer: Callable[[Node], bool],
    stop: Collection[Node] = (),
    max_ops: int = 8,
) -> tuple[int, int] | None:
    """``(ops, bytes read)`` to recompute ``node`` from materialized values, or None when it is not cheap
    (a reduction, matmul or library op inside, or more than ``max_ops`` ops)."""
    ops: set[Node] = set()
    leaves: dict[Node, int] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in ops:
            continue
        if n.op not in POINTWISE_OPS:
            return None
        ops.add(n)
        if len(ops) > max_ops:
            return None
        for s in n.src:
            q = base(s, stop)
            if q.op in SOURCE or is_buffer(q):
                leaves[s] = max(leaves.get(s, 0), read_bytes(s, stop))
            elif q not in ops:
                stack.append(q)
    return len(ops), sum(leaves.values())


def can_absorb(
    node: Node,
    group: Collection[Node],
    users: Mapping[Node, Sequence[Node]],
    *,
    outputs: Collection[Node] = (),
    is_buffer: Callable[[Node], bool] = lambda n: False,
    stop: Collection[Node] = (),
    max_ops: int = 8,
) -> bool:
    """Whether ``node`` may stay unmaterialized when ``group`` computes it.

    Args:
        node: the intermediate value.
        group: the values computed by the kernel that computes ``node``.
        users: each value's readers (non-layout nodes, through layout chains).
        outputs: graph outputs (always materialized).
        is_buffer: which other values are materialized (the leaves of a recomputation).
        stop: materialized layout values (copies).
        max_ops: the largest tree recomputed in each outside reader.
    """
    if node in outputs:
        return False
    outside = [u for u in dict.fromkeys(users.get(node, ())) if u not in group]
    if not outside:
        return True
    cost = recompute_cost(node, is_buffer, stop, max_ops)
    if cost is None:
        return False
    _, leaf_bytes = cost
    # a reader that reads a part of the value (a slice) recomputes only that part: weigh it by the part
    size = nbytes(node)
    if size == 0:  # an empty value (a zero-length axis): nothing to recompute
        return True
    part = [
        max((read_bytes(s, stop) for s in u.src if base(s, stop) is node), default=size) / size
        for u in outside
    ]
    return sum(part) * leaf_bytes <= (1 + sum(part)) * size
