"""The fusion planner: ``plan(graph) -> Plan``, the graph cut into kernels in execution order.

Rules (Kyanite's autokernel rules, and better):

1. layout ops (view, broadcast, permute, slice, flip) are strides and offsets of loads and stores, never
   kernels, unless a consumer truly needs a dense copy (a matmul / library operand that is a view of a
   computed value is read through strides; a view no affine map can express gets a copy kernel);
2. any tree of elementwise ops over any number of operands is one kernel (broadcast = stride 0);
   single-valued constants are loads with all strides 0 (``Load.constant``), which generators inline;
3. reductions and row ops (softmax, log-softmax, layernorm, rmsnorm) absorb their elementwise prologue and
   epilogue (a residual add before, weight / activation / cast after, the residual sum as a second
   output), as do several reductions over the same row (an unrecognised layernorm's mean and variance);
4. a matmul absorbs its elementwise epilogue (bias, activation, residual add, scale);
5. concat and pad are masked loads, gather an indirect load, each fused like any elementwise op;
6. an attention op is one fused ATTENTION kernel of its own reading its operands through strides
   (transposes and broadcasts of q, k, v and the mask are not copied);
7. conv, pool (and matmul under ``PlanSettings(matmul="library")``) are LIBRARY kernels run by the
   runtime with torch; their elementwise neighbours fuse into the generated kernels around them.

A value is written to memory iff it is a graph output (or the value under an output's layout view), an
operand of a matmul / library op / pad, or read by another kernel and not cheap to recompute there
(:func:`kernelize.autokernel.legality.can_absorb`), or if lowering asked for it: a group whose loads no
strides can express returns a :class:`~kernelize.autokernel.reasons.Rejection` (write this value, keep
that buffer dense) instead of a kernel, and the planner plans again with the change, keeping the reason in
``Plan.reasons``.

Example:
    >>> g = Graph(); x = g.input("x", ("tokens", 64), "f32"); r = g.input("r", ("tokens", 64), "f32")
    >>> w = g.input("w", (64,), "f32"); h = g.add(x, r); g.output(h, g.rmsnorm(h, w))
    >>> p = plan(g); len(p.kernels), [len(k.stores) for k in p.kernels]
    (1, [2])
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kernelize.autokernel.body import BodyBuilder
from kernelize.autokernel.canon import sink_views
from kernelize.autokernel.conv import conv_chains, conv_epilogue
from kernelize.autokernel.kernels import (
    NODE_KERNELS,
    NODE_KINDS,
    ConvKernel,
    Kernel,
    KernelKind,
    RouterKernel,
)
from kernelize.autokernel.layout import channel_rows, channels_inner, channels_last_buffers
from kernelize.autokernel.legality import can_absorb
from kernelize.autokernel.partition import (
    POINTWISE_OPS,
    Ctx,
    Group,
    Partition,
    base,
    kind_of,
    new_group,
)
from kernelize.autokernel.reasons import Rejection
from kernelize.ir.graph import LAYOUT, REDUCE, ROW, SOURCE, Graph, Node, Op
from kernelize.ir.shapes import shape_str
from kernelize.passes.dce import live_nodes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanSettings:
    """Switches of the planner.

    Attributes:
        matmul: ``"generate"`` (MATMUL kernels with the epilogue fused) or ``"library"`` (torch runs the
            matmul; its epilogue becomes a POINTWISE kernel).
        fuse: False puts every op in a kernel of its own (to test code generators op by op); layout ops
            still fold into loads, and nothing is recomputed.
        fuse_epilogue: matmul kernels absorb elementwise consumers.
        fuse_prologue: reductions and row ops absorb elementwise producers.
        recompute: cheap shared values are recomputed by their readers instead of stored.
        recompute_max_ops: the largest tree a reader recomputes.
        sink_views: compute elementwise ops after a reshaped matmul / reduction in its index space
            (:func:`kernelize.autokernel.canon.sink_views`), so they fuse into it.
        horizontal: POINTWISE (or ROW, same rows) kernels over the same domain that read a common value
            merge (one launch, the value read once), also when they read it through cheap pointwise values
            they recompute (a cast of it, say).
        conv_epilogue: convolutions become CONV kernels that apply their bias, residual add and activation
            inside the library call (:mod:`kernelize.autokernel.conv`); False leaves the conv alone as a
            LIBRARY kernel.
        merge_matmuls: matmuls over the same domain that read the same left operand and meet in an
            elementwise epilogue (``silu(x @ Wg) * (x @ Wu)``) become one MATMUL kernel with several MATMUL
            values (for backends whose matmul kernels compute several accumulators: the CPU's few-row kernel).
        column_reduce: ``"generate"`` (a sum/mean over leading axes is a ROW kernel over the transposed
            domain), ``"library"`` (torch reduces the materialised operand with blocked partial sums) or
            ``"accumulate"`` (a float sum/mean over a leading run of axes is a column sum inside a ROW kernel
            over its operand's own rows: the one computing the operand when they fuse, so the operand is never
            written; each thread adds the rows it owns into per-column partial sums, then one reduce over
            threads; other column sums go to the library).
        channels_last: 4-D buffers between convolutions (and the generated kernels around them) are laid
            out NHWC, the layout of the CPU's oneDNN convolutions (:mod:`kernelize.autokernel.layout`);
            ``Plan.channels_last`` lists them and the runtime must allocate them so.
        conv_chains: an expand (1x1) -> depthwise -> project (1x1) run of CONV kernels (or two of them
            around the depthwise one) becomes one CONV_CHAIN kernel whose intermediates are never stored
            (:func:`kernelize.autokernel.conv.conv_chains`; needs ``channels_last``).
    """

    matmul: Literal["generate", "library"] = "generate"
    fuse: bool = True
    fuse_epilogue: bool = True
    fuse_prologue: bool = True
    recompute: bool = True
    recompute_max_ops: int = 8
    sink_views: bool = True
    horizontal: bool = True
    conv_epilogue: bool = True
    merge_matmuls: bool = False
    column_reduce: Literal["generate", "library", "accumulate"] = "generate"
    channels_last: bool = False
    conv_chains: bool = False

    def __post_init__(self) -> None:
        if self.matmul not in ("generate", "library"):
            raise ValueError(f"PlanSettings.matmul must be 'generate' or 'library', got {self.matmul!r}")
        if self.column_reduce not in ("generate", "library", "accumulate"):
            raise ValueError(
                "PlanSettings.column_reduce must be 'generate', 'library' or 'accumulate', "
                f"got {self.column_reduce!r}"
            )
        if self.recompute_max_ops < 0:
            raise ValueError(f"PlanSettings.recompute_max_ops must be >= 0, got {self.recompute_max_ops}")


@dataclass(frozen=True)
class Plan:
    """Kernels in execution order. Buffers are graph values: inputs and constants come from outside,
    every other buffer is written by exactly one kernel; a graph output is a buffer or a layout view of one.

    ``graph`` is the graph the kernels refer to: the planned graph, or an equivalent canonical form of it
    (:func:`kernelize.autokernel.canon.sink_views`) with the same inputs and outputs. ``reasons`` says why
    values beyond the rules' were written to memory or kept dense: the lowering's requests, in the order
    the planner took them.
    """

    graph: Graph
    kernels: tuple[Kernel, ...]
    settings: PlanSettings = field(default_factory=PlanSettings)
    channels_last: frozenset[Node] = frozenset()  # buffers laid out NHWC (PlanSettings.channels_last)
    reasons: tuple[Rejection, ...] = ()

    @property
    def buffers(self) -> tuple[Node, ...]:
        """Values kernels write, in execution order."""
        return tuple(b for k in self.kernels for b in k.writes)

    def producer(self, node: Node) -> Kernel | None:
        """The kernel writing ``node`` (None for inputs and constants)."""
        for k in self.kernels:
            if node in k.writes:
                return k
        return None

    def name(self, node: Node) -> str:
        """``%i`` as the graph printer names values (``x`` for an input named x)."""
        if node.op is Op.INPUT:
            return str(node.arg)
        return f"%{self.graph.index(node)}" if node in self.graph else repr(node)

    def __str__(self) -> str:
        lines = [f"plan: {len(self.kernels)} kernels for {len(self.graph)} graph values"]
        for k in self.kernels:
            reads = ", ".join(f"{self.name(b)}{shape_str(b.shape)}" for b in k.reads)
            writes = ", ".join(f"{self.name(b)}{shape_str(b.shape)}" for b in k.writes)
            comp = ", ".join(f"{self.name(n)}={n.op}" for n in k.computes)
            lines.append(f"{k.name} [{k.kind}]  reads {reads or '-'}  writes {writes or '-'}")
            lines.append(f"  computes {comp or '-'}")
            lines += ["  " + line for line in str(k).splitlines()]
        for r in self.reasons:
            done = "materialized" if r.kind == "materialize" else "kept dense"
            lines.append(f"{done} {self.name(r.node)}: {r.why}")
        outs = ", ".join(self.name(o) for o in self.graph.outputs)
        lines.append(f"outputs: {outs}")
        return "\n".join(lines)


def plan(graph: Graph, settings: PlanSettings | None = None) -> Plan:
    """Partition ``graph`` into kernels (see the module docstring for the rules).

    Args:
        graph: the graph to plan (not modified; ``Plan.graph`` may be an equivalent canonical copy).
        settings: planner switches; ``PlanSettings()`` by default.

    Raises:
        NotImplementedError: a layout the kernel spec cannot index (a flip of a symbolic dimension).

    Example:
        >>> p = plan(graph, PlanSettings(matmul="library"))  # doctest: +SKIP
        >>> [k.kind for k in p.kernels]  # doctest: +SKIP
        ['library', 'pointwise']
    """
    settings = settings or PlanSettings()
    if settings.sink_views and settings.fuse:
        graph = sink_views(graph)
    forced: set[Node] = set()
    dense: set[Node] = set()  # buffers some load cannot read NHWC
    reasons: dict[tuple[Node, str], Rejection] = {}  # the first reason for each change
    for _ in range(2 * len(graph.nodes) + 1):
        planned = _plan_once(graph, settings, forced, dense)
        if isinstance(planned, list):
            _take(planned, forced, dense)
            for r in planned:
                reasons.setdefault((r.node, r.kind), r)
            continue
        kernels, nhwc = planned
        logger.debug(
            "planned %d graph values into %d kernels (%d values materialized by request, %d NHWC)",
            len(graph.nodes),
            len(kernels),
            len(forced),
            len(nhwc),
        )
        return Plan(graph, kernels, settings, nhwc, tuple(reasons.values()))
    raise AssertionError("planner did not converge")


def _take(rejections: Sequence[Rejection], forced: set[Node], dense: set[Node]) -> None:
    """Add the values ``rejections`` name to those to materialize (``forced``) or keep dense."""
    to = {"materialize": forced, "dense": dense}
    assert any(r.node not in to[r.kind] for r in rejections), f"planner loops: {rejections[0]}"
    for r in rejections:
        logger.debug("%s", r)
        to[r.kind].add(r.node)


def _users(graph: Graph, stop: set[Node], computed: Sequence[Node]) -> dict[Node, list[Node]]:
    users: dict[Node, list[Node]] = {n: [] for n in graph.nodes}
    for n in computed:
        for s in dict.fromkeys(n.src):
            b = base(s, stop)
            if n not in users[b]:
                users[b].append(n)
    return users


def _partition(
    graph: Graph,
    settings: PlanSettings,
    stop: set[Node],
    users: dict[Node, list[Node]],
    computed: Sequence[Node],
    together: Sequence[Sequence[Node]] = (),
) -> Partition:
    library_mm = settings.matmul == "library"
    columns = settings.column_reduce == "accumulate"
    recompute_ops = settings.recompute_max_ops if settings.recompute else 0
    part = Partition(Ctx(graph, users, stop, settings.merge_matmuls, columns, recompute_ops))
    prio = {KernelKind.MATMUL: 0, KernelKind.ROW: 1, KernelKind.POINTWISE: 2}  # node kinds: 3
    in_chain: dict[Node, int] = {}  # epilogue member -> gid of its CONV group
    outputs = set(graph.outputs)
    for n in computed:
        if n in in_chain:  # computed inside its conv's library call
            part.extend(in_chain[n], n, [base(s, stop) for s in n.src])
            continue
        kind = kind_of(n, library_mm, settings.column_reduce != "generate", columns)
        if kind is KernelKind.LIBRARY and n.op is Op.CONV and settings.conv_epilogue and n.dtype.is_float:
            kind = KernelKind.CONV
        g = new_group(len(part.parent), n, kind, columns)
        if n in stop:
            g.copy = True
        part.add(g, [base(s, stop) for s in n.src])
        if kind is KernelKind.CONV:
            ok = lambda r, gid=g.gid: not _depends_on(part, r, gid, stop)  # noqa: E731
            ep = conv_epilogue(n, users, outputs, ok, taken=in_chain)
            g.epilogue = ep
            in_chain.update((m, g.gid) for m in ep.nodes[1:] if m not in stop)
            continue
        if not settings.fuse or kind in NODE_KINDS:
            continue
        edges = [(i, base(s, stop)) for i, s in enumerate(n.src)]
        edges = [(i, q) for i, q in edges if q in part.of]
        edges.sort(key=lambda e: prio.get(part.group(e[1]).kind, 3))
        for i, q in edges:
            pk = part.group(q).kind
            if pk is KernelKind.MATMUL and not settings.fuse_epilogue:
                continue
            if (n.op in REDUCE or n.op in ROW) and pk is KernelKind.POINTWISE and not settings.fuse_prologue:
                continue
            part.try_merge(q, n, i)
    if settings.fuse and settings.horizontal:
        part.merge_siblings(together)
    return part


def _depends_on(part: Partition, r: Node, gid: int, stop: set[Node]) -> bool:
    """Whether value ``r`` is computed by group ``gid`` or by a group that depends on it."""
    q = base(r, stop)
    if q not in part.of:
        return False
    rg = part.find(part.of[q])
    return rg == gid or bool((part.anc[rg] >> gid) & 1)


def _pinned(graph: Graph, live: set[Node], part: Any, forced: set[Node], stop: set[Node]) -> set[Node]:
    """Values that must be in memory whatever the fusion: library / matmul / conv / attention operands,
    a CONV kernel's residual and tail, pad sources, graph outputs, and ``forced``."""
    group_of_conv = {g.epilogue.conv: g.epilogue for g in part.groups.values() if g.kind is KernelKind.CONV}
    pinned: set[Node] = {f for f in forced if f.op not in SOURCE}
    for n in graph.nodes:
        if n not in live:
            continue
        library = n in part.of and part.group(n).kind is KernelKind.LIBRARY  # e.g. a column sum on the cpu
        if n.op in (Op.MATMUL, Op.CONV, Op.POOL, Op.ATTENTION, Op.EXPERTS, Op.ROUTE) or library:
            pinned.update(base(s, stop) for s in n.src)
        if n in group_of_conv:  # a CONV kernel's residual is a library operand, its tail a library result
            ep = group_of_conv[n]
            pinned.add(ep.tail)
            if ep.residual is not None:
                pinned.add(base(ep.residual, stop))
        elif n.op is Op.PAD:
            pinned.add(base(n.src[0], stop))
    pinned.update(base(o, stop) for o in graph.outputs)
    return {p for p in pinned if p.op not in SOURCE}


def _plan_once(
    graph: Graph, settings: PlanSettings, forced: set[Node], dense: set[Node]
) -> tuple[tuple[Kernel, ...], frozenset[Node]] | list[Rejection]:
    """The kernels and NHWC buffers of one planning round, or the reasons to plan again."""
    stop = {f for f in forced if f.op in LAYOUT}
    live = live_nodes(graph)  # dead code gets no kernel and forces no buffer
    slices = slice_stores(graph, live, forced, stop) if settings.fuse else {}
    # values some kernel computes, in graph order (layout ops are index maps unless materialized)
    computed = [
        n
        for n in graph.nodes
        if n in live and n.op not in SOURCE and (n.op not in LAYOUT or n in stop) and n not in slices.values()
    ]
    users = _users(graph, stop, computed)
    pieces = [[p for p, c in slices.items() if c is cat] for cat in dict.fromkeys(slices.values())]
    part = _partition(graph, settings, stop, users, computed, pieces)

    pinned = _pinned(graph, live, part, forced, stop) | set(slices)

    group_of = {n: part.group(n) for n in part.of}
    buffers = set(pinned) | stop
    for q, us in users.items():
        if q in group_of and any(group_of.get(u) is not group_of[q] for u in us):
            buffers.add(q)
    if settings.recompute and settings.fuse:
        outputs = set(graph.outputs)
        for q in graph.nodes:
            if (
                q in buffers
                and q not in pinned
                and q.op in POINTWISE_OPS
                and can_absorb(
                    q,
                    group_of[q].sel,
                    users,
                    outputs=outputs,
                    is_buffer=lambda x: x in buffers,
                    stop=stop,
                    max_ops=settings.recompute_max_ops,
                )
            ):
                buffers.discard(q)

    nhwc: frozenset[Node] = frozenset()
    if settings.channels_last:
        outs = {base(o, stop) for o in graph.outputs}
        nhwc = channels_last_buffers(buffers, users, part.group, outs) - dense
    order = {n: i for i, n in enumerate(graph.nodes)}
    kernels, todo = _lower_groups(part.groups.values(), buffers, stop, order, slices, nhwc)
    if todo:
        return todo
    kernels = merge_routers(kernels)
    outputs = {base(o, stop) for o in graph.outputs}
    return _schedule(conv_chains(kernels, nhwc, outputs) if settings.conv_chains else kernels, order), nhwc


def _lower_groups(
    groups: Iterable[Group],
    buffers: set[Node],
    stop: set[Node],
    order: Mapping[Node, int],
    slices: Mapping[Node, Node],
    nhwc: frozenset[Node],
) -> tuple[list[Kernel], list[Rejection]]:
    """The kernels of ``groups``, and the reasons to plan again: every value to materialize this round
    (plan again once for all of them), or the first buffer to keep dense alone (a layout changes what
    every reader loads, so the other groups' reasons wait for the next round)."""
    kernels: list[Kernel] = []
    todo: list[Rejection] = []
    for g in groups:
        lowered = _lower(g, buffers, stop, order, slices, nhwc)
        if isinstance(lowered, list):
            kernels += lowered
        elif lowered.kind == "dense":
            return kernels, [lowered]
        else:
            todo.append(lowered)
    return kernels, todo + _split_concats(kernels, slices)


def _lower(
    g: Group,
    buffers: set[Node],
    stop: set[Node],
    order: Mapping[Node, int],
    slices: Mapping[Node, Node],
    nhwc: frozenset[Node] = frozenset(),
) -> list[Kernel] | Rejection:
    """The kernel of group ``g`` (none if it stores nothing), or why it cannot be built as planned."""
    stores = sorted((m for m in g.sel if m in buffers), key=order.__getitem__)
    if not stores:
        return []
    if g.kind is KernelKind.CONV:
        ep = g.epilogue
        operands = (*ep.conv.src, *(v for v in (ep.bias, ep.residual) if v is not None))
        inputs = tuple(base(s, stop) for s in operands)
        assert ep.tail in buffers and all(m not in buffers for m in ep.nodes[:-1]), "conv epilogue stored"
        return [ConvKernel("", ep.tail.shape, node=ep.conv, inputs=inputs, epilogue=ep, computes=ep.nodes)]
    if g.kind in NODE_KINDS:
        (node,) = g.sel
        inputs = tuple(base(s, stop) for s in node.src)
        return [NODE_KERNELS[g.kind]("", node.shape, node=node, inputs=inputs, computes=(node,))]
    k = BodyBuilder(g, buffers, stop, order, nhwc).kernel(stores, slices)
    if not isinstance(k, Rejection):
        k = channel_rows(k, nhwc)  # a ROW kernel over NHWC buffers (other kinds are as they are)
    return k if isinstance(k, Rejection) else [channels_inner(k, nhwc)]


def slice_stores(graph: Graph, live: set[Node], forced: set[Node], stop: set[Node]) -> dict[Node, Node]:
    """Concats written as slices: ``{piece: concat}`` for each concat that is a graph output, whose pieces
    are computed values of one shape read by nothing else. The kernel computing the pieces stores each into
    its slice of the concat's buffer (one kernel, no copy); a concat read inside a kernel stays a masked
    select of its branches. A concat in `forced` (its pieces ended in different kernels) is computed."""
    outputs = {base(o, stop) for o in graph.outputs}
    users = graph.users()
    out: dict[Node, Node] = {}
    for c in graph.nodes:
        if c.op is not Op.CONCAT or c not in live or c not in outputs or c in forced:
            continue
        pieces = c.src
        if (
            len(set(pieces)) == len(pieces)
            and all(p.shape == pieces[0].shape for p in pieces)
            and all(
                p.op not in SOURCE and p.op not in LAYOUT and p not in outputs and users[p] == [c]
                for p in pieces
            )
        ):
            out.update((p, c) for p in pieces)
    return out


def _split_concats(kernels: Sequence[Kernel], slices: Mapping[Node, Node]) -> list[Rejection]:
    """A concat whose slices more than one kernel stores is computed by a kernel of its own instead."""
    writers: dict[Node, int] = {}
    for k in kernels:
        for c in k.writes:
            writers[c] = writers.get(c, 0) + 1
    cats = dict.fromkeys(slices.values())
    return [
        Rejection.materialize(c, "its pieces are computed in several kernels")
        for c in cats
        if writers.get(c, 0) > 1
    ]


def merge_routers(kernels: Sequence[Kernel]) -> list[Kernel]:
    """One ROUTER kernel per router: the kernels of twins (``ROUTE`` nodes with the same operands and
    choice) become one writing both, weights first, where the first of them stood."""
    first: dict[tuple, int] = {}
    out: list[Kernel] = []
    for k in kernels:
        if not isinstance(k, RouterKernel):
            out.append(k)
            continue
        key = (k.node.src, k.node.arg.choice)
        if key not in first or {n.arg.indices for n in out[first[key]].writes} & {
            n.arg.indices for n in k.writes
        }:
            first[key] = len(out)
            out.append(k)
            continue
        i = first[key]
        twins = sorted((*out[i].writes, *k.writes), key=lambda n: n.arg.indices)
        out[i] = replace(out[i], outputs=tuple(twins), computes=tuple(twins))
    return out


def _schedule(kernels: Sequence[Kernel], order: Mapping[Node, int]) -> tuple[Kernel, ...]:
    """Topological order of kernels by the buffers they exchange (ties: graph order); names k0, k1..."""
    writer = {b: i for i, k in enumerate(kernels) for b in k.writes}
    deps = [{writer[b] for b in k.reads if b in writer} - {i} for i, k in enumerate(kernels)]
    for k in kernels:
        for b in k.reads:
            assert b.op in SOURCE or b in writer, f"kernel reads {b}, which nobody writes"
    key = [min(order[b] for b in k.writes) for k in kernels]
    out: list[Kernel] = []
    users: dict[int, list[int]] = {i: [] for i in range(len(kernels))}
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    left = [len(d) for d in deps]
    heap = [(key[i], i) for i in range(len(kernels)) if not deps[i]]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        out.append(replace(kernels[i], name=f"k{len(out)}"))
        for j in users[i]:
            left[j] -= 1
            if left[j] == 0:
                heapq.heappush(heap, (key[j], j))
    assert len(out) == len(kernels), "kernels depend on each other in a cycle"
    return tuple(out)
