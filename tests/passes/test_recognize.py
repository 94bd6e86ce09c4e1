"""Recognition of layernorm / rmsnorm / softmax / log_softmax / gelu from hand-built templates."""

from __future__ import annotations

import math

import pytest
import torch

from kernelize.ir import Graph, Op, evaluate, verify
from kernelize.passes import dce, recognize


def recognized(g: Graph, *inputs: torch.Tensor, tol: float = 1e-5) -> list[Op]:
    out = dce(recognize(g))
    verify(out)
    for want, got in zip(evaluate(g, list(inputs)), evaluate(out, list(inputs))):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return [n.op for n in out.nodes if n.op not in (Op.INPUT, Op.CONST, Op.VIEW, Op.BROADCAST)]


def new(shape=(3, 8), dtype="f32"):
    g = Graph()
    return g, g.input("x", shape, dtype)


def mean_last(g, v):
    return g.reduce(Op.MEAN, v, -1, keepdim=True)


@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("norm", ["rsqrt", "div_sqrt", "recip_sqrt", "sum_over_n", "sum_div_n"])
def test_rmsnorm_templates(square, norm):
    g, x = new()
    sq = g.pow(x, 2.0) if square == "pow" else g.mul(x, x)
    total = g.reduce(Op.SUM, sq, -1, keepdim=True)
    ms = {"sum_over_n": lambda: g.mul(1 / 8, total), "sum_div_n": lambda: g.div(total, 8.0)}.get(
        norm, lambda: None
    )()
    ms = ms or mean_last(g, sq)
    den = g.add(ms, 1e-6)
    y = {
        "rsqrt": lambda: g.mul(g.rsqrt(den), x),
        "div_sqrt": lambda: g.div(x, g.sqrt(den)),
        "recip_sqrt": lambda: g.mul(x, g.reciprocal(g.sqrt(den))),
        "sum_over_n": lambda: g.mul(x, g.rsqrt(den)),
        "sum_div_n": lambda: g.mul(x, g.rsqrt(den)),
    }[norm]()
    w = g.const(torch.randn(8))
    g.output(g.mul(w, y))
    assert recognized(g, torch.randn(3, 8)) == [Op.RMSNORM]


def test_rmsnorm_weight_is_not_absorbed_when_the_plain_norm_is_also_used():
    g, x = new()
    y = g.mul(x, g.rsqrt(g.add(mean_last(g, g.mul(x, x)), 1e-6)))
    g.output(g.mul(y, g.const(torch.randn(8))), y)
    assert recognized(g, torch.randn(3, 8)) == [Op.RMSNORM, Op.MUL]


def test_near_misses_are_left_alone():
    g, x = new()
    eps = g.input("eps", (3, 1), "f32")
    wrong_axis = g.mul(x, g.rsqrt(g.add(g.reduce(Op.MEAN, g.mul(x, x), 0, keepdim=True), 1e-6)))
    var_eps = g.mul(x, g.rsqrt(g.add(mean_last(g, g.mul(x, x)), eps)))
    other = g.mul(x, g.rsqrt(g.add(mean_last(g, g.mul(g.exp(x), g.exp(x))), 1e-6)))
    g.output(wrong_axis, var_eps, other)
    ops = recognized(g, torch.randn(3, 8), torch.rand(3, 1))
    assert Op.RMSNORM not in ops


@pytest.mark.parametrize("params", ["none", "weight", "weight_bias", "bias"])
def test_layernorm_template_and_parameters(params):
    g, x = new((2, 3, 8))
    d = g.sub(x, mean_last(g, x))
    y = g.div(d, g.sqrt(g.add(mean_last(g, g.pow(d, 2.0)), 1e-5)))
    if "weight" in params:
        y = g.mul(y, g.const(torch.randn(8)))
    if "bias" in params:
        y = g.add(g.const(torch.randn(8)), y)
    g.output(y)
    assert recognized(g, torch.randn(2, 3, 8), tol=1e-4) == [Op.LAYERNORM]
    (ln,) = [n for n in dce(recognize(g)).nodes if n.op is Op.LAYERNORM]
    assert (ln.arg.has_weight, ln.arg.has_bias) == ("weight" in params, "bias" in params)


@pytest.mark.parametrize("shared", ["rstd", "mean"])
def test_norm_whose_statistics_are_also_outputs_stays_decomposed(shared):
    """A training forward saves a norm's statistics for backward: fusing the norm would compute them twice."""
    g, x = new()
    m = mean_last(g, x)
    d = g.sub(x, m)
    r = g.rsqrt(g.add(mean_last(g, g.mul(d, d)), 1e-5))
    g.output(g.mul(d, r), r if shared == "rstd" else m)
    assert Op.LAYERNORM not in recognized(g, torch.randn(3, 8))
    g2, x2 = new()
    r2 = g2.rsqrt(g2.add(mean_last(g2, g2.mul(x2, x2)), 1e-6))
    g2.output(g2.mul(x2, r2), r2)
    assert Op.RMSNORM not in recognized(g2, torch.randn(3, 8))


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("form", ["shifted", "plain", "reciprocal"])
def test_softmax_templates(axis, form):
    g, x = new((3, 4, 5))
    d = g.sub(x, g.reduce(Op.REDUCE_MAX, x, axis, keepdim=True)) if form != "plain" else x
    e = g.exp(d)
    s = g.reduce(Op.SUM, e, axis, keepdim=True)
    g.output(g.mul(e, g.reciprocal(s)) if form == "reciprocal" else g.div(e, s))
    assert recognized(g, torch.randn(3, 4, 5)) == [Op.SOFTMAX]
    (sm,) = [n for n in dce(recognize(g)).nodes if n.op is Op.SOFTMAX]
    assert sm.arg == axis % 3 and sm.src[0].op is Op.INPUT


def test_sum_over_two_axes_is_not_a_softmax():
    g, x = new()
    e = g.exp(x)
    g.output(g.div(e, g.reduce(Op.SUM, e, None, keepdim=True)))
    assert Op.SOFTMAX not in recognized(g, torch.randn(3, 8))


def test_log_softmax_templates():
    g, x = new()
    d = g.sub(x, g.reduce(Op.REDUCE_MAX, x, -1, keepdim=True))
    a = g.sub(d, g.log(g.reduce(Op.SUM, g.exp(d), -1, keepdim=True)))
    b = g.log(g.softmax(x, 0))
    g.output(a, b)
    assert recognized(g, torch.randn(3, 8)) == [Op.LOG_SOFTMAX, Op.LOG_SOFTMAX]


SQRT_HALF, K = math.sqrt(0.5), math.sqrt(2 / math.pi)
GELUS = {
    "erf_textbook": lambda g, x: g.mul(g.mul(x, 0.5), g.add(g.erf(g.div(x, math.sqrt(2))), 1.0)),
    "erf_torch_decomp": lambda g, x: g.mul(x, g.mul(g.add(g.erf(g.mul(x, SQRT_HALF)), 1.0), 0.5)),
    "erf_expanded": lambda g, x: g.add(g.mul(x, 0.5), g.mul(g.mul(0.5, x), g.erf(g.mul(SQRT_HALF, x)))),
    "tanh_pow": lambda g, x: g.mul(
        g.mul(0.5, x), g.add(1.0, g.tanh(g.mul(K, g.add(x, g.mul(0.044715, g.pow(x, 3.0))))))
    ),
    "tanh_cube_expanded": lambda g, x: g.mul(
        x, g.add(0.5, g.mul(0.5, g.tanh(g.add(g.mul(x, K), g.mul(g.mul(g.mul(x, x), x), K * 0.044715)))))
    ),
}


@pytest.mark.parametrize("name", sorted(GELUS))
def test_gelu_in_any_association_order(name):
    g, x = new()
    g.output(GELUS[name](g, x))
    assert recognized(g, torch.randn(3, 8) * 3) == [Op.GELU]
    (gelu,) = [n for n in dce(recognize(g)).nodes if n.op is Op.GELU]
    assert gelu.arg == ("tanh" if name.startswith("tanh") else "none")


def test_gelu_with_wrong_constants_or_operands_is_left_alone():
    g, x = new()
    y = g.input("y", (3, 8), "f32")
    wrong_half = g.mul(g.mul(x, 0.6), g.add(g.erf(g.mul(x, SQRT_HALF)), 1.0))
    wrong_inner = g.mul(g.mul(x, 0.5), g.add(g.erf(g.mul(x, 0.8)), 1.0))
    two_vars = g.mul(g.mul(x, 0.5), g.add(g.erf(g.mul(y, SQRT_HALF)), 1.0))
    g.output(wrong_half, wrong_inner, two_vars)
    assert Op.GELU not in recognized(g, torch.randn(3, 8), torch.randn(3, 8))


def test_silu_is_not_recognised_as_anything():
    g, x = new()
    g.output(g.mul(x, g.sigmoid(x)))
    assert recognized(g, torch.randn(3, 8)) == [Op.SIGMOID, Op.MUL]


@pytest.mark.parametrize("lo", ["f16", "bf16"])
def test_half_sandwich_becomes_a_half_op(lo):
    g, x = new(dtype=lo)
    w = g.const(torch.randn(8).to(getattr(torch, {"f16": "float16", "bf16": "bfloat16"}[lo])))
    xf, wf = g.cast(x, "f32"), g.cast(w, "f32")
    g.output(g.cast(g.rmsnorm(xf, wf, 1e-6), lo), g.cast(g.softmax(xf), lo), g.cast(g.gelu(xf, "tanh"), lo))
    t = torch.randn(3, 8).to(w.arg.tensor.dtype)
    assert recognized(g, t, tol=1e-2) == [Op.RMSNORM, Op.SOFTMAX, Op.GELU]
    assert all(n.dtype == lo for n in dce(recognize(g)).nodes if n.op is not Op.INPUT)


def test_f32_through_f64_is_not_narrowed():
    g, x = new()
    g.output(g.cast(g.softmax(g.cast(x, "f64")), "f32"))
    assert recognized(g, torch.randn(3, 8)) == [Op.CAST, Op.SOFTMAX, Op.CAST]
