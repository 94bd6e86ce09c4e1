"""Lowering one group to a kernel body: hash-consing, masks, materialization requests (returned reasons)."""

from __future__ import annotations

from kernelize.autokernel.body import BodyBuilder, _range
from kernelize.autokernel.kernels import Compute, KernelKind, Load
from kernelize.autokernel.partition import Group
from kernelize.autokernel.reasons import Rejection
from kernelize.ir import Graph, Op
from kernelize.ir.ops import ConcatArgs


def _group(n, kind=KernelKind.POINTWISE):
    g = Group(0, kind, n.shape)
    g.sel[n] = tuple(range(n.rank))
    return g


def _members(g: Graph, *nodes):
    grp = Group(0, KernelKind.POINTWISE, nodes[-1].shape)
    for n in nodes:
        grp.sel[n] = tuple(range(n.rank))
    return grp


def test_shared_subexpressions_are_computed_once():
    g = Graph()
    x = g.input("x", (4, 8), "f32")
    e = g.exp(x)
    y = g.add(g.mul(e, e), e)
    k = BodyBuilder(_members(g, e, y), set(), set(), {n: i for i, n in enumerate(g.nodes)}).kernel([y])
    assert [type(b).__name__ for b in k.body] == ["Load", "Compute", "Compute", "Compute"]
    assert sum(isinstance(b, Compute) and b.op is Op.EXP for b in k.body) == 1
    assert k.computes == (e, y)


def test_concat_branches_are_masked_and_reversed_when_flipped():
    g = Graph()
    a, b = g.input("a", (2, 3), "f32"), g.input("b", (4, 3), "f32")
    c = g.concat([a, b], 0)
    order = {n: i for i, n in enumerate(g.nodes)}
    k = BodyBuilder(_group(c), set(), set(), order).kernel([c])
    loads = [e for e in k.body if isinstance(e, Load)]
    assert [ld.mask for ld in loads] == [((0, 0, 2),), ((0, 2, 6),)] and loads[1].offset == -6
    assert k.body[-1] == Compute(Op.CONCAT, c.dtype, (0, 1), ConcatArgs(0, (2, 6)))
    assert _range(-1, 5, 0, 2) == (4, 6) and _range(1, 1, 0, 2) == (-1, 1)


def test_a_split_the_strides_cannot_follow_asks_to_materialize():
    g = Graph()
    x = g.input("x", (4, 6), "f32")
    p = g.permute(x, (1, 0))
    y = g.exp(g.view(p, (24,)))
    got = BodyBuilder(_group(y), set(), set(), {n: i for i, n in enumerate(g.nodes)}).kernel([y])
    assert isinstance(got, Rejection) and got.node is p and got.kind == "materialize"
    assert str(got).startswith("materialize Node(permute")
    k = BodyBuilder(_group(y), set(), {p}, {n: i for i, n in enumerate(g.nodes)}).kernel([y])
    assert k.body[0] == Load(p, (1,))  # once p is materialized, the view is a flat read of it
