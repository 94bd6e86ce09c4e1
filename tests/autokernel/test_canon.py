"""Sinking reshapes below elementwise epilogues."""

from __future__ import annotations

import pytest
import torch

from kernelize.autokernel.canon import sink_views
from kernelize.ir import Graph, Op, evaluate


def test_epilogue_after_a_reshaped_matmul_moves_into_its_index_space():
    g = Graph()
    x, w, b = g.input("x", (10, 16), "f32"), g.input("w", (16, 8), "f32"), g.input("b", (8,), "f32")
    y = g.view(g.matmul(x, w), (2, 5, 8))
    g.output(g.tanh(g.add(y, b)))
    c = sink_views(g)
    assert c is not g and [i.arg for i in c.inputs] == ["x", "w", "b"]
    (out,) = c.outputs
    assert out.op is Op.VIEW and out.src[0].op is Op.TANH and out.src[0].shape == (10, 8)
    xs = [torch.randn(10, 16), torch.randn(16, 8), torch.randn(8)]
    torch.testing.assert_close(evaluate(c, xs)[0], evaluate(g, xs)[0])


def test_nothing_to_sink_returns_the_graph_and_unstrided_operands_block_it():
    g = Graph()
    x = g.input("x", (4, 6), "f32")
    g.output(g.exp(x))
    assert sink_views(g) is g
    g = Graph()
    x, t = g.input("x", (6, 4), "f32"), g.input("t", (4, 6), "f32")
    e = g.view(g.exp(x), (4, 6))
    g.output(g.add(e, g.permute(g.view(t, (6, 4)), (1, 0))))  # no strides read t as [6, 4] permuted
    assert sink_views(g) is g


def test_batched_matmul_over_merged_heads_runs_over_the_unmerged_batch():
    g = Graph()
    q, k = g.input("q", (2, 3, 5, 8), "f32"), g.input("k", (2, 3, 5, 8), "f32")
    kt = g.permute(k, (0, 1, 3, 2))
    s = g.view(g.matmul(g.view(q, (6, 5, 8)), g.view(kt, (6, 8, 5))), (2, 3, 5, 5))
    g.output(g.softmax(s))
    c = sink_views(g)
    (mm,) = [n for n in c.nodes if n.op is Op.MATMUL]
    assert mm.shape == (2, 3, 5, 5) and c.outputs[0].src[0] is mm
    xs = [torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)]
    torch.testing.assert_close(evaluate(c, xs)[0], evaluate(g, xs)[0])


def test_norm_follows_a_reshape_that_keeps_its_axis():
    g = Graph()
    x, r, w = g.input("x", (6, 8), "f32"), g.input("r", (2, 3, 8), "f32"), g.input("w", (8,), "f32")
    h = g.add(g.view(g.exp(x), (2, 3, 8)), r)
    g.output(g.rmsnorm(h, w), g.softmax(h, 2))
    c = sink_views(g)
    norm, soft = (o.src[0] for o in c.outputs)
    assert norm.op is Op.RMSNORM and norm.shape == (6, 8) and soft.op is Op.SOFTMAX and soft.arg == 1
    xs = [torch.randn(6, 8), torch.randn(2, 3, 8), torch.randn(8)]
    for a, b in zip(evaluate(c, xs), evaluate(g, xs)):
        torch.testing.assert_close(a, b)


def test_pad_of_a_computed_value_becomes_concats_of_constant_blocks():
    g = Graph()
    x = g.input("x", ("n", 5), "f32")
    g.output(g.pad(g.exp(x), [(0, 0), (2, 1)], 7.0), g.pad(x, [(0, 0), (1, 1)]))
    c = sink_views(g)
    assert c.outputs[0].op is Op.CONCAT and c.outputs[1].op is Op.PAD  # a pad of an input stays a pad
    xs = [torch.randn(3, 5)]
    for a, b in zip(evaluate(c, xs), evaluate(g, xs)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("op", [Op.SUM, Op.MEAN])
def test_small_sum_over_a_leading_axis_becomes_adds_of_slices(op, dtype):
    """rotary's cos gradient sums 4 heads: adds of slices fuse into the kernel that computes the terms."""
    g = Graph()
    x = g.input("x", ("n", 4, 8), dtype)
    g.output(g.reduce(op, g.exp(x), 1, keepdim=True))
    c = sink_views(g)
    ops = [n.op for n in c.nodes]
    assert op not in ops and ops.count(Op.ADD) == 3
    xs = [torch.randn(3, 4, 8).to(getattr(torch, {"f32": "float32", "bf16": "bfloat16"}[dtype]))]
    tol = 1e-6 if dtype == "f32" else 1e-2
    torch.testing.assert_close(evaluate(c, xs)[0], evaluate(g, xs)[0], rtol=tol, atol=tol)


@pytest.mark.parametrize(("axis", "shape"), [(2, (3, 4, 8)), (0, (40, 8)), (1, (2, 33, 8)), (0, ("n", 8))])
def test_row_sums_large_sums_and_symbolic_sums_stay_reductions(axis, shape):
    g = Graph()
    x = g.input("x", shape, "f32")
    g.output(g.reduce(Op.SUM, x, axis, keepdim=True))
    assert sink_views(g) is g


def test_a_concat_is_not_read_through_a_view_merging_its_axis():
    """``cast(dy).view(n, 2, 8) * concat(...)`` (bf16 rotary's backward) stays in the concat's shape: moved
    to the flat shape of ``cast(dy)``, the concat's axis is no domain axis and it would be written out."""
    from kernelize.autokernel.plan import PlanSettings, plan

    g = Graph()
    dy, x = g.input("dy", ("n", 16), "bf16"), g.input("x", ("n", 2, 8), "bf16")
    rot = g.concat([g.cast(g.neg(g.slice(x, 2, 4, 8)), "f32"), g.cast(g.slice(x, 2, 0, 4), "f32")], 2)
    g.output(g.cast(g.mul(g.view(g.cast(dy, "f32"), x.shape), rot), "bf16"))
    p = plan(g, PlanSettings())
    assert len(p.kernels) == 1 and all(b.op is not Op.CONCAT for b in p.buffers)
    ins = [torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 2, 8, dtype=torch.bfloat16)]
    torch.testing.assert_close(evaluate(sink_views(g), ins)[0], evaluate(g, ins)[0])
