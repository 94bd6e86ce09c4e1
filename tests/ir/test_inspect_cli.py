"""`kernelize inspect model.onnx [--optimize] [--svg out.svg] [--kernels]` (kernelize.tools.inspect_main)."""

from __future__ import annotations

import shutil
import sys
import types

import numpy as np
import pytest

from kernelize.cli import main
from kernelize.tools import format_op_counts

onnx = pytest.importorskip("onnx")
pytest.importorskip("kernelize.ir.onnx_frontend")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


@pytest.fixture
def model_path(tmp_path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Div", ["hb", "two"], ["hd"]),
        helper.make_node("Relu", ["hd"], ["r"]),
        helper.make_node("Softmax", ["r"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [w, b, two],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "tiny.onnx"
    onnx.save(model, str(path))
    return path


def test_inspect_prints_graph_and_op_counts(model_path, capsys):
    assert main(["inspect", str(model_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph(%0 x: f32[batch, 4]) {")
    assert "matmul" in out and "softmax" in out and "div" in out
    assert "op " in out and "total" in out


def test_inspect_optimize_and_svg(model_path, tmp_path, capsys):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz dot is not installed")
    svg = tmp_path / "tiny.svg"
    assert main(["inspect", str(model_path), "--optimize", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "# optimized:" in out and f"wrote {svg}" in out
    assert " div(" not in out  # division by a constant became a multiplication (or folded into the weight)
    assert "<svg" in svg.read_text()


def test_inspect_missing_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_inspect_kernels_calls_the_runtime(model_path, monkeypatch, capsys):
    seen = []
    runtime = types.ModuleType("kernelize.runtime")
    runtime.print_kernels = lambda graph, backend: seen.append((len(graph.outputs), backend))
    monkeypatch.setitem(sys.modules, "kernelize.runtime", runtime)
    assert main(["inspect", str(model_path), "--kernels", "--backend", "cpu"]) == 0
    assert seen == [(1, "cpu")]


def test_format_op_counts_sorts_by_count():
    from collections import Counter

    text = format_op_counts(Counter({"mul": 1, "add": 3, "exp": 1}))
    lines = text.splitlines()
    assert (
        lines[2].split() == ["add", "3"]
        and lines[3].split() == ["exp", "1"]
        and lines[-1].split() == ["total", "5"]
    )
