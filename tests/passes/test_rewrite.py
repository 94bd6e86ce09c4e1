"""Pattern matching and the rebuild driver that every pass uses."""

from __future__ import annotations

import pytest
import torch

from kernelize.ir import Graph, Op, evaluate, format_graph, verify
from kernelize.ir.graph import scalar_value
from kernelize.passes.rewrite import (
    B,
    Const,
    P,
    RewriteLoopError,
    Scalar,
    Var,
    const_value,
    is_const,
    map_nodes,
    rewrite,
    strip_broadcast,
    unbroadcast,
)


def graph_xy():
    g = Graph()
    x = g.input("x", (2, 3), "f32")
    y = g.input("y", (2, 3), "f32")
    return g, x, y


def test_pattern_matches_op_operands_and_captures():
    g, x, y = graph_xy()
    n = g.mul(g.exp(x), y)
    (caps,) = list(P(Op.MUL, P(Op.EXP, Var("a")), Var("b")).match(n))
    assert caps == {"a": x, "b": y}
    assert list(P(Op.ADD, Var("a"), Var("b")).match(n)) == []
    assert list(P(frozenset({Op.ADD, Op.MUL})).match(n)) == [{}]


def test_commutative_ops_match_both_orders_and_others_do_not():
    g, x, y = graph_xy()
    pat = P(None, P(Op.EXP, Var("e")), Var("other"))
    assert [c["other"] for c in pat.match(g.mul(y, g.exp(x)))] == [y]
    assert list(pat.match(g.sub(y, g.exp(x)))) == []


def test_a_name_seen_twice_must_bind_the_same_node():
    g, x, y = graph_xy()
    same = P(Op.MUL, Var("v"), Var("v"))
    assert list(same.match(g.mul(x, x))) == [{"v": x}]
    assert list(same.match(g.mul(x, y))) == []


def test_scalar_const_arg_and_where():
    g, x, _ = graph_xy()
    n = g.mul(x, 2.0)
    (caps,) = list(P(Op.MUL, Var("x"), Scalar("c")).match(n))
    assert caps["x"] is x and scalar_value(caps["c"]) == 2.0
    w = g.mul(x, g.const(torch.arange(3.0)))
    assert list(P(Op.MUL, Var("x"), Scalar("c")).match(w)) == []
    assert len(list(P(Op.MUL, Var("x"), Const("c")).match(w))) == 1
    r = g.reduce(Op.SUM, x, 1, keepdim=True)
    assert len(list(P(Op.SUM, arg=(1,)).match(r))) == 1 and not list(P(Op.SUM, arg=(0,)).match(r))
    assert not list(P(Op.SUM, where=lambda n: n.rank == 1).match(r))


def test_peel_sees_through_broadcasts_and_unit_views():
    g, x, _ = graph_xy()
    m = g.reduce(Op.MEAN, x, 1, keepdim=False)  # view of a keepdim mean: [2]
    n = g.sub(x, g.view(m, (2, 1)))  # broadcast(view(view(mean)))
    plain = P(Op.SUB, Var("x"), P(Op.MEAN, name="m"))
    peeled = P(Op.SUB, Var("x"), B(P(Op.MEAN, name="m")))
    assert list(plain.match(n)) == []
    (caps,) = list(peeled.match(n))
    assert caps["m"].op is Op.MEAN and unbroadcast(n.src[1]) is caps["m"]
    assert strip_broadcast(n.src[1]).shape == (2, 1)


def test_const_helpers():
    g, x, _ = graph_xy()
    c = g.const(torch.tensor([1.0, 2.0, 3.0]))
    n = g.mul(x, c)
    assert is_const(n.src[1]) and not is_const(x)
    assert const_value(n.src[1]).tolist() == [[1.0, 2.0, 3.0]]  # rank of the operand, broadcast left out
    assert const_value(x) is None


def test_rewrite_is_pure_and_keeps_inputs_and_outputs():
    g, x, y = graph_xy()
    g.output(g.neg(g.neg(x)), y)
    before = format_graph(g)
    rules = [(P(Op.NEG, P(Op.NEG, Var("v"))), lambda ctx, v: v)]
    out = rewrite(g, rules, "test")
    assert format_graph(g) == before
    assert [i.arg for i in out.inputs] == ["x", "y"]
    assert out.outputs == [out.inputs[0], out.inputs[1]]
    verify(out)


def test_rule_that_declines_lets_the_next_rule_try():
    g, x, _ = graph_xy()
    g.output(g.exp(x))
    rules = [(P(Op.EXP, Var("v")), lambda ctx, v: None), (P(Op.EXP, Var("v")), lambda ctx, v: ctx.g.neg(v))]
    assert rewrite(g, rules).outputs[0].op is Op.NEG


def test_a_looping_rule_is_named():
    g, x, _ = graph_xy()
    g.output(g.exp(x))

    def grow_forever(ctx, v):
        return ctx.g.exp(ctx.g.add(v, 1.0))

    with pytest.raises(
        RewriteLoopError, match="rule grow_forever of pass looper rewrote one value more than 8"
    ):
        rewrite(g, [(P(Op.EXP, Var("v")), grow_forever)], "looper", max_steps=8)


def test_a_rule_changing_shape_or_dtype_is_caught():
    g, x, _ = graph_xy()
    g.output(g.exp(x))
    with pytest.raises(AssertionError, match="rule bad of pass"):
        rewrite(g, [(P(Op.EXP, Var("v")), bad)], "p")


def bad(ctx, v):
    return ctx.g.cast(v, "f16")


def test_uses_counts_live_users_in_the_old_graph():
    g, x, y = graph_xy()
    shared = g.exp(x)
    g.neg(shared)  # dead: does not count
    g.output(g.add(shared, y), g.mul(g.sigmoid(x), 2.0))
    seen = {}

    def record(ctx, v):
        seen[ctx.root.op] = ctx.uses(ctx.root)
        return None

    rewrite(g, [(P(frozenset({Op.EXP, Op.SIGMOID}), Var("v")), record)])
    assert seen == {Op.EXP: 1, Op.SIGMOID: 1}


def test_deep_chains_do_not_recurse():
    g = Graph()
    x = g.input("x", (4,), "f32")
    v = x
    for _ in range(5000):
        v = g.neg(v)
    g.output(v)
    out = rewrite(g, [(P(Op.NEG, P(Op.NEG, Var("v"))), lambda ctx, v: v)])
    assert out.outputs == out.inputs  # 5000 negations cancel
    assert len(map_nodes(out, lambda n: False)) == 1  # copying keeps the input only
    t = torch.randn(4)
    torch.testing.assert_close(evaluate(out, [t])[0], t)
