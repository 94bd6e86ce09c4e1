"""optimize(): settings, output preservation on random graphs (hypothesis), and deep graphs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelize import ir
from kernelize.ir import Graph, Op, evaluate, verify
from kernelize.passes import PIPELINE, OptimizerSettings, optimize

CHECKED = OptimizerSettings(verify=True)
SHAPE = (2, 3, 4)


def test_settings_are_frozen_bools_with_one_switch_per_pass():
    s = OptimizerSettings()
    names = {"dce", "fold", "recognize", "router", "strength", "clamp", "affine", "conv_pad", "conv_matmul"}
    assert {name for name, _ in PIPELINE} == names
    assert all(getattr(s, name) is True for name, _ in PIPELINE) and s.verify is False
    with pytest.raises(AttributeError):
        s.fold = False  # type: ignore[misc]
    with pytest.raises(TypeError, match="OptimizerSettings.clamp must be a bool"):
        OptimizerSettings(clamp="yes")  # type: ignore[arg-type]


def small_graph() -> Graph:
    g = Graph()
    x = g.input("x", (4, 8), "f32")
    g.exp(x)  # dead
    y = g.div(g.max(x, 0.0), 2.0)
    g.output(g.softmax(y))
    return g


@pytest.mark.parametrize(
    "off,kept",
    [
        ("dce", Op.EXP),
        ("strength", Op.DIV),
        ("clamp", Op.MAX),
    ],
)
def test_each_switch_turns_its_pass_off(off, kept):
    on = optimize(small_graph(), CHECKED)
    assert kept not in {n.op for n in on.nodes}
    out = optimize(small_graph(), OptimizerSettings(**{off: False}, verify=True))
    assert kept in {n.op for n in out.nodes}


def test_everything_off_returns_an_equal_graph():
    g = small_graph()
    out = optimize(g, OptimizerSettings(**{name: False for name, _ in PIPELINE}))
    assert ir.format_graph(out) == ir.format_graph(g)


def test_optimize_does_not_modify_its_input():
    g = small_graph()
    before = ir.format_graph(g)
    optimize(g)
    assert ir.format_graph(g) == before


def test_a_2000_node_chain_optimizes_and_verifies_without_recursion():
    g = Graph()
    x = g.input("x", (3, 4), "f32")
    v = x
    for i in range(500):  # 4 nodes per step (+ shared scalars): scales, shifts, clamps and a tanh
        v = g.tanh(g.clamp(g.add(g.mul(v, 1.0 + 1e-3 * i), 0.01), -5.0, 5.0))
    g.output(v)
    assert len(g) > 2000
    out = optimize(g, CHECKED)
    verify(out)
    t = torch.randn(3, 4)
    torch.testing.assert_close(evaluate(out, [t])[0], evaluate(g, [t])[0])


def test_a_deep_affine_chain_collapses():
    g = Graph()
    x = g.input("x", (3, 4), "f32")
    v = x
    for _ in range(2000):
        v = g.add(g.mul(v, 1.0001), 0.001)
    g.output(v)
    out = optimize(g, CHECKED)
    assert sorted(n.op for n in out.nodes if n.op not in (Op.CONST, Op.VIEW, Op.BROADCAST)) == [
        Op.ADD,
        Op.INPUT,
        Op.MUL,
    ]
    t = torch.randn(3, 4)
    torch.testing.assert_close(evaluate(out, [t])[0], evaluate(g, [t])[0], rtol=1e-4, atol=1e-4)


# -- random graphs ------------------------------------------------------------------------------------------
def _unary(g, x, k):
    return [g.neg, g.abs, g.tanh, g.sigmoid, lambda v: g.clamp(v, 0.0), lambda v: g.gelu(v)][k](x)


def _with_const(g, x, k, c):
    vec = g.const(torch.linspace(0.5, 1.5, 4) * c)
    return [
        lambda: g.add(x, c),
        lambda: g.mul(x, c),
        lambda: g.sub(x, c),
        lambda: g.div(x, c),
        lambda: g.max(x, c),
        lambda: g.min(x, c),
        lambda: g.mul(x, vec),
        lambda: g.add(vec, x),
        lambda: g.pow(x, 2.0),
    ][k]()


def _template(g, x, k):
    """Decomposed templates the recognizer should turn into single ops."""
    if k == 0:  # softmax over the last axis
        e = g.exp(g.sub(x, g.reduce(Op.REDUCE_MAX, x, -1, keepdim=True)))
        return g.div(e, g.reduce(Op.SUM, e, -1, keepdim=True))
    if k == 1:  # rmsnorm
        return g.mul(x, g.rsqrt(g.add(g.reduce(Op.MEAN, g.mul(x, x), -1, keepdim=True), 1e-5)))
    if k == 2:  # layernorm
        d = g.sub(x, g.reduce(Op.MEAN, x, -1, keepdim=True))
        return g.div(d, g.sqrt(g.add(g.reduce(Op.MEAN, g.pow(d, 2.0), -1, keepdim=True), 1e-5)))
    if k == 3:  # gelu (erf)
        return g.mul(g.mul(x, 0.5), g.add(g.erf(g.mul(x, math.sqrt(0.5))), 1.0))
    if k == 4:  # a linear layer with a constant weight and bias
        return g.add(g.matmul(x, g.const(torch.randn(4, 4) / 2)), g.const(torch.randn(4)))
    if k == 5:  # a batch-norm-like affine along axis 1
        return g.mul(g.sub(x, g.const(torch.randn(3, 1))), g.const(torch.rand(3, 1) + 0.5))
    # a layout round trip
    return (
        g.view(g.permute(g.view(x, (6, 4)), (1, 0)), SHAPE)
        if k == 6
        else g.permute(g.permute(x, (1, 0, 2)), (1, 0, 2))
    )


@st.composite
def random_graphs(draw):
    g = Graph()
    pool = [g.input("x", SHAPE, "f32"), g.input("y", SHAPE, "f32")]
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["unary", "const", "binary", "template", "reduce"]))
        x = draw(st.sampled_from(pool))
        if kind == "unary":
            v = _unary(g, x, draw(st.integers(0, 5)))
        elif kind == "const":
            c = draw(st.sampled_from([-2.0, -0.5, 0.5, 1.0, 3.0]))
            v = _with_const(g, x, draw(st.integers(0, 8)), c)
        elif kind == "binary":
            y = draw(st.sampled_from(pool))
            v = [g.add, g.sub, g.mul, g.max, g.min][draw(st.integers(0, 4))](x, y)
        elif kind == "template":
            v = _template(g, x, draw(st.integers(0, 7)))
        else:
            axis = draw(st.integers(0, 2))
            v = g.add(
                x, g.reduce(draw(st.sampled_from([Op.SUM, Op.MEAN, Op.REDUCE_MAX])), x, axis, keepdim=True)
            )
        pool.append(g.clamp(v, -50.0, 50.0) if kind == "binary" else v)
    g.output(pool[-1], *draw(st.lists(st.sampled_from(pool), max_size=2)))
    return g


@given(random_graphs(), st.integers(0, 2**16))
def test_optimize_preserves_outputs_of_random_graphs(g, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(SHAPE, generator=gen) for _ in g.inputs]
    out = optimize(g, CHECKED)
    assert len(out) <= len(g)
    for want, got in zip(evaluate(g, inputs), evaluate(out, inputs)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, equal_nan=True)
