"""Constant folding and layout/cast simplification."""

from __future__ import annotations

import pytest
import torch

from kernelize.ir import Graph, Op, Sym, evaluate, verify
from kernelize.passes import dce, fold


def folded(g: Graph) -> Graph:
    out = dce(fold(g))
    verify(out)
    return out


def ops(g: Graph) -> list[Op]:
    return [n.op for n in g.nodes]


def test_constant_subexpressions_fold_to_one_constant():
    g = Graph()
    a, b = g.const(torch.tensor([1.0, 4.0])), g.const(torch.tensor([2.0, 3.0]))
    g.output(g.exp(g.sub(g.mul(a, b), g.reduce(Op.SUM, b, 0, keepdim=True))))
    out = folded(g)
    assert ops(out) == [Op.CONST]
    torch.testing.assert_close(out.nodes[0].arg.tensor, torch.exp(torch.tensor([2.0, 12.0]) - 5.0))


def test_weight_transpose_folds_into_the_constant():
    g = Graph()
    x = g.input("x", (2, 3), "f32")
    w = torch.randn(4, 3)
    g.output(g.matmul(x, g.transpose(g.const(w))))
    out = folded(g)
    assert ops(out) == [Op.INPUT, Op.CONST, Op.MATMUL]
    torch.testing.assert_close(out.nodes[1].arg.tensor, w.T)


def test_scaled_weight_folds_but_broadcast_scalars_stay_small():
    g = Graph()
    x = g.input("x", (8, 16), "f32")
    w = g.const(torch.randn(16))
    y = g.mul(x, g.mul(w, 2.0))  # w * 2 folds; the [16] result is broadcast, never materialised at [8, 16]
    g.output(g.add(y, 1.0))
    out = folded(g)
    consts = [n for n in out.nodes if n.op is Op.CONST]
    assert sorted(c.arg.tensor.numel() for c in consts) == [1, 16]
    t = torch.randn(8, 16)
    torch.testing.assert_close(evaluate(out, [t])[0], evaluate(g, [t])[0])


def test_large_and_symbolic_results_are_not_folded():
    g = Graph()
    big = g.add(g.broadcast(g.const(torch.tensor(1.0)), (100, 100)), 2.0)
    x = g.input("x", ("batch", 4), "f32")
    sym = g.add(g.broadcast(g.const(torch.tensor(1.0)), (Sym.of("batch"), 4)), 3.0)
    g.output(big, g.add(x, sym))
    out = folded(g)
    assert ops(out).count(Op.ADD) == 3


def test_out_of_range_gather_is_left_for_run_time():
    g = Graph()
    g.output(g.gather(g.const(torch.arange(4.0)), g.const(torch.tensor([7]))))
    out = folded(g)
    assert Op.GATHER in ops(out)
    with pytest.raises(IndexError):
        evaluate(out, [])


def test_slice_of_slice_merges():
    g = Graph()
    x = g.input("x", (20, 6), "f32")
    s = g.slice(g.slice(g.slice(x, 0, 1, 19, 2), 0, 2, None, 3), 1, 1, 5)
    g.output(s)
    out = folded(g)
    assert ops(out) == [Op.INPUT, Op.SLICE]
    t = torch.randn(20, 6)
    torch.testing.assert_close(evaluate(out, [t])[0], t[1:19:2][2::3][:, 1:5])


def test_permute_of_unit_dims_is_a_view():
    g = Graph()
    x = g.input("x", (3, 1, 4), "f32")
    g.output(g.permute(x, (1, 0, 2)), g.permute(x, (2, 1, 0)))
    out = folded(g)
    assert ops(out) == [Op.INPUT, Op.VIEW, Op.PERMUTE]


@pytest.mark.parametrize(
    "src,mid,gone",
    [
        ("f16", "f32", True),
        ("bf16", "f64", True),
        ("i8", "i32", True),
        ("bool", "f16", True),
        ("i16", "f32", True),
        ("f32", "f16", False),
        ("i32", "f32", False),
        ("f16", "bf16", False),
    ],
)
def test_exact_round_trip_casts_vanish(src, mid, gone):
    g = Graph()
    x = g.input("x", (4,), src)
    g.output(g.cast(g.cast(x, mid), src))
    out = folded(g)
    assert (out.outputs[0] is out.inputs[0]) == gone


def _pieces_graph(split_b: int):
    g = Graph()
    x = g.input("x", ("n", 6), "f32")
    a = g.pad(g.exp(x), [(0, 0), (0, 6)])  # [exp(x), 0]
    b = g.pad(g.sigmoid(x), [(0, 0), (6, 0)])  # [0, sigmoid(x)]
    if split_b != 6:  # the same value split elsewhere: [0 (split_b), sigmoid(x), 0 (6 - split_b)]
        b = g.pad(g.sigmoid(x), [(0, 0), (split_b, 6 - split_b)])
    c = g.concat([g.tanh(x), g.neg(x)], 1)
    g.output(g.add(g.add(a, b), c))
    return g


def test_sum_of_zero_padded_pieces_becomes_one_concat():
    """[exp(x), 0] + [0, sigmoid(x)] + [tanh(x), -x] -> [exp(x) + tanh(x), sigmoid(x) - x]: no zeros are
    added and no branch is computed over the other's range."""
    g = _pieces_graph(6)
    out = folded(g)
    assert Op.PAD not in ops(out) and ops(out).count(Op.CONCAT) == 1
    x = torch.randn(3, 6)
    torch.testing.assert_close(evaluate(out, [x])[0], evaluate(g, [x])[0])
    torch.testing.assert_close(evaluate(out, [x])[0], torch.cat([x.exp() + x.tanh(), x.sigmoid() - x], 1))


def test_pieces_split_at_other_points_are_not_combined():
    g = _pieces_graph(3)
    out = folded(g)
    assert Op.PAD in ops(out)
    x = torch.randn(3, 6)
    torch.testing.assert_close(evaluate(out, [x])[0], evaluate(g, [x])[0])


def test_casts_move_below_broadcasts_and_into_concat_branches():
    g = Graph()
    x = g.input("x", ("n", 1, 8), "bf16")
    y = g.input("y", ("n", 4, 8), "bf16")
    wide = g.cast(g.broadcast(x, y.shape), "f32")
    cat = g.cast(g.concat([g.neg(y), y], 2), "f32")
    g.output(g.add(wide, g.slice(cat, 2, 0, 8)))
    out = folded(g)
    casts = [n for n in out.nodes if n.op is Op.CAST]
    assert casts and all(n.src[0].op in (Op.INPUT, Op.NEG) or n.src[0].op is Op.SLICE for n in casts), out
    assert all(n.src[0].op is not Op.CONCAT for n in casts)
    xs = [torch.randn(3, 1, 8).bfloat16(), torch.randn(3, 4, 8).bfloat16()]
    torch.testing.assert_close(evaluate(out, xs)[0], evaluate(g, xs)[0])


def test_view_of_a_constant_folds_to_a_view_with_the_digest_of_its_values(monkeypatch):
    import kernelize.ir.graph as graph_module

    g = Graph()
    x = g.input("x", (2, 64), "f32")
    w = torch.randn(64, 4, 16)
    g.output(g.matmul(x, g.view(g.const(w), (64, 64))))
    hashed = []
    real = graph_module.hashlib.sha1
    monkeypatch.setattr(graph_module.hashlib, "sha1", lambda data=b"": hashed.append(len(data)) or real(data))
    out = folded(g)
    assert max(hashed) < w.nbytes  # the weight's bytes were not hashed again
    monkeypatch.undo()
    (c,) = [n.arg for n in out.nodes if n.op is Op.CONST]
    assert c.tensor.shape == (64, 64) and c.tensor.data_ptr() == g.nodes[1].arg.tensor.data_ptr()
    assert c == graph_module.Constant(w.reshape(64, 64).clone())  # equal values, equal digests
    t = torch.randn(2, 64)
    torch.testing.assert_close(evaluate(out, [t])[0], evaluate(g, [t])[0])
