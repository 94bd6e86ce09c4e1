"""verify(): well-formed graphs pass; each kind of broken graph is reported naming the node and problem."""

from __future__ import annotations

import math

import pytest
import torch

from kernelize import ir
from kernelize.ir import DType, Graph, Op, Sym, VerifyError, verify
from kernelize.ir.graph import Constant
from kernelize.ir.ops import ClampArgs, NormArgs, PadArgs


def base() -> tuple[Graph, ir.Node, ir.Node]:
    g = Graph()
    x = g.input("x", ("batch", 4), "f32")
    y = g.input("y", ("batch", 4), "f32")
    return g, x, y


def test_builder_made_graphs_verify():
    g, x, y = base()
    h = g.matmul(g.layernorm(g.add(x, y), eps=1e-5), g.const(torch.randn(4, 3)))
    r = g.reduce(Op.MEAN, g.gelu(h, "tanh"), -1)
    s = g.concat([g.slice(g.softmax(h), 1, 0, 2), g.pad(g.clamp(h, 0.0), [(0, 0), (1, 0)])], 1)
    w = g.where(g.gt(h, 0), h, g.neg(h))
    pooled = g.pool(g.view(g.const(torch.randn(1, 2, 5, 5)), (1, 2, 5, 5)), "avg", (2, 2))
    conv = g.conv(g.const(torch.randn(1, 2, 5, 5)), g.const(torch.randn(3, 2, 3, 3)), padding=(1, 1, 1, 1))
    g.output(r, s, w, pooled, conv, g.gather(h, g.const(torch.tensor([0, 2])), 1), g.flip(h, (0,)))
    verify(g)


@pytest.mark.parametrize("traced", ["layernorm", "linear"])
def test_traced_graphs_verify(traced):
    layer = torch.nn.LayerNorm(8) if traced == "layernorm" else torch.nn.Linear(8, 3)
    verify(ir.trace(layer, torch.randn(2, 5, 8), dynamic_dims={0: "b"}))


def expect(g: Graph, *fragments: str) -> str:
    with pytest.raises(VerifyError) as err:
        verify(g)
    msg = str(err.value)
    for f in fragments:
        assert f in msg, msg
    return msg


def test_wrong_result_shape_names_node_and_rule():
    g, x, y = base()
    g.output(g.push(Op.ADD, DType.F32, (x.shape[0], 5), (x, y)))
    expect(g, "%2 = add(%0, %1) : f32[batch, 5]", "should be f32[batch, 4] by the add rule")


def test_wrong_result_dtype():
    g, x, y = base()
    g.output(g.push(Op.LT, DType.F32, x.shape, (x, y)))
    expect(g, "%2 = lt(%0, %1)", "should be bool[batch, 4]")


def test_operand_dtypes_must_agree():
    g, x, _ = base()
    h = g.input("h", x.shape, "f16")
    g.output(g.push(Op.MUL, DType.F32, x.shape, (x, h)))
    expect(g, "%3 = mul(%0, %2)", "breaks the mul rule", "dtypes differ")


def test_elementwise_operands_must_be_broadcast_explicitly():
    g, x, _ = base()
    b = g.const(torch.ones(4))
    g.output(g.push(Op.ADD, DType.F32, x.shape, (x, b)))
    expect(g, "operand 1 has shape [4], not the result shape [batch, 4]")


def test_use_before_definition():
    g, x, y = base()
    e = g.exp(x)
    n = g.neg(e)
    g.output(n)
    g.nodes[2], g.nodes[3] = g.nodes[3], g.nodes[2]  # corrupt the order
    g._index[n], g._index[e] = 2, 3
    expect(g, "%2 = neg(%3)", "uses %3 before it is defined")


def test_bad_reduce_axes_and_row_axis():
    g, x, _ = base()
    g.output(g.push(Op.SUM, DType.F32, (1, 4), (x,), (0, 0)), g.push(Op.SOFTMAX, DType.F32, x.shape, (x,), 5))
    expect(g, "axes (0, 0) must be a sorted tuple", "axis 5 is not an axis")


def test_unbound_symbol_and_bad_dims():
    g, x, _ = base()
    c = g.push(Op.BROADCAST, DType.F32, (Sym.of("seq"), 4), (g.view(g.const(torch.ones(4)), (1, 4)),))
    g.output(c, g.push(Op.VIEW, DType.F32, (-1, 4), (x,)))
    expect(g, "symbolic dims ['seq'] are bound by no graph input", "neither a size >= 0 nor a Sym")


def test_inputs_and_outputs_bookkeeping():
    g, x, y = base()
    other = Graph()
    stray = other.input("z", (4,), "f32")
    g.outputs.append(stray)
    g.inputs.append(g.inputs[0])
    expect(
        g, "input names ['x'] are used more than once", "output 0 (Node(input, f32[4])) is not in graph.nodes"
    )


def test_input_node_missing_from_inputs_and_const_payload():
    g, x, _ = base()
    g.inputs.pop()
    g.push(Op.CONST, DType.F32, (3,), (), Constant(torch.zeros(2)))
    expect(g, "%1 = input 'y'", "missing from graph.inputs", "payload is torch.float32[2]")


@pytest.mark.parametrize(
    "node,fragment",
    [
        (
            lambda g, x: g.push(Op.MATMUL, DType.F32, (1, 4, 4), (x, g.view(x, (1, 4, 4)))),
            "must have rank >= 2 and equal",
        ),
        (
            lambda g, x: g.push(Op.SLICE, DType.F32, (4, 4), (x,), ((0, 4, 1), (2, 9, 1))),
            "does not fit dim 4",
        ),
        (lambda g, x: g.push(Op.CLAMP, DType.F32, (4, 4), (x,), (0.0, 1.0)), "must be ClampArgs"),
        (lambda g, x: g.push(Op.CLAMP, DType.F32, (4, 4), (x,), ClampArgs(math.nan)), "two numbers"),
        (
            lambda g, x: g.push(Op.LAYERNORM, DType.F32, (4, 4), (x,), NormArgs(1e-5, True, False)),
            "takes 2 operands, has 1",
        ),
        (lambda g, x: g.push(Op.LAYERNORM, DType.F32, (4, 4), (x,), (1e-5, False, False)), "is not NormArgs"),
        (lambda g, x: g.push(Op.RMSNORM, DType.F32, (4, 4), (x, x), NormArgs(1e-5, False, True)), "no bias"),
        (lambda g, x: g.push(Op.BROADCAST, DType.F32, (2, 4, 4), (x,)), "broadcasts rank 2 to rank 3"),
        (lambda g, x: g.push(Op.CONV, DType.F32, (4, 4), (x, x), ((1, 1), (0,) * 4, (1, 1))), "not ConvArgs"),
        (lambda g, x: g.push(Op.POOL, DType.F32, (4, 4), (x,), ("max", (2, 2), (2, 2))), "not PoolArgs"),
        (lambda g, x: g.push(Op.CONCAT, DType.F32, (4, 4), (x,), 0), "concat of 1 operand"),
        (lambda g, x: g.push(Op.PAD, DType.F32, (3, 4), (x,), PadArgs(((0, -1), (0, 0)))), "negative pads"),
        (lambda g, x: g.push(Op.PAD, DType.F32, (3, 4), (x,), (((0, 1), (0, 0)), 0.0)), "not PadArgs"),
        (lambda g, x: g.push(Op.EXP, DType.I32, (4, 4), (g.cast(x, "i32"),)), "exp needs a floating operand"),
        (lambda g, x: g.push(Op.PERMUTE, DType.F32, (4, 4), (x,), (0, 0)), "not a permutation"),
        (lambda g, x: g.push(Op.GELU, DType.F32, (4, 4), (x,), "fast"), "approximate"),
    ],
)
def test_op_rules(node, fragment):
    g = Graph()
    x = g.input("x", (4, 4), "f32")
    g.output(node(g, x))
    expect(g, fragment)


def test_many_problems_are_listed_then_cut():
    g, x, y = base()
    for k in range(30):
        g.push(Op.ADD, DType.F32, (x.shape[0], 5 + k), (x, y))
    msg = expect(g, "graph fails verification (30 problems)", "... and 10 more")
    assert msg.count("should be") == 20
