"""Affine fusion: scale/bias chains, batch norm, and folding into conv/matmul weights."""

from __future__ import annotations

import torch

from kernelize.ir import Graph, Op, evaluate, verify
from kernelize.passes import affine, dce, fold


def fused(g: Graph, *inputs: torch.Tensor, tol: float = 1e-5) -> list[Op]:
    """Run affine (+ fold, dce), check values, return the non-constant, non-layout ops left."""
    out = dce(fold(affine(fold(g))))
    verify(out)
    for want, got in zip(evaluate(g, list(inputs)), evaluate(out, list(inputs))):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return [n.op for n in out.nodes if n.op not in (Op.INPUT, Op.CONST, Op.VIEW, Op.BROADCAST)]


def test_scale_and_bias_chains_collapse():
    g = Graph()
    x = g.input("x", (2, 3, 4), "f32")
    v = g.const(torch.rand(4) + 0.5)
    y = g.add(g.sub(g.mul(g.mul(g.add(x, 1.0), 2.0), v), g.const(torch.randn(3, 1))), 0.25)
    g.output(y)
    assert fused(g, torch.randn(2, 3, 4)) == [Op.MUL, Op.ADD]


def test_batchnorm_becomes_one_scale_and_bias():
    g = Graph()
    x = g.input("x", (2, 3, 5, 5), "f32")

    def ch(t):
        return g.view(g.const(t), (3, 1, 1))

    mean, var, w, b = torch.randn(3), torch.rand(3) + 0.5, torch.randn(3), torch.randn(3)
    y = g.add(g.mul(g.mul(g.sub(x, ch(mean)), g.rsqrt(g.add(ch(var), 1e-5))), ch(w)), ch(b))
    g.output(y)
    assert fused(g, torch.randn(2, 3, 5, 5)) == [Op.MUL, Op.ADD]


def test_distribution_waits_when_the_sum_has_other_users():
    g = Graph()
    x = g.input("x", (4,), "f32")
    s = g.add(x, 1.0)
    g.output(g.mul(s, 3.0), g.exp(s))
    assert fused(g, torch.randn(4)) == [Op.ADD, Op.MUL, Op.EXP]


def test_conv_batchnorm_folds_into_the_conv_weight():
    g = Graph()
    x = g.input("x", ("n", 3, 6, 6), "f32")
    w, bias = torch.randn(4, 3, 3, 3), torch.randn(4)
    y = g.conv(x, g.const(w), g.const(bias), padding=(1, 1, 1, 1))
    scale, shift = g.const(torch.rand(4, 1, 1) + 0.5), g.const(torch.randn(4, 1, 1))
    g.output(g.add(g.mul(g.sub(y, shift), scale), 0.5))
    assert fused(g, torch.randn(2, 3, 6, 6), tol=1e-4) == [Op.CONV, Op.ADD]


def test_input_channel_scale_folds_into_a_grouped_conv():
    g = Graph()
    x = g.input("x", (1, 4, 5, 5), "f32")
    s = g.const(torch.rand(4, 1, 1) + 0.5)
    g.output(g.conv(g.mul(x, s), g.const(torch.randn(6, 2, 3, 3)), groups=2, padding=(1, 1, 1, 1)))
    assert fused(g, torch.randn(1, 4, 5, 5), tol=1e-4) == [Op.CONV]


def test_output_scale_folds_into_matmul_weight_through_views():
    g = Graph()
    x = g.input("x", ("b", "s", 8), "f32")
    h = g.view(g.matmul(g.view(x, (-1, 8)), g.const(torch.randn(8, 5))), (x.shape[0], x.shape[1], 5))
    g.output(g.mul(h, g.const(torch.randn(5))))
    assert fused(g, torch.randn(2, 3, 8)) == [Op.MATMUL]


def test_row_varying_scale_is_not_a_weight_scale():
    g = Graph()
    x = g.input("x", (3, 8), "f32")
    g.output(g.mul(g.matmul(x, g.const(torch.randn(8, 5))), g.const(torch.randn(3, 1))))
    assert fused(g, torch.randn(3, 8)) == [Op.MATMUL, Op.MUL]


def test_input_scale_and_bias_fold_into_matmul():
    g = Graph()
    x = g.input("x", (2, 3, 8), "f32")
    w = g.const(torch.randn(8, 5))
    scaled = g.matmul(g.mul(x, g.const(torch.randn(8))), w)
    shifted = g.matmul(g.add(x, g.const(torch.randn(8))), w)
    g.output(scaled, shifted)
    assert fused(g, torch.randn(2, 3, 8), tol=1e-4) == [Op.MATMUL, Op.MATMUL, Op.ADD]


def test_shared_matmul_is_not_duplicated():
    g = Graph()
    x = g.input("x", (3, 8), "f32")
    h = g.matmul(x, g.const(torch.randn(8, 5)))
    g.output(g.mul(h, 2.0), g.exp(h))
    assert fused(g, torch.randn(3, 8)) == [Op.MATMUL, Op.MUL, Op.EXP]


def test_integers_are_left_alone():
    g = Graph()
    x = g.input("x", (4,), "i32")
    g.output(g.mul(g.mul(x, 2), 3))
    assert fused(g, torch.arange(4, dtype=torch.int32)) == [Op.MUL, Op.MUL]
