"""The TOPK and ROUTE ops (:mod:`kernelize.ir.router`): the builders' checks, the tie rule of the reference,
the tracer's capture of ``torch.topk`` (any axis, smallest), and verify."""

from __future__ import annotations

import pytest
import torch

from kernelize.ir import trace
from kernelize.ir.graph import Graph, Op
from kernelize.ir.ops import RouteArgs
from kernelize.ir.reference import evaluate
from kernelize.ir.router import same_choice, topk_indices
from kernelize.ir.shapes import ShapeError
from kernelize.ir.verify import verify


def test_ties_go_to_the_lower_index_where_torch_topk_orders_them_freely():
    x = torch.tensor([[1.0, 3, 3, 2, 3, 0, 3]])
    assert topk_indices(x, 3).tolist() == [[1, 2, 4]]
    assert topk_indices(torch.tensor([[0.0, float("nan"), 5, float("nan")]]), 3).tolist() == [[1, 3, 2]]
    g = Graph()
    v, i = g.topk(g.input("x", (1, 7), "f32"), 3)
    g.output(v, i)
    values, index = evaluate(g, [x])
    assert index.tolist() == [[1, 2, 4]] and values.tolist() == [[3.0, 3.0, 3.0]]
    theirs = torch.topk(x, 3).indices  # whatever order torch's CPU topk picks among the tied threes
    assert same_choice(x, theirs, index) and not same_choice(x, torch.tensor([[1, 2, 3]]), index)


def test_builders_check_k_and_the_last_axis():
    g = Graph()
    x = g.input("x", ("tokens", 8), "f32")
    with pytest.raises(ShapeError, match="k=9"):
        g.topk(x, 9)
    with pytest.raises(ShapeError, match="last axis must be static"):
        g.topk(g.input("y", (8, "tokens"), "f32"), 2)
    with pytest.raises(ShapeError, match="bias"):
        g.route(x, 2, g.input("b", (7,), "f32"))
    with pytest.raises(ValueError, match="score"):
        RouteArgs(2, "relu")
    w, i = g.route(x, 2, renorm="sum")
    assert w.arg.choice == i.arg.choice and i.arg.renorm == "none"  # the twins share the choice


@pytest.mark.parametrize("dim, largest", [(-1, True), (0, True), (1, False)])
def test_torch_topk_is_traced_on_any_axis_and_smallest(dim, largest):
    fn = lambda x: torch.topk(x, 3, dim=dim, largest=largest)  # noqa: E731
    x = torch.randn(5, 6, 7)
    g = trace(fn, x)
    verify(g)
    assert any(n.op is Op.TOPK for n in g.nodes)
    values, index = evaluate(g, [x])
    want = fn(x)
    assert torch.equal(values, want.values) and torch.equal(index, want.indices)


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "none"])
@pytest.mark.parametrize("renorm", ["none", "sum", "softmax"])
def test_route_reference_is_the_eager_router(score, renorm):
    gen = torch.Generator().manual_seed(0)
    x, bias = torch.randn(6, 10, generator=gen), torch.randn(10, generator=gen) * 0.1
    g = Graph()
    w, i = g.route(g.input("x", (6, 10), "f32"), 4, g.input("b", (10,), "f32"), score=score, renorm=renorm)
    g.output(w, i)
    verify(g)
    got_w, got_i = evaluate(g, [x, bias])
    s = {"softmax": x.softmax(-1), "sigmoid": x.sigmoid(), "none": x}[score]
    index = torch.topk(s + bias, 4).indices
    want = s.gather(-1, index)
    want = {"none": want, "sum": want / want.sum(-1, keepdim=True), "softmax": want.softmax(-1)}[renorm]
    assert torch.equal(got_i, index)
    torch.testing.assert_close(got_w, want)
