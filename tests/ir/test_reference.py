"""The reference executor: input checking with clear errors, symbolic binding, and a few op semantics."""

from __future__ import annotations

import pytest
import torch

from kernelize.ir import Graph, Op, ShapeError, evaluate


@pytest.fixture
def g():
    g = Graph()
    x = g.input("x", ("batch", 4), "f32")
    y = g.input("y", ("batch", 4), "f32")
    g.output(g.add(x, y))
    return g


def test_wrong_input_count_names_the_inputs(g):
    with pytest.raises(ValueError, match=r"graph takes 2 inputs \['x', 'y'\], got 1"):
        evaluate(g, [torch.randn(2, 4)])


def test_wrong_dtype_names_input_and_both_dtypes(g):
    with pytest.raises(TypeError, match=r"input 'y' must have dtype torch.float32, got torch.float64"):
        evaluate(g, [torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64)])


def test_wrong_shape_names_input_and_shapes(g):
    with pytest.raises(ShapeError, match=r"input 'x': expected shape \[batch, 4\]"):
        evaluate(g, [torch.randn(2, 5), torch.randn(2, 5)])
    with pytest.raises(ShapeError, match=r"input 'y': expected rank 2"):
        evaluate(g, [torch.randn(2, 4), torch.randn(8)])


def test_symbolic_dims_bind_from_inputs_and_must_agree(g):
    for n in (1, 3, 17):
        a, b = torch.randn(n, 4), torch.randn(n, 4)
        torch.testing.assert_close(evaluate(g, [a, b])[0], a + b)
    with pytest.raises(ShapeError, match="dimension batch is 3 elsewhere but 5 here"):
        evaluate(g, [torch.randn(3, 4), torch.randn(5, 4)])


def test_inputs_by_name(g):
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    torch.testing.assert_close(evaluate(g, {"y": b, "x": a})[0], a + b)
    with pytest.raises(ValueError, match=r"missing \['y'\], unknown \['z'\]"):
        evaluate(g, {"x": a, "z": b})


def test_non_tensor_input_is_refused(g):
    with pytest.raises(TypeError, match="input 'x' must be a torch.Tensor, got list"):
        evaluate(g, [[1.0] * 4, torch.randn(1, 4)])


def test_product_dims_bind_through_views():
    g = Graph()
    x = g.input("x", ("b", "s", 3), "f32")
    g.output(g.view(x, (-1, 3)))
    assert evaluate(g, [torch.randn(2, 5, 3)])[0].shape == (10, 3)


def test_half_inputs_compute_in_f32_and_return_half():
    g = Graph()
    x = g.input("x", (5,), "f16")
    g.output(g.reduce(Op.SUM, x, 0))
    (out,) = evaluate(g, [torch.tensor([2048.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float16)])
    # summing in f16 would stay at 2048 (2049 is not a half); in f32 the sum is 2052, which is a half
    assert out.dtype == torch.float16 and out.item() == 2052.0


def test_integer_division_truncates_and_mod_floors():
    g = Graph()
    a, b = g.input("a", (4,), "i32"), g.input("b", (4,), "i32")
    g.output(g.div(a, b), g.mod(a, b))
    av, bv = torch.tensor([7, -7, 7, -7], dtype=torch.int32), torch.tensor([2, 2, -2, -2], dtype=torch.int32)
    q, r = evaluate(g, [av, bv])
    assert q.tolist() == [3, -3, -3, 3]
    assert r.tolist() == torch.remainder(av, bv).tolist()
