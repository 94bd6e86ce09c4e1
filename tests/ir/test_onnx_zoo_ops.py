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
