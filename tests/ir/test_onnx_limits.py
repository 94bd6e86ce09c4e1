"""Load-time limits of the ONNX front end: the folding cap, huge initializers, dims checked at the entry."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kernelize.ir import FoldLimitError, Graph, evaluate, load_onnx
from kernelize.ir.graph import Op, scalar_value
from kernelize.ir.shapes import ShapeError

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _const_i64(name: str, values) -> onnx.NodeProto:
    t = numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)
    return helper.make_node("Constant", [], [name], value=t)


# -- huge initializers ---------------------------------------------------------------------------------------
def test_initializer_past_2_to_the_24_elements_loads(tmp_path):
    # 2**24 + 4 is the smallest length whose last f32-linspace probe index rounded past the end (IndexError)
    n = 2**24 + 4
    data = np.zeros(n, dtype=np.uint8)
    data[-1] = 7
    model = _model(
        [helper.make_node("Gather", ["table", "i"], ["y"], axis=0)],
        [helper.make_tensor_value_info("i", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [3])],
        [numpy_helper.from_array(data, "table")],
    )
    path = tmp_path / "big.onnx"
    onnx.save(model, str(path))
    g = load_onnx(path)
    (y,) = evaluate(g, [torch.tensor([0, n - 1, -1])])
    assert y.tolist() == [0, 7, 7]


def test_uniform_huge_initializer_becomes_a_broadcast_scalar(tmp_path):
    n = 2**24 + 4
    model = _model(
        [helper.make_node("Gather", ["table", "i"], ["y"], axis=0)],
        [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [2])],
        [numpy_helper.from_array(np.full(n, 3, dtype=np.uint8), "table")],
    )
    g = load_onnx(model)
    assert not any(n.op is Op.CONST and n.arg.tensor.numel() > 1 for n in g.nodes)
    assert evaluate(g, [torch.tensor([5, n - 1])])[0].tolist() == [3, 3]


# -- the folding cap -----------------------------------------------------------------------------------------
def _constant_of_shape_sum(rows: int, cols: int) -> onnx.ModelProto:
    fill = helper.make_tensor("v", F32, [1], [1.0])
    return _model(
        [
            _const_i64("shape", [rows, cols]),
            helper.make_node("ConstantOfShape", ["shape"], ["big"], value=fill),
            helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", F32, [1])],
        [helper.make_tensor_value_info("y", F32, [1])],
    )


def test_constant_of_shape_over_the_cap_stays_a_run_time_broadcast():
    model = _constant_of_shape_sum(20000, 20000)  # 1.6 GB if folded
    assert len(model.SerializeToString()) < 400
    t0 = time.perf_counter()
    g = load_onnx(model)
    assert time.perf_counter() - t0 < 30
    big = [n for n in g.nodes if n.op is Op.BROADCAST and n.shape == (20000, 20000)]
    assert big and scalar_value(big[0]) == 1.0  # a broadcast scalar, not 400M folded values
    assert all(n.arg.tensor.numel() <= 2 for n in g.nodes if n.op is Op.CONST)
    assert any(n.op is Op.SUM for n in g.nodes)


def test_fold_limit_keeps_small_folds_and_moves_big_ones_to_run_time(monkeypatch):
    model = _constant_of_shape_sum(64, 64)  # 16 KiB
    folded = load_onnx(model)
    assert not any(n.op is Op.SUM for n in folded.nodes)
    x = torch.tensor([0.5])
    assert evaluate(folded, [x])[0].item() == 4096.5
    kept = load_onnx(model, fold_limit=1024)
    assert any(n.op is Op.SUM for n in kept.nodes)
    assert evaluate(kept, [x])[0].item() == 4096.5
    monkeypatch.setenv("KERNELIZE_FOLD_LIMIT", "1024")
    assert any(n.op is Op.SUM for n in load_onnx(model).nodes)
    monkeypatch.setenv("KERNELIZE_FOLD_LIMIT", "lots")
    with pytest.raises(ValueError, match="KERNELIZE_FOLD_LIMIT='lots'"):
        load_onnx(model)
    with pytest.raises(ValueError, match="fold_limit"):
        load_onnx(model, fold_limit=-1)


def _range(limit: float) -> onnx.ModelProto:
    scalar = [helper.make_tensor(n, F32, [], [v]) for n, v in (("a", 0.0), ("b", limit), ("d", 1.0))]
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in scalar]
    return _model(
        [*nodes, helper.make_node("Range", ["a", "b", "d"], ["r"], name="my_range")],
        [],
        [helper.make_tensor_value_info("r", F32, [None])],
    )


def test_huge_range_raises_a_named_error_not_memory_error():
    with pytest.raises(FoldLimitError, match=r"'my_range' \(Range.*folding cap of 67108864 bytes"):
        load_onnx(_range(1e12))
    g = load_onnx(_range(5.0))
    assert evaluate(g, [])[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_range_with_zero_delta_names_the_node():
    scalar = [helper.make_tensor(n, F32, [], [v]) for n, v in (("a", 0.0), ("b", 3.0), ("d", 0.0))]
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in scalar]
    model = _model(
        [*nodes, helper.make_node("Range", ["a", "b", "d"], ["r"], name="r0")],
        [],
        [helper.make_tensor_value_info("r", F32, [None])],
    )
    with pytest.raises(ValueError, match="'r0' \\(Range"):
        load_onnx(model)


# -- dims checked at the entry -------------------------------------------------------------------------------
def test_negative_onnx_dim_value_is_rejected_naming_input_and_axis():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", F32, [-5, 4])],
        [helper.make_tensor_value_info("y", F32, [None, 4])],
    )
    with pytest.raises(ValueError, match="graph input 'x' .* dim 0 has dim_value -5"):
        load_onnx(model)
    assert load_onnx(model, dynamic_dims={"x:0": 3}).inputs[0].shape == (3, 4)


@pytest.mark.parametrize("value", [-3, 2.5, True, None, [2]])
def test_bad_dynamic_dims_values_are_rejected(value):
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", F32, ["batch", 4])],
        [helper.make_tensor_value_info("y", F32, [None, 4])],
    )
    with pytest.raises(ValueError, match=r"dynamic_dims\['batch'\]"):
        load_onnx(model, dynamic_dims={"batch": value})


@pytest.mark.parametrize("dim", [-5, 2.5, True, None, "4x"])
def test_graph_input_rejects_dims_that_are_not_sizes(dim):
    with pytest.raises((ShapeError, ValueError), match="dim 0|identifier"):
        Graph().input("x", (dim, 4), "f32")


def test_graph_input_takes_integer_like_sizes():
    x = Graph().input("x", (np.int64(3), torch.tensor(2).item(), "batch", 0), "f32")
    assert x.shape[:2] == (3, 2) and type(x.shape[0]) is int and x.shape[3] == 0
