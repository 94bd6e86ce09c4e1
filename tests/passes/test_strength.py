"""Strength reduction: division by constants and small powers."""

from __future__ import annotations

import pytest
import torch

from kernelize.ir import Graph, Op, evaluate, verify
from kernelize.passes import dce, strength


def run(build, dtype="f32", shape=(3, 4)):
    g = Graph()
    x = g.input("x", shape, dtype)
    g.output(build(g, x))
    out = dce(strength(g))
    verify(out)
    return g, out


def ops(g):
    return [n.op for n in g.nodes if n.op not in (Op.INPUT, Op.CONST, Op.VIEW, Op.BROADCAST)]


def test_division_by_scalar_becomes_multiplication():
    g, out = run(lambda g, x: g.div(x, 8.0))
    assert ops(out) == [Op.MUL]
    t = torch.randn(3, 4)
    torch.testing.assert_close(evaluate(out, [t])[0], t / 8.0)


def test_division_by_a_constant_tensor_and_by_zero():
    w = torch.tensor([1.0, -2.0, 0.5, 0.0])
    g, out = run(lambda g, x: g.div(x, g.const(w)))
    assert ops(out) == [Op.MUL]
    t = torch.randn(3, 4)
    t[0, 3] = 0.0
    torch.testing.assert_close(evaluate(out, [t])[0], t / w, equal_nan=True)


def test_integer_division_and_division_by_variables_stay():
    _, out = run(lambda g, x: g.div(x, 2), dtype="i32")
    assert ops(out) == [Op.DIV]
    _, out = run(lambda g, x: g.div(x, g.exp(x)))
    assert ops(out) == [Op.EXP, Op.DIV]


@pytest.mark.parametrize(
    "e,want",
    [
        (2.0, [Op.MUL]),
        (3.0, [Op.MUL, Op.MUL]),
        (4.0, [Op.MUL, Op.MUL]),
        (-1.0, [Op.RECIPROCAL]),
        (-2.0, [Op.MUL, Op.RECIPROCAL]),
        (1.0, []),
        (0.5, [Op.POW]),
        (2.5, [Op.POW]),
    ],
)
def test_small_powers(e, want):
    g, out = run(lambda g, x: g.pow(x, e))
    assert ops(out) == want
    t = torch.randn(3, 4)
    torch.testing.assert_close(evaluate(out, [t])[0], evaluate(g, [t])[0], equal_nan=True)


@pytest.mark.parametrize("e", [0.75, 1.5])
def test_three_quarter_and_three_half_powers_are_square_roots(e):
    """x ** 0.75 and x ** 1.5 as square roots, equal to torch.pow within an ulp or two, and exactly so at
    +-0 (sign included), +-inf, below 0 and NaN; 0.25 stays (its root gives -0 for -0)."""
    g, out = run(lambda g, x: g.pow(x, e), shape=(36,))
    assert Op.POW not in ops(out) and Op.SQRT in ops(out)
    t = torch.cat(
        [torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -2.0]), torch.rand(30) * 9]
    )
    got, want = evaluate(out, [t])[0], torch.pow(t, e)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got[:2]), torch.signbit(want[:2]))
    assert ops(run(lambda g, x: g.pow(x, 0.25))[1]) == [Op.POW]


@pytest.mark.parametrize("c", [1e-45, 3e38, -1e-40])
def test_division_whose_reciprocal_is_not_normal_stays(c):
    g, out = run(lambda g, x: g.div(x, c))
    assert ops(out) == [Op.DIV]
    t = torch.tensor([[0.0, 1.0, -2.0, 3e-39]] * 3)
    torch.testing.assert_close(evaluate(out, [t])[0], t / torch.tensor(c), equal_nan=True)


def test_16_bit_division_multiplies_by_an_f32_reciprocal():
    g, out = run(lambda g, x: g.div(x, 3.0), dtype="f16")
    assert ops(out) == [Op.CAST, Op.MUL, Op.CAST] and out.nodes[-1].src[0].dtype == "f32"
    t = (torch.randn(3, 4) * 100).half()
    torch.testing.assert_close(evaluate(out, [t])[0], t / 3.0, rtol=1e-3, atol=0)
