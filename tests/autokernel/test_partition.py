"""Fusion groups: selection maps, merge rules, cycles."""

from __future__ import annotations

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.partition import (
    Ctx,
    Partition,
    base,
    chain,
    kind_of,
    member_ok,
    new_group,
    operand_sel,
    sel_down,
    sel_up,
)
from kernelize.ir import Graph, Op


def partition(g: Graph) -> Partition:
    users = {n: [] for n in g.nodes}
    for n in g.nodes:
        for s in n.src:
            users[base(s)].append(n)
    part = Partition(Ctx(g, users, set(), recompute_ops=8))
    for n in g.nodes:
        if n.op in (Op.INPUT, Op.CONST) or n.op in (Op.VIEW, Op.BROADCAST, Op.PERMUTE, Op.SLICE, Op.FLIP):
            continue
        part.add(new_group(len(part.parent), n, kind_of(n, False)), [base(s) for s in n.src])
        for i, s in enumerate(n.src):
            if base(s) in part.of:
                part.try_merge(base(s), n, i)
    return part


def test_reduction_group_puts_the_row_last_and_keeps_the_origin():
    g = Graph()
    x = g.input("x", (3, 5, 7), "f32")
    s = g.reduce(Op.SUM, x, 1, keepdim=True)
    grp = new_group(0, s, KernelKind.ROW)
    assert grp.domain == (3, 7, 5) and grp.row_rank == 1
    assert grp.sel[s] == (0, ~2, 1)  # the reduced axis is the constant 0 that came from domain axis 2
    assert operand_sel(s, 0, grp.sel[s]) == (0, 2, 1)
    assert member_ok(grp, s, grp.sel[s])


def test_selection_maps_through_layout_ops():
    g = Graph()
    x = g.input("x", (4, 1), "f32")
    b = g.broadcast(x, (4, 6))
    assert sel_down(b, (0, 1)) == (0, ~1)
    assert sel_up(b, (0, ~1), (4, 6)) == (0, 1)
    assert sel_up(b, (0, None), (4, 6)) is None  # which axis would the broadcast run along?
    p = g.permute(g.input("y", (2, 3), "f32"), (1, 0))
    assert sel_down(p, (0, 1)) == (1, 0) and sel_up(p, (1, 0), (3, 2)) == (0, 1)
    sl = g.slice(g.input("z", (6,), "f32"), 0, 1)
    assert sel_down(sl, (0,)) is None  # an offset is no selection


def test_softmax_by_hand_is_one_group():
    g = Graph()
    x = g.input("x", (4, 6), "f32")
    m = g.reduce(Op.REDUCE_MAX, x, 1, keepdim=True)
    e = g.exp(g.sub(x, m))
    y = g.div(e, g.reduce(Op.SUM, e, 1, keepdim=True))
    part = partition(g)
    assert len(part.groups) == 1
    (grp,) = part.groups.values()
    assert grp.kind is KernelKind.ROW and grp.domain == (4, 6) and grp.sel[y] == (0, 1)


def test_two_rows_do_not_merge_and_matmul_takes_only_an_epilogue():
    g = Graph()
    x = g.input("x", (4, 6), "f32")
    a = g.softmax(g.exp(x), axis=0)
    b = g.softmax(a, axis=1)
    part = partition(g)
    assert part.group(a) is not part.group(b)
    g = Graph()
    x, w = g.input("x", (4, 6), "f32"), g.input("w", (6, 5), "f32")
    pre = g.exp(x)
    mm = g.matmul(pre, w)
    post = g.tanh(mm)
    part = partition(g)
    assert part.group(mm) is part.group(post) and part.group(pre) is not part.group(mm)
    assert part.group(mm).kind is KernelKind.MATMUL


def test_merges_never_make_a_cycle_between_kernels():
    g = Graph()
    x = g.input("x", (4, 6), "f32")
    a = g.exp(x)
    s = g.softmax(a, axis=1)  # a's prologue group
    r = g.softmax(a, axis=0)  # another row: its own group, reading a
    c = g.add(s, r)  # joining s's group would make that kernel read r, which reads a from it
    part = partition(g)
    assert part.group(s) is part.group(a) and part.group(r) is not part.group(a)
    assert part.group(c) is part.group(r)
    assert chain(g.broadcast(g.view(x, (1, 4, 6)), (2, 4, 6))) and base(x) is x


def test_read_keys_look_through_cheap_pointwise_trees_to_their_inputs():
    """Readers of recomputed pointwise values count as readers of what those values are computed from."""
    g = Graph()
    dy, x = g.input("dy", (4, 6), "bf16"), g.input("x", (4, 6), "bf16")
    d = g.cast(dy, "f32")
    a, b = g.mul(d, g.cast(x, "f32")), g.exp(d)
    part = partition(g)
    keys = part.read_keys(a)
    assert keys[0] == part.find(part.of[a]) and set(keys[1:]) == {dy, x}
    assert set(part.read_keys(b)[1:]) == {dy}
    assert part.read_keys(x) == [x]  # an input is read as itself
    part = Partition(Ctx(g, part.ctx.users, set(), recompute_ops=2))
    for n in (d, g.cast(x, "f32"), a):
        part.add(new_group(len(part.parent), n, kind_of(n, False)), [base(s) for s in n.src])
    assert part.read_keys(a) == [part.find(part.of[a])]  # three ops: more than readers recompute
