"""Ops that model-zoo CNNs need (LRN in AlexNet / GoogLeNet-era models): real ONNX models built with
``onnx.helper``, checked against onnxruntime when installed and against the op's definition always."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kernelize.ir import evaluate, optimize
from kernelize.ir.onnx_frontend import load_onnx
from kernelize.runtime.compiled import compile_graph


def _lrn_model(size: int, alpha: float, beta: float, bias: float, c: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, (c, 3, 3, 3), rng.standard_normal((c, 3, 3, 3)).ravel())
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("LRN", ["r"], ["y"], size=size, alpha=alpha, beta=beta, bias=bias),
    ]
    graph = helper.make_graph(
        nodes,
        "lrn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 7, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", c, 7, 9])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    return model


def _lrn_definition(x: np.ndarray, size: int, alpha: float, beta: float, bias: float) -> np.ndarray:
    c = x.shape[1]
    sq = np.zeros_like(x, dtype=np.float64)
    for i in range(c):
        lo, hi = max(0, i - (size - 1) // 2), min(c - 1, i + size // 2)
        sq[:, i] = (x[:, lo : hi + 1].astype(np.float64) ** 2).sum(axis=1)
    return x / (bias + alpha / size * sq) ** beta


@pytest.mark.parametrize(("size", "c"), [(5, 16), (3, 7), (1, 4), (4, 6)])
def test_lrn_matches_definition_and_onnxruntime(size, c):
    model = _lrn_model(size, alpha=2e-2, beta=0.75, bias=1.5, c=c)
    g = load_onnx(model)
    x = torch.randn(2, 3, 7, 9)
    (ref,) = evaluate(g, [x])
    (h,) = evaluate(load_onnx(_relu_conv_only(model)), [x])
    want = _lrn_definition(h.numpy(), size, 2e-2, 0.75, 1.5)
    np.testing.assert_allclose(ref.numpy(), want, rtol=1e-5, atol=1e-6)
    (got,) = compile_graph(optimize(g), backend="cpu", cache=False)(x)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    if size % 2 == 0:
        return  # onnxruntime's LRN rejects even sizes; the definition above is the oracle for those
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (o,) = sess.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(got.numpy(), o, rtol=1e-4, atol=1e-5)


def _relu_conv_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model up to the LRN's input (the definition is applied to that with numpy)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.node[2]
    m.graph.output[0].name = "r"
    return m


def test_lrn_without_size_names_the_attribute():
    model = _lrn_model(5, 1e-4, 0.75, 1.0, 8)
    del model.graph.node[2].attribute[:]
    with pytest.raises(ValueError, match="LRN.*|size"):
        load_onnx(model)


# -- opset spellings of the Caffe / early-torch model zoo ---------------------------------------------------
def _one_node(node, x_shape, y_shape, opset: int, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [
            helper.make_tensor_value_info(
                "y", TensorProto.FLOAT, y_shape or [f"d{i}" for i in range(len(x_shape))]
            )
        ],
        list(inits),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 4 if opset < 10 else 7  # initializers need not be graph inputs from IR 4 on
    onnx.checker.check_model(model)
    return model


def _compiled(model: onnx.ModelProto, x: torch.Tensor) -> np.ndarray:
    g = load_onnx(model)
    (ref,) = evaluate(g, [x])
    (got,) = compile_graph(optimize(g), backend="cpu", cache=False)(x)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    return got.numpy()


def _ort(model: onnx.ModelProto, x: torch.Tensor) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.numpy()})[0]


POOLS_ND = [
    # torch's LRN export: a window over the (padded) channels only, the other axes untouched
    (
        "AveragePool",
        [2, 1, 9, 3, 5],
        dict(kernel_shape=[5, 1, 1], pads=[2, 0, 0, 2, 0, 0], count_include_pad=1),
    ),
    ("MaxPool", [2, 3, 8, 5, 6], dict(kernel_shape=[3, 2, 3], strides=[2, 2, 1], pads=[1, 0, 1, 1, 0, 0])),
    (
        "MaxPool",
        [1, 2, 9, 7, 6],
        dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], dilations=[2, 1, 2], ceil_mode=1),
    ),
    (
        "AveragePool",
        [2, 3, 8, 5, 6],
        dict(
            kernel_shape=[3, 2, 3],
            strides=[2, 2, 2],
            pads=[1, 0, 1, 1, 1, 0],
            ceil_mode=1,
            count_include_pad=1,
        ),
    ),
    (
        "AveragePool",
        [2, 3, 8, 5, 6],
        dict(kernel_shape=[3, 3, 2], strides=[2, 2, 2], pads=[1] * 6, ceil_mode=1),
    ),
    ("AveragePool", [2, 3, 9], dict(kernel_shape=[3], strides=[2], pads=[1, 1], ceil_mode=1)),
    ("MaxPool", [2, 3, 9], dict(kernel_shape=[3], strides=[2], pads=[1, 0])),
]


@pytest.mark.parametrize(
    ("op", "shape", "attrs"), POOLS_ND, ids=lambda v: str(v) if isinstance(v, str) else None
)
def test_pooling_over_1_and_3_spatial_axes_matches_onnxruntime(op, shape, attrs):
    """3-d pools (torch exports LRN as one) pool one axis at a time: exact for max, and for averages
    because a window's divisor, padding counted or not and ceil-mode clipped, is a product over axes."""
    model = _one_node(
        helper.make_node(op, ["x"], ["y"], **attrs), shape, None, 10 if "ceil_mode" in attrs else 9
    )
    x = torch.randn(*shape)
    np.testing.assert_allclose(_compiled(model, x), _ort(model, x), rtol=1e-5, atol=1e-6)


def test_lrn_style_3d_pool_is_one_pointwise_kernel_of_shifted_slices():
    """Axes with window 1, stride 1 and no padding are skipped, and a stride-1 window along one axis is a
    sum of shifted slices of the padded input: torch's LRN export costs no pool, one pointwise kernel."""
    attrs = dict(kernel_shape=[5, 1, 1], pads=[2, 0, 0, 2, 0, 0], count_include_pad=1)
    model = _one_node(helper.make_node("AveragePool", ["x"], ["y"], **attrs), [2, 1, 9, 3, 5], None, 9)
    g = load_onnx(model)
    assert not [n for n in g.nodes if n.op.value == "pool"]
    assert len(compile_graph(optimize(g), backend="cpu", cache=False).kernels) == 1


def test_legacy_broadcast_with_axis_aligns_from_that_axis():
    """Add-6 with broadcast=1, axis=1 adds a [C] bias per channel; numpy's trailing alignment would add
    it along W (equal to C here, so no shape error would catch it)."""
    b = np.arange(4, dtype=np.float32)
    node = helper.make_node("Add", ["x", "b"], ["y"], broadcast=1, axis=1)
    model = _one_node(node, [2, 4, 3, 4], [2, 4, 3, 4], 6, [onnx.numpy_helper.from_array(b, "b")])
    x = torch.randn(2, 4, 3, 4)
    np.testing.assert_allclose(_compiled(model, x), x.numpy() + b[None, :, None, None], rtol=1e-6)
    bc = np.arange(12, dtype=np.float32).reshape(4, 3)
    node = helper.make_node("Sub", ["x", "b"], ["y"], broadcast=1, axis=-3)
    model = _one_node(node, [2, 4, 3, 5], [2, 4, 3, 5], 6, [onnx.numpy_helper.from_array(bc, "b")])
    x = torch.randn(2, 4, 3, 5)
    np.testing.assert_allclose(_compiled(model, x), x.numpy() - bc[None, :, :, None], rtol=1e-6)


def test_legacy_broadcast_without_axis_is_numpy_suffix_matching():
    b = np.arange(15, dtype=np.float32).reshape(3, 5)
    node = helper.make_node("Mul", ["x", "b"], ["y"], broadcast=1)
    model = _one_node(node, [2, 4, 3, 5], [2, 4, 3, 5], 6, [onnx.numpy_helper.from_array(b, "b")])
    x = torch.randn(2, 4, 3, 5)
    np.testing.assert_allclose(_compiled(model, x), x.numpy() * b, rtol=1e-6)


def test_concat_1_defaults_to_axis_1():
    model = _one_node(helper.make_node("Concat", ["x", "x"], ["y"]), [2, 3, 4], [2, 6, 4], 3)
    x = torch.randn(2, 3, 4)
    np.testing.assert_array_equal(_compiled(model, x), torch.cat([x, x], 1).numpy())


def test_image_scaler_matches_definition_and_onnxruntime():
    node = helper.make_node("ImageScaler", ["x"], ["y"], scale=0.5, bias=[0.1, -0.2, 0.3])
    model = _one_node(node, [2, 3, 4, 5], [2, 3, 4, 5], 9)
    x = torch.randn(2, 3, 4, 5)
    got = _compiled(model, x)
    want = x.numpy() * 0.5 + np.array([0.1, -0.2, 0.3], np.float32)[None, :, None, None]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, _ort(model, x), rtol=1e-6, atol=1e-7)


def _scatter_model(op: str, data_shape, idx: np.ndarray, upd_shape, **attrs) -> onnx.ModelProto:
    """``op`` over a run-time data and updates with load-time indices (an initializer)."""
    nodes = [helper.make_node(op, ["x", "i", "u"], ["s"], **attrs), helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes,
        op.lower(),
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, data_shape),
         helper.make_tensor_value_info("u", TensorProto.FLOAT, upd_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, data_shape)],
        [helper.make_tensor("i", TensorProto.INT64, idx.shape, idx.ravel())],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    onnx.checker.check_model(model)
    return model


def _scatter_definition(op: str, x: np.ndarray, idx: np.ndarray, u: np.ndarray, axis: int = 0) -> np.ndarray:
    out = x.copy()
    if op == "ScatterND":
        for j in np.ndindex(idx.shape[:-1]):
            out[tuple(idx[j])] = u[j]
    else:
        for j in np.ndindex(idx.shape):
            at = list(j)
            at[axis] = idx[j]
            out[tuple(at)] = u[j]
    return np.maximum(out, 0)


SCATTERS = [
    ("ScatterND", (4, 5, 3), np.array([[1], [-1]]), (2, 5, 3), {}),  # whole rows, a negative index
    ("ScatterND", (4, 5, 3), np.array([[[0, 2], [3, 4]], [[1, 1], [2, 0]]]), (2, 2, 3), {}),  # rows of axis 2
    ("ScatterND", (4, 5), np.array([[0, 0], [3, 4], [2, -1]]), (3,), {}),  # single elements
    ("ScatterND", (4, 5), np.array([[2], [0], [2]]), (3, 5), {}),  # a row written twice: the later wins
    ("ScatterElements", (3, 4), np.array([[1, 0, 2, 1], [0, 2, 1, 0]]), (2, 4), {"axis": 0}),
    ("ScatterElements", (3, 4), np.array([[3, -4], [1, 2], [0, 3]]), (3, 2), {"axis": 1}),
]


@pytest.mark.parametrize(("op", "shape", "idx", "ushape", "attrs"), SCATTERS)
def test_scatter_with_load_time_indices_matches_definition_and_onnxruntime(op, shape, idx, ushape, attrs):
    """ScatterND / ScatterElements (BEiT's relative position bias exports ScatterND): a gather of the updates
    where an index writes, the data elsewhere."""
    model = _scatter_model(op, shape, idx, ushape, **attrs)
    x, u = torch.randn(*shape), torch.randn(*ushape)
    norm = np.where(
        idx < 0, idx + (np.array(shape)[: idx.shape[-1]] if op == "ScatterND" else shape[attrs["axis"]]), idx
    )
    want = _scatter_definition(op, x.numpy(), norm, u.numpy(), attrs.get("axis", 0))
    g = load_onnx(model)
    (ref,) = evaluate(g, [x, u])
    np.testing.assert_array_equal(ref.numpy(), want)
    (got,) = compile_graph(optimize(g), backend="cpu", cache=False)(x, u)
    np.testing.assert_array_equal(got.numpy(), want)
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {"x": x.numpy(), "u": u.numpy()})[0], want)


def test_scatter_refusals_name_the_reason():
    from kernelize.ir.errors import UnsupportedOpError

    model = _scatter_model("ScatterND", (4, 5), np.array([[1]]), (1, 5), reduction="add")
    with pytest.raises(UnsupportedOpError, match="reduction='add'"):
        load_onnx(model)
    model = _scatter_model("ScatterND", (4, 5), np.array([[4]]), (1, 5))
    with pytest.raises(ValueError, match="outside the data's shape"):
        load_onnx(model)
    model.graph.input.append(helper.make_tensor_value_info("i", TensorProto.INT64, [1, 1]))
    del model.graph.initializer[:]  # the indices as a run-time input
    with pytest.raises(UnsupportedOpError, match="indices known only at run time"):
        load_onnx(model)
