"""Partition a graph into fusion groups: which graph values each kernel computes, over which domain.

Every computed value starts in a group of its own (``POINTWISE`` for elementwise ops, concat, pad and
gather; ``ROW`` for reductions and row ops; ``MATMUL``; ``LIBRARY`` for conv, pool and library matmul).
Walking consumers in topological order, each operand edge proposes to merge the producer's group into the
consumer's; the merge happens when :func:`merge` finds it legal:

* the kinds combine (elementwise + anything but LIBRARY; ROW + ROW over the same row; never two
  matmuls; a matmul's operands, and concat / pad / gather sources, stay outside its group),
* every member keeps a *selection map* (each coordinate is one domain axis or the constant 0) that agrees
  with every in-group edge, and covers the domain (full values; in a ROW group also per-row values),
* no path leaves one group and comes back into the other (no cycle between kernels).

Layout ops belong to no group: they are index maps (see :mod:`kernelize.autokernel.indexing`).

Selection-map entries: an ``int >= 0`` is a domain axis; ``None`` is the constant 0; a negative ``~a`` is the
constant 0 that came from reducing or broadcasting domain axis ``a`` (its *origin*, which lets a per-row
value broadcast back over the row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kernelize.autokernel.kernels import NODE_KINDS, KernelKind
from kernelize.ir.graph import ELEMENTWISE, LAYOUT, REDUCE, ROW, Graph, Node, Op
from kernelize.ir.shapes import Dim, numel

POINTWISE_OPS = ELEMENTWISE | {Op.CONCAT, Op.PAD, Op.GATHER}
ANCHORS = REDUCE | ROW | {Op.MATMUL}
Sel = tuple[int | None, ...]


@dataclass
class Group:
    """One future kernel: its members (graph values computed inside it) with their selection maps."""

    gid: int
    kind: KernelKind
    domain: tuple[Dim, ...]
    row_rank: int = 0
    sel: dict[Node, Sel] = field(default_factory=dict)  # member -> selection map, in insertion order
    copy: bool = False  # a copy kernel materializing one layout value
    epilogue: Any = None  # CONV: the ConvEpilogue its members form

    @property
    def members(self) -> list[Node]:
        return list(self.sel)

    @property
    def row_axes(self) -> tuple[int, ...]:
        n = len(self.domain)
        return tuple(range(n - self.row_rank, n))


def is_axis(e: int | None) -> bool:
    return e is not None and e >= 0


def origin(e: int | None) -> int | None:
    return ~e if e is not None and e < 0 else None


def same_sel(a: Sel | None, b: Sel | None) -> bool:
    """Equal as index maps (constants compare equal whatever their origin)."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all((x == y) if is_axis(x) or is_axis(y) else True for x, y in zip(a, b))


def base(v: Node, stop: frozenset[Node] | set[Node] = frozenset()) -> Node:
    """The value under a chain of layout ops (stopping at materialized layout values in ``stop``)."""
    while v.op in LAYOUT and v not in stop:
        v = v.src[0]
    return v


def chain(v: Node, stop: frozenset[Node] | set[Node] = frozenset()) -> list[Node]:
    """The layout ops from ``v`` down to :func:`base` (top first)."""
    out = []
    while v.op in LAYOUT and v not in stop:
        out.append(v)
        v = v.src[0]
    return out


def row_axes_of(n: Node) -> tuple[int, ...]:
    """The axes of ``n.src[0]`` a reduction or row op runs along (norms: the last)."""
    if n.op in REDUCE:
        return n.arg
    return (n.arg,) if n.op in (Op.SOFTMAX, Op.LOG_SOFTMAX) else (n.src[0].rank - 1,)


# -- selection maps through ops ---------------------------------------------------------------------------
def _squeeze_pairs(a: Sequence[Dim], b: Sequence[Dim]) -> list[tuple[int, int]] | None:
    """For a view that only adds / removes size-1 dims: pairs (i in a, j in b) of the other dims."""
    ia = [i for i, d in enumerate(a) if d != 1]
    ib = [j for j, d in enumerate(b) if d != 1]
    if [a[i] for i in ia] != [b[j] for j in ib]:
        return None
    return list(zip(ia, ib))


def sel_down(node: Node, sel: Sel) -> Sel | None:
    """Selection map of ``node.src[0]`` when layout ``node`` is read at ``sel`` (None: not a selection)."""
    src = node.src[0]
    if node.op is Op.PERMUTE:
        out: list = [None] * len(sel)
        for j, p in enumerate(node.arg):
            out[p] = sel[j]
        return tuple(out)
    if node.op is Op.BROADCAST:
        return tuple(
            (~e if is_axis(e) else e) if s == 1 and d != 1 else e
            for e, s, d in zip(sel, src.shape, node.shape)
        )
    if node.op is Op.VIEW:
        return _view_sel(node.shape, src.shape, sel)
    return None  # slice, flip: offsets and negative strides are no selection


def sel_up(node: Node, sel: Sel, domain: Sequence[Dim]) -> Sel | None:
    """Selection map of layout ``node`` given its operand's (None: not a selection)."""
    src = node.src[0]
    if node.op is Op.PERMUTE:
        return tuple(sel[p] for p in node.arg)
    if node.op is Op.BROADCAST:
        out = []
        for e, s, d in zip(sel, src.shape, node.shape):
            if s == 1 and d != 1:
                o = origin(e)
                if o is None or domain[o] != d:
                    return None
                e = o
            out.append(e)
        return tuple(out)
    if node.op is Op.VIEW:
        return _view_sel(src.shape, node.shape, sel)
    return None


def _view_sel(from_shape: Sequence[Dim], to_shape: Sequence[Dim], sel: Sel) -> Sel | None:
    """A selection at ``from_shape`` carried through a view that only adds or drops size-1 axes."""
    pairs = _squeeze_pairs(from_shape, to_shape)
    if pairs is None:
        return None
    out: list = [None] * len(to_shape)
    for i, j in pairs:
        out[j] = sel[i]
    return tuple(out)


def operand_sel(n: Node, i: int, sel: Sel) -> Sel | None:
    """Selection map at which ``n`` (read at ``sel``) reads ``n.src[i]``; None when not a selection."""
    if n.op in ELEMENTWISE or n.op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
        return sel
    if n.op in LAYOUT:  # a materialized layout value (copy) reads its operand through itself
        return sel_down(n, sel)
    if n.op in (Op.LAYERNORM, Op.RMSNORM):
        return sel if i == 0 else (sel[-1],)
    if n.op in REDUCE:
        out = []
        for k, e in enumerate(sel):
            if k in n.arg and n.src[0].shape[k] != 1:
                e = origin(e)
                if e is None:
                    return None
            out.append(e)
        return tuple(out)
    if n.op is Op.GATHER and i == 1:
        return tuple(sel[n.arg : n.arg + n.src[1].rank])
    return None  # concat / pad / gather sources, matmul and library operands are read elsewhere


def result_sel(n: Node, i: int, osel: Sel) -> Sel | None:
    """Selection map of ``n`` derived from its operand ``i`` at ``osel`` (the inverse of operand_sel)."""
    if n.op in ELEMENTWISE or (i == 0 and n.op in ROW):
        return osel
    if n.op in REDUCE:
        return tuple(
            (~e if is_axis(e) else e) if k in n.arg and n.src[0].shape[k] != 1 else e
            for k, e in enumerate(osel)
        )
    return None


def through_down(v: Node, sel: Sel | None, stop: set[Node]) -> Sel | None:
    for lay in chain(v, stop):
        if sel is None:
            return None
        sel = sel_down(lay, sel)
    return sel


def through_up(v: Node, sel: Sel | None, domain: Sequence[Dim], stop: set[Node]) -> Sel | None:
    for lay in reversed(chain(v, stop)):
        if sel is None:
            return None
        sel = sel_up(lay, sel, domain)
    return sel


# -- group checks -----------------------------------------------------------------------------------------
def column_member(g: Group, n: Node, sel: Sel) -> bool:
    """Whether member ``n`` of a ROW group is a column sum: a sum / mean over axes of the domain outside the
    row, whose result varies along the row (each thread adds up the rows it owns, then one reduce over
    threads). Nothing in the kernel may read it: it is complete only after every row."""
    if g.kind is not KernelKind.ROW or n.op not in (Op.SUM, Op.MEAN):
        return False
    osel = operand_sel(n, 0, sel)
    if osel is None:
        return False
    reduced = {osel[k] for k in n.arg if is_axis(osel[k])}
    return bool(reduced) and not (reduced & set(g.row_axes))


def _column_ok(g: Group, n: Node, sel: Sel) -> bool:
    """A column sum reduces every outer axis and keeps exactly the row (the per-thread partials are rows)."""
    osel = operand_sel(n, 0, sel)
    rows = {a for a in g.row_axes if g.domain[a] != 1}
    outer = {a for a, d in enumerate(g.domain) if d != 1} - rows
    reduced = {osel[k] for k in n.arg if is_axis(osel[k]) and g.domain[osel[k]] != 1}
    kept = {e for k, e in enumerate(osel) if k not in n.arg and is_axis(e)}
    return reduced == outer and {a for a in kept if g.domain[a] != 1} == rows


def member_ok(g: Group, n: Node, sel: Sel, columns: bool = False) -> bool:
    """The member computes every element of ``n`` once per domain point it covers, as the kind allows;
    ``columns``: a ROW group may also hold column sums over its rows (:func:`column_member`)."""
    if columns and column_member(g, n, sel):
        return n.dtype.is_float and _column_ok(g, n, sel)
    if len(sel) != n.rank:
        return False
    axes = [e for e in sel if is_axis(e)]
    if len(set(axes)) != len(axes):
        return False
    for e, d in zip(sel, n.shape):
        if is_axis(e) and g.domain[e] != d:
            return False
        if not is_axis(e) and d != 1:
            return False
    need = {a for a, d in enumerate(g.domain) if d != 1}
    used = set(axes)
    if g.kind is not KernelKind.ROW:
        ok = need <= used
    else:
        rows = set(g.row_axes) & need
        ok = (need - rows) <= used and (rows <= used or not (rows & used))
    if not ok:
        return False
    if n.op in ANCHORS:
        return _anchor_ok(g, n, sel)
    return True


def _anchor_ok(g: Group, n: Node, sel: Sel) -> bool:
    if n.op is Op.MATMUL:
        return g.kind is KernelKind.MATMUL and all(e == k for k, e in enumerate(sel))
    if g.kind is not KernelKind.ROW:
        return False
    osel = operand_sel(n, 0, sel)
    if osel is None:
        return False
    rows = {a for a in g.row_axes if g.domain[a] != 1}
    axes = row_axes_of(n)
    reduced = {osel[k] for k in axes if is_axis(osel[k])}
    kept = {e for k, e in enumerate(osel) if k not in axes and is_axis(e)}
    if n.op in ROW and g.row_rank != 1:
        return False
    return reduced == rows and not (kept & rows)


@dataclass(frozen=True)
class Ctx:
    """What the partition needs to know besides the groups."""

    graph: Graph
    users: dict[Node, list[Node]]  # non-layout consumers through layout chains
    stop: set[Node]  # materialized layout values (copy kernels)
    merge_matmuls: bool = False  # matmuls reading the same left operand may share a kernel
    columns: bool = False  # ROW groups may hold column sums over their rows (PlanSettings.column_reduce)
    recompute_ops: int = 0  # the largest pointwise tree readers may recompute (0: recomputation is off)


def edges_ok(g: Group, members: Sequence[Node], ctx: Ctx) -> bool:
    """Every in-group edge touching ``members`` agrees with the selection maps."""
    for n in members:
        sn = g.sel[n]
        for i, s in enumerate(n.src):
            q = base(s, ctx.stop)
            if q in g.sel and not same_sel(through_down(s, operand_sel(n, i, sn), ctx.stop), g.sel[q]):
                return False
            if q in g.sel and ctx.columns and column_member(g, q, g.sel[q]):
                return False  # a column sum is complete only after the kernel
        for u in ctx.users.get(n, ()):
            if u in g.sel and u not in members:
                if ctx.columns and column_member(g, n, sn):
                    return False
                su = g.sel[u]
                for i, s in enumerate(u.src):
                    if base(s, ctx.stop) is n and not same_sel(
                        through_down(s, operand_sel(u, i, su), ctx.stop), sn
                    ):
                        return False
    return True


def _remap(sel: Sel, phi: Sequence[int | None]) -> Sel:
    """Rename domain axes (and origins) by ``phi``: an axis maps to an axis, a constant with origin
    (``~a``) or a plain constant (None)."""
    out: list[int | None] = []
    for e in sel:
        if is_axis(e):
            out.append(phi[e])
        elif origin(e) is not None:
            a = phi[origin(e)]
            out.append(~a if is_axis(a) else a)
        else:
            out.append(None)
    return tuple(out)


def _set(m: dict[int, int | None], key: int, value: int | None) -> bool:
    """Record ``key -> value`` unless it contradicts an earlier axis; a constant never overrides."""
    old = m.get(key)
    if is_axis(old) and is_axis(value) and old != value:
        return False
    if not is_axis(old) and (old is None or is_axis(value)):
        m[key] = value
    return True


def merge(g1: Group, g2: Group, p: Node, n: Node, i: int, ctx: Ctx) -> Group | None:
    """The group of ``g1`` (holding producer ``p``) and ``g2`` (holding consumer ``n``, reading it as operand
    ``i``), or None when they cannot form one kernel. Cycles are the caller's business."""
    if g1.kind in NODE_KINDS or g2.kind in NODE_KINDS:
        return None
    if g1.kind is KernelKind.MATMUL and g2.kind is KernelKind.MATMUL:
        return _merge_matmuls(g1, g2, p, n, i, ctx) if ctx.merge_matmuls else None
    if KernelKind.MATMUL in (g1.kind, g2.kind) and KernelKind.ROW in (g1.kind, g2.kind):
        return None
    want = through_down(n.src[i], operand_sel(n, i, g2.sel[n]), ctx.stop)
    have = g1.sel[p]
    if want is None or len(want) != len(have):
        return None
    maps = _edge_maps(g1, g2, have, want)
    if maps is None:
        return None
    oriented = _orient(g1, g2, *maps)
    return None if oriented is None else _combine(*oriented, ctx)


def _edge_maps(g1: Group, g2: Group, have: Sel, want: Sel) -> tuple[dict, dict] | None:
    """From the edge's selections: sigma, the axes of g1 -> axes of g2 (None or ~origin: a size-1 axis read
    at 0), and extra, the size-1 axes of g2 that stand for a reduced / broadcast axis of g1."""
    sigma: dict[int, int | None] = {}
    extra: dict[int, int] = {}
    for a, b in zip(have, want):
        if is_axis(a):
            if not is_axis(b) and g1.domain[a] != 1:
                return None
            if not _set(sigma, a, b if is_axis(b) or origin(b) is not None else None):
                return None
        elif origin(a) is not None:
            if origin(b) is not None:
                if not _set(sigma, origin(a), origin(b)):
                    return None
            elif is_axis(b) and g2.domain[b] == 1:
                extra[b] = a
    return sigma, extra


_KIND_RANK = {KernelKind.MATMUL: 2, KernelKind.ROW: 1, KernelKind.POINTWISE: 0}


def _orient(g1: Group, g2: Group, sigma: dict, extra: dict) -> tuple[Group, Group, list] | None:
    """``(k, o, phi)``: the group whose domain the merged kernel keeps, the other, and phi, the other's axes
    in k's axes; None when neither domain covers the other."""
    big1 = [a for a, d in enumerate(g1.domain) if d != 1 and a not in sigma]
    image = {b for b in sigma.values() if is_axis(b)}
    big2 = [b for b, d in enumerate(g2.domain) if d != 1 and b not in image]
    if big1 and big2:
        return None
    if any(is_axis(b) and g1.domain[a] != g2.domain[b] for a, b in sigma.items()):
        return None
    if big1 or big2:
        keep_first = bool(big1)
    elif _KIND_RANK[g1.kind] != _KIND_RANK[g2.kind]:
        keep_first = _KIND_RANK[g1.kind] > _KIND_RANK[g2.kind]
    else:
        keep_first = len(g1.sel) > len(g2.sel)
    if (g1 if not keep_first else g2).kind is KernelKind.MATMUL:
        return None  # a matmul's domain is (*batch, M, N) and stays so
    if not keep_first:
        return g2, g1, [sigma.get(a) for a in range(len(g1.domain))]
    inv: dict[int, int | None] = dict(extra)
    inv.update({b: a for a, b in sigma.items() if is_axis(b)})
    phi = [inv.get(b) for b in range(len(g2.domain))]
    if any(not is_axis(ph) and d != 1 for ph, d in zip(phi, g2.domain)):
        return None
    return g1, g2, phi


def _combine(k: Group, o: Group, phi: list, ctx: Ctx) -> Group | None:
    """The merged group over k's domain (row axes moved last), if every member and edge stays legal."""
    rows_k = list(k.row_axes) if k.kind is KernelKind.ROW else []
    rows_o = [phi[a] for a in o.row_axes if is_axis(phi[a])] if o.kind is KernelKind.ROW else []
    if k.kind is KernelKind.ROW and o.kind is KernelKind.ROW:
        if {a for a in rows_k if k.domain[a] != 1} != {a for a in rows_o if k.domain[a] != 1}:
            return None
    kind = next((kk for kk in (KernelKind.MATMUL, KernelKind.ROW) if kk in (k.kind, o.kind)), k.kind)
    rows = rows_k if k.kind is KernelKind.ROW else rows_o
    order = [a for a in range(len(k.domain)) if a not in rows] + list(rows)
    pi = [0] * len(k.domain)
    for new, old in enumerate(order):
        pi[old] = new
    domain = tuple(k.domain[a] for a in order)
    g = Group(k.gid, kind, domain, len(rows) if kind is KernelKind.ROW else 0)
    moved_k = order != list(range(len(k.domain))) or kind is not k.kind
    for m, s in k.sel.items():
        g.sel[m] = _remap(s, pi) if moved_k else s
    phio = [pi[a] if is_axis(a) else ~pi[origin(a)] if origin(a) is not None else None for a in phi]
    for m, s in o.sel.items():
        g.sel[m] = _remap(s, phio)
    check = list(g.sel) if moved_k else list(o.sel)
    if not all(member_ok(g, m, g.sel[m], ctx.columns) for m in check):
        return None
    return g if edges_ok(g, check, ctx) else None


def _matmul_of(g: Group) -> Node:
    return next(m for m in g.sel if m.op is Op.MATMUL)


def _merge_matmuls(g1: Group, g2: Group, p: Node, n: Node, i: int, ctx: Ctx) -> Group | None:
    """Two matmul groups over the same domain whose matmuls read the same left operand ``x`` (``act(x @ Wg)
    * (x @ Wu)``): one kernel computing both, so a few-row kernel reads ``x`` once per pass over the
    weights. The edge must read the producer at the consumer's own index (no transposed epilogue)."""
    if g1.domain != g2.domain or _matmul_of(g1).src[0] is not _matmul_of(g2).src[0]:
        return None
    want = through_down(n.src[i], operand_sel(n, i, g2.sel[n]), ctx.stop)
    if want is None or not same_sel(want, g1.sel[p]):
        return None
    g = Group(g1.gid, KernelKind.MATMUL, g1.domain)
    g.sel.update(g1.sel)
    g.sel.update(g2.sel)
    if not all(member_ok(g, m, g.sel[m]) for m in g.sel) or not edges_ok(g, list(g.sel), ctx):
        return None
    return g


def new_group(gid: int, n: Node, kind: KernelKind, columns: bool = False) -> Group:
    """A group holding just ``n``; reductions and row ops put their row last, except that with ``columns``
    a sum over leading axes (:func:`is_leading_sum`) keeps its operand's order: its row is what it keeps."""
    if kind is KernelKind.ROW and columns and is_leading_sum(n):
        x = n.src[0]
        g = Group(gid, kind, x.shape, x.rank - len(n.arg))
        g.sel[n] = result_sel(n, 0, tuple(range(x.rank)))
        return g
    if kind is not KernelKind.ROW:
        g = Group(gid, kind, n.shape)
        g.sel[n] = tuple(range(n.rank))
        return g
    x = n.src[0]
    axes = row_axes_of(n)
    order = [k for k in range(x.rank) if k not in axes] + list(axes)
    pos = {k: j for j, k in enumerate(order)}
    g = Group(gid, kind, tuple(x.shape[k] for k in order), len(axes))
    osel = tuple(pos[k] for k in range(x.rank))
    g.sel[n] = result_sel(n, 0, osel)
    return g


def is_column_reduction(n: Node) -> bool:
    """A sum or mean over leading axes only (the contiguous last axis kept): weight gradients' column sums."""
    return n.op in (Op.SUM, Op.MEAN) and n.src[0].rank >= 2 and n.src[0].rank - 1 not in n.arg


# the longest static row whose column sums a row kernel accumulates: each thread keeps a float and a double
# partial per column (12 bytes), which must stay in its L2 next to the rows; longer rows go to torch
ACCUMULATE_MAX_COLUMNS = 16384


def is_leading_sum(n: Node) -> bool:
    """A float sum or mean over a leading run of axes (``x.sum((0, 1))`` of a rank-3 ``x``) keeping at most
    :data:`ACCUMULATE_MAX_COLUMNS` static elements: a column sum a ROW kernel over ``x``'s own layout can
    accumulate per column."""
    if not (is_column_reduction(n) and n.dtype.is_float and n.arg == tuple(range(len(n.arg)))):
        return False
    kept = numel(n.src[0].shape[len(n.arg) :])
    return isinstance(kept, int) and kept <= ACCUMULATE_MAX_COLUMNS


def kind_of(
    n: Node, library_matmul: bool, library_columns: bool = False, columns: bool = False
) -> KernelKind:
    """The kind of ``n``'s own group; ``library_columns``: column sums go to torch, except that with
    ``columns`` the leading ones (:func:`is_leading_sum`) are ROW groups accumulating per column."""
    if n.op in POINTWISE_OPS or n.op in LAYOUT:
        return KernelKind.POINTWISE
    if columns and is_leading_sum(n):
        return KernelKind.ROW
    if library_columns and n.dtype.is_float and is_column_reduction(n):
        return KernelKind.LIBRARY
    if n.op in REDUCE or n.op in ROW:
        return KernelKind.ROW
    if n.op is Op.ATTENTION:
        return KernelKind.ATTENTION
    if n.op is Op.EXPERTS:
        return KernelKind.EXPERTS
    if n.op is Op.ROUTE:
        return KernelKind.ROUTER
    if n.op is Op.MATMUL and not library_matmul and n.dtype.is_float:
        return KernelKind.MATMUL  # integer matmuls go to the library (generators tile floats)
    return KernelKind.LIBRARY


class Partition:
    """Union of groups with the kernel dependency graph, for cycle checks."""

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.groups: dict[int, Group] = {}
        self.of: dict[Node, int] = {}
        self.parent: dict[int, int] = {}
        # between live groups (roots): direct dependencies, direct dependents, and all ancestors as a bitmask
        self.deps: dict[int, set[int]] = {}
        self.kids: dict[int, set[int]] = {}
        self.anc: dict[int, int] = {}

    def find(self, gid: int) -> int:
        root = gid
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[gid] != root:
            self.parent[gid], gid = root, self.parent[gid]
        return root

    def group(self, n: Node) -> Group:
        return self.groups[self.find(self.of[n])]

    def add(self, g: Group, reads: Sequence[Node]) -> None:
        gid = g.gid
        self.groups[gid] = g
        self.parent[gid] = gid
        for m in g.sel:
            self.of[m] = gid
        deps = {self.find(self.of[r]) for r in reads if r in self.of} - {gid}
        self.deps[gid], self.kids[gid] = deps, set()
        anc = 0
        for d in deps:
            anc |= self.anc[d] | (1 << d)
            self.kids[d].add(gid)
        self.anc[gid] = anc

    def extend(self, gid: int, n: Node, reads: Sequence[Node]) -> None:
        """Add ``n`` to the existing group ``gid`` (a conv epilogue member) with its extra dependencies."""
        gid = self.find(gid)
        g = self.groups[gid]
        g.sel[n] = next(iter(g.sel.values()))
        self.of[n] = gid
        deps = {self.find(self.of[r]) for r in reads if r in self.of} - {gid} - self.deps[gid]
        assert not deps or not self.kids[gid], "a conv epilogue gains dependencies after it has readers"
        for d in deps:
            self.deps[gid].add(d)
            self.anc[gid] |= self.anc[d] | (1 << d)
            self.kids[d].add(gid)

    def _reaches(self, src: int, dst: int, skip_direct: bool) -> bool:
        """Whether group ``dst`` depends on group ``src`` (through another group when ``skip_direct``)."""
        if not skip_direct:
            return bool((self.anc[dst] >> src) & 1)
        return any(d != src and (self.anc[d] >> src) & 1 for d in self.deps[dst])

    def try_merge(self, p: Node, n: Node, i: int) -> bool:
        a, b = self.find(self.of[p]), self.find(self.of[n])
        if a == b:
            return True
        if self._reaches(a, b, True) or self._reaches(b, a, True):
            return False
        g = merge(self.groups[a], self.groups[b], p, n, i, self.ctx)
        if g is None:
            return False
        self._join(a, b, g)
        return True

    def _join(self, a: int, b: int, g: Group) -> None:
        keep, drop = (a, b) if g.gid == a else (b, a)
        self.groups[keep] = g
        del self.groups[drop]
        self.parent[drop] = keep
        deps = (self.deps[a] | self.deps[b]) - {a, b}
        kids = (self.kids[a] | self.kids[b]) - {a, b}
        anc = (self.anc[a] | self.anc[b]) & ~((1 << a) | (1 << b))
        for d in deps:
            self.kids[d].discard(drop)
            self.kids[d].add(keep)
        for k in kids:
            self.deps[k].discard(drop)
            self.deps[k].add(keep)
        self.deps[keep], self.kids[keep], self.anc[keep] = deps, kids, anc
        for table in (self.deps, self.kids, self.anc):
            del table[drop]
        # everything downstream now also depends on the other half's ancestors
        stack, seen = list(kids), set(kids)
        while stack:
            k = stack.pop()
            self.anc[k] = (self.anc[k] & ~(1 << drop)) | anc | (1 << keep)
            for c in self.kids[k]:
                if c not in seen:
                    seen.add(c)
                    stack.append(c)

    def merge_siblings(self, together: Sequence[Sequence[Node]] = ()) -> None:
        """Horizontal fusion: POINTWISE (or ROW, over the same rows) groups over the same domain that read a
        common value and do not depend on each other become one kernel (one launch, the value loaded once).
        A second round looks through reads of POINTWISE values (see :meth:`read_keys`): readers of one
        POINTWISE group, or of cheap pointwise trees over a common value, merge too. The groups of each list
        of values in `together` merge the same way without a common read (the pieces of a concat stored
        into slices of one buffer)."""
        for nodes in together:
            gids = list(dict.fromkeys(self.find(self.of[n]) for n in nodes if n in self.of))
            if all(self.groups[a].kind in (KernelKind.POINTWISE, KernelKind.ROW) for a in gids):
                self._join_all(gids)
        for through in (False, True):
            for gids in self._readers(through).values():
                self._join_all(gids)

    def _readers(self, through: bool) -> dict[Any, list[int]]:
        """Groups per value they read (or, `through`, per :meth:`read_keys` key of the values they read)."""
        readers: dict[Any, list[int]] = {}
        for gid, g in self.groups.items():
            if g.kind not in (KernelKind.POINTWISE, KernelKind.ROW) or g.copy:
                continue
            for m in g.sel:
                for s in m.src:
                    q = base(s, self.ctx.stop)
                    if q in g.sel or q.op is Op.CONST:  # a shared constant is no reason to merge
                        continue
                    for key in self.read_keys(q) if through else (q,):
                        readers.setdefault(key, [])
                        if gid not in readers[key]:
                            readers[key].append(gid)
        return readers

    def read_keys(self, q: Node) -> list[Any]:
        """What reading ``q`` amounts to once readers recompute cheap values: ``[q]``, or for a value of a
        POINTWISE group, that group (its readers may recompute its values from the same inputs) and the
        values its pointwise tree reads when the tree has at most ``ctx.recompute_ops`` ops. A reader of
        ``cast(dy) * x`` and a reader of ``cast(dy) * cos`` both load ``dy``: one kernel loads it once, though
        the cast they recompute lives in a third group they both depend on."""
        if q not in self.of or self.group(q).kind is not KernelKind.POINTWISE:
            return [q]
        keys: list[Any] = [self.find(self.of[q])]
        tree: set[Node] = set()
        stack = [q]
        while stack:
            n = stack.pop()
            if n in tree:
                continue
            g = self.group(n) if n in self.of else None
            if g is None or g.kind is not KernelKind.POINTWISE or g.copy:  # an input or a buffer: loaded
                if n.op is not Op.CONST:
                    keys.append(n)
                continue
            tree.add(n)
            if len(tree) > self.ctx.recompute_ops:  # too big to recompute: readers load a buffer under it
                return keys[:1]
            stack.extend(base(s, self.ctx.stop) for s in n.src)
        return list(dict.fromkeys(keys))

    def _join_all(self, gids: Sequence[int]) -> None:
        for i, a in enumerate(gids):
            for b in gids[i + 1 :]:
                a, b = self.find(a), self.find(b)
                if a == b:
                    continue
                ga, gb = self.groups[a], self.groups[b]
                if ga.domain != gb.domain or ga.kind is not gb.kind or ga.row_rank != gb.row_rank:
                    continue
                if self._reaches(a, b, False) or self._reaches(b, a, False):
                    continue
                g = Group(ga.gid, ga.kind, ga.domain, ga.row_rank, {**ga.sel, **gb.sel})
                self._join(a, b, g)
