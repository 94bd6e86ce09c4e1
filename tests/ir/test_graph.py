"""The graph builder: shape/dtype checks that name both operands, canonicalisations and hash-consing."""

from __future__ import annotations

import math

import pytest
import torch

from kernelize.ir import DType, DTypeError, Graph, Op, ShapeError, Sym, evaluate
from kernelize.ir.ops import ClampArgs


@pytest.fixture
def g():
    return Graph()


def test_binary_shape_error_names_both_shapes(g):
    a, b = g.input("a", (2, 3), "f32"), g.input("b", (4,), "f32")
    with pytest.raises(ShapeError, match=r"\[2, 3\] and \[4\] do not broadcast"):
        g.add(a, b)


def test_binary_dtype_error_names_both_operands(g):
    a, b = g.input("a", (2,), "f32"), g.input("b", (2,), "f16")
    with pytest.raises(
        DTypeError, match=r"add of Node\(input, f32\[2\]\) and Node\(input, f16\[2\]\): dtypes differ"
    ):
        g.add(a, b)


@pytest.mark.parametrize(
    "build,err,match",
    [
        (
            lambda g, a, b, i: g.matmul(a, b),
            ShapeError,
            r"matmul of \[2, 3\] and \[4, 5\]: inner dims 3 and 4",
        ),
        (
            lambda g, a, b, i: g.matmul(a, g.cast(g.transpose(a), "f16")),
            DTypeError,
            "matmul of .*f32.*f16.*dtypes differ",
        ),
        (lambda g, a, b, i: g.concat([a, b], 0), ShapeError, r"\[2, 3\] and \[4, 5\] differ off that axis"),
        (lambda g, a, b, i: g.where(a, a, a), DTypeError, "where condition must be bool"),
        (lambda g, a, b, i: g.exp(i), DTypeError, "exp needs a floating operand"),
        (lambda g, a, b, i: g.gather(a, a), DTypeError, "gather index must be an integer"),
        (
            lambda g, a, b, i: g.view(a, (4, 2)),
            ShapeError,
            r"cannot view \[2, 3\] \(6 elements\) as \[4, 2\]",
        ),
        (
            lambda g, a, b, i: g.layernorm(a, g.input("w", (2,), "f32")),
            ShapeError,
            r"norm parameter \[2\] must have shape \[3\]",
        ),
        (lambda g, a, b, i: g.permute(a, (0, 0)), ShapeError, "not a permutation"),
        (lambda g, a, b, i: g.broadcast(b, (4, 7)), ShapeError, r"cannot broadcast \[4, 5\] to \[4, 7\]"),
        (
            lambda g, a, b, i: g.conv(g.view(a, (1, 1, 2, 3)), g.view(b, (1, 2, 2, 5))),
            ShapeError,
            "do not fit groups",
        ),
    ],
)
def test_builder_rejects_bad_operands(g, build, err, match):
    a, b = g.input("a", (2, 3), "f32"), g.input("b", (4, 5), "f32")
    i = g.input("i", (3,), "i64")
    with pytest.raises(err, match=match):
        build(g, a, b, i)


@pytest.mark.parametrize(
    "build",
    [
        lambda g, x: g.add(x, 0),
        lambda g, x: g.add(0.0, x),
        lambda g, x: g.sub(x, 0),
        lambda g, x: g.mul(x, 1),
        lambda g, x: g.mul(1, x),
        lambda g, x: g.div(x, 1.0),
        lambda g, x: g.add(x, g.const(torch.zeros(3))),
        lambda g, x: g.cast(x, "f32"),
        lambda g, x: g.clamp(x),
        lambda g, x: g.view(x, (2, 3)),
        lambda g, x: g.permute(x, (0, 1)),
        lambda g, x: g.slice(x, 1, 0, None),
        lambda g, x: g.slice(x, 0, 0, 99),
        lambda g, x: g.broadcast(x, (2, 3)),
        lambda g, x: g.flip(g.view(x, (1, 6)), (0,)) and x,
        lambda g, x: g.pad(x, [(0, 0), (0, 0)]),
        lambda g, x: g.concat([x], 0),
    ],
    ids=[
        "x+0",
        "0+x",
        "x-0",
        "x*1",
        "1*x",
        "x/1",
        "x+zeros",
        "cast_same",
        "clamp_inf",
        "view_same",
        "permute_id",
        "slice_full",
        "slice_past_end",
        "broadcast_same",
        "flip_unit",
        "pad_zero",
        "concat_one",
    ],
)
def test_canonicalisations_return_the_operand(g, build):
    x = g.input("x", (2, 3), "f32")
    n = len(g)
    assert build(g, x) is x
    assert all(node.op in (Op.CONST, Op.VIEW) for node in g.nodes[n:])  # only scalars / unit views were added


def test_identities_that_would_change_the_shape_are_kept(g):
    x = g.input("x", (3,), "f32")
    y = g.mul(x, g.const(torch.ones(2, 3)))
    assert y.op is Op.MUL and y.shape == (2, 3)
    assert g.sub(0.0, x).op is Op.SUB
    b = g.input("b", (3,), "bool")
    assert g.or_(b, False).op is Op.OR  # bool ops are not arithmetic identities


def test_view_of_view_and_permute_of_permute_collapse(g):
    x = g.input("x", (2, 3, 4), "f32")
    v = g.view(g.view(x, (6, 4)), (24,))
    assert v.op is Op.VIEW and v.src == (x,)
    p = g.permute(g.permute(x, (1, 2, 0)), (2, 0, 1))
    assert p is x  # the two permutations cancel
    q = g.permute(g.permute(x, (1, 0, 2)), (0, 2, 1))
    assert q.op is Op.PERMUTE and q.src == (x,) and q.arg == (1, 2, 0)
    want = torch.randn(2, 3, 4)
    g.output(v, q)
    got_v, got_q = evaluate(g, [want])
    torch.testing.assert_close(got_q, want.permute(1, 0, 2).permute(0, 2, 1))
    torch.testing.assert_close(got_v, want.reshape(24))


def test_broadcast_of_broadcast_is_one_broadcast(g):
    x = g.input("x", (1, 3), "f32")
    y = g.broadcast(g.broadcast(x, (2, 3)), (5, 2, 3))
    assert y.op is Op.BROADCAST and y.src[0].op is Op.VIEW and y.src[0].src == (x,)
    z = g.broadcast(g.broadcast(x, (2, 3)), (2, 3))
    assert z.op is Op.BROADCAST and z.src == (x,)
    g.output(y)
    torch.testing.assert_close(evaluate(g, [torch.arange(3.0)[None]])[0], torch.arange(3.0).expand(5, 2, 3))


def test_hash_consing_shares_equal_values_but_not_inputs(g):
    x = g.input("x", (4,), "f32")
    assert g.exp(x) is g.exp(x)
    assert g.add(x, 2.0) is g.add(x, 2.0)
    assert g.const(torch.arange(3.0)) is g.const(torch.arange(3.0))
    y = g.input("y", (4,), "f32")
    assert y is not x
    with pytest.raises(ValueError, match="already has an input named 'x'"):
        g.input("x", (4,), "f32")


def test_scalars_take_the_other_operands_dtype(g):
    h = g.input("h", (2,), "f16")
    y = g.mul(h, 0.5)
    assert y.dtype is DType.F16 and y.src[1].dtype is DType.F16


def test_symbolic_shapes(g):
    b, s = Sym.of("batch"), Sym.of("seq")
    x = g.input("x", ("batch", "seq", 8), "f32")
    assert x.shape == (b, s, 8)
    flat = g.view(x, (-1, 8))
    assert flat.shape == (b * s, 8)
    assert g.view(flat, (b, -1)).shape == (b, s * 8)
    assert g.slice(x, 0) is x
    with pytest.raises(ShapeError, match="cannot slice symbolic dimension batch"):
        g.slice(x, 0, 1)
    with pytest.raises(ShapeError, match="do not broadcast"):
        g.add(x, g.input("y", ("seq", "batch", 8), "f32"))


def test_reductions_keep_axes_and_views_drop_them(g):
    x = g.input("x", (2, 3, 4), "f32")
    r = g.reduce(Op.SUM, x, (-1, 0))
    assert r.op is Op.VIEW and r.shape == (3,) and r.src[0].shape == (1, 3, 1) and r.src[0].arg == (0, 2)
    assert g.reduce(Op.ARGMAX, x, 1, keepdim=True).dtype is DType.I64
    with pytest.raises(ShapeError, match="reduces exactly one axis"):
        g.reduce(Op.ARGMAX, x, (0, 1))


def test_clamp_and_gelu_arguments(g):
    x = g.input("x", (3,), "f32")
    assert g.clamp(x, 0.0).arg == ClampArgs(0.0, math.inf)
    with pytest.raises(ValueError, match="approximate"):
        g.gelu(x, "fast")
