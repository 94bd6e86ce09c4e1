"""`kernelize.onnx.InferenceSession` against onnxruntime's on the same exported models."""

from __future__ import annotations

import sys
import types

import numpy
import pytest
import torch
from torch import nn

from kernelize.onnx import InferenceSession, SymbolicDim, pin_dims

ort = pytest.importorskip("onnxruntime")
# torch's legacy (TorchScript) exporter warns that it is deprecated; it exports these models in a fraction
# of the time the dynamo exporter takes
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.bn(self.conv(x)))), 1))


class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 4), nn.Linear(4, 3)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.b(torch.relu(self.a(u)) * v)
        return o, torch.softmax(self.c(o), -1)


def _export(model: nn.Module, args: tuple, path, inputs: list[str], outputs: list[str], dim: str) -> str:
    axes = {name: {0: dim} for name in inputs + outputs}
    torch.onnx.export(
        model.eval(), args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=axes,
        opset_version=17, dynamo=False,
    )  # fmt: skip
    return str(path)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = TinyCNN()
    with torch.no_grad():  # batch norm statistics a trained network would have, so it changes the values
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    path = tmp_path_factory.mktemp("onnx") / "cnn.onnx"
    return _export(model, (torch.randn(2, 3, 8, 8),), path, ["x"], ["y"], "batch")


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("onnx") / "mlp.onnx"
    args = (torch.randn(2, 6), torch.randn(2, 16))
    return _export(TwoInTwoOut(), args, path, ["u", "v"], ["o", "p"], "n")


def _feed(sess, batch: int, seed: int = 0) -> dict[str, numpy.ndarray]:
    rng = numpy.random.default_rng(seed)
    return {
        a.name: rng.standard_normal([batch if isinstance(d, str) else d for d in a.shape]).astype(
            numpy.float32
        )
        for a in sess.get_inputs()
    }


def _assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, numpy.ndarray) and g.shape == w.shape and g.dtype == w.dtype
        assert numpy.abs(g - w).max() <= 1e-4 * numpy.abs(w).max()


def test_cnn_matches_onnxruntime_at_several_batch_sizes(cnn):
    sess, ref = InferenceSession(cnn), ort.InferenceSession(cnn, providers=["CPUExecutionProvider"])
    for batch in (2, 5, 1):
        feed = _feed(ref, batch, seed=batch)
        _assert_close(sess.run(None, feed), ref.run(None, feed))
    assert sess.get_providers() == ["KernelizeCPUExecutionProvider"]


def test_inputs_outputs_and_metadata_are_onnxruntimes(cnn, mlp):
    for path in (cnn, mlp):
        sess, ref = InferenceSession(path), ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        for ours, theirs in [(sess.get_inputs(), ref.get_inputs()), (sess.get_outputs(), ref.get_outputs())]:
            assert [(a.name, a.shape, a.type) for a in ours] == [(a.name, a.shape, a.type) for a in theirs]
        fields = ["producer_name", "graph_name", "domain", "description", "graph_description", "version"]
        fields.append("custom_metadata_map")
        meta, want = sess.get_modelmeta(), ref.get_modelmeta()
        assert {f: getattr(meta, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert InferenceSession(mlp).get_inputs()[1].shape == ["n", 16]


def test_two_inputs_two_outputs_names_pick_and_order_the_outputs(mlp):
    sess, ref = InferenceSession(mlp), ort.InferenceSession(mlp, providers=["CPUExecutionProvider"])
    feed = _feed(ref, 3)
    both = ref.run(None, feed)
    _assert_close(sess.run(None, feed), both)
    _assert_close(sess.run([], feed), both)  # onnxruntime: an empty list is every output too
    _assert_close(sess.run(["p"], feed), [both[1]])
    _assert_close(sess.run(["p", "o"], feed), both[::-1])
    _assert_close(sess.run(["o", "p"], _feed(ref, 7)), ref.run(None, _feed(ref, 7)))


def test_onnxruntimes_documented_usage_runs_unchanged(cnn):
    X = numpy.random.default_rng(1).standard_normal((4, 3, 8, 8))  # float64, as a user's data often is
    sess = InferenceSession(cnn, providers=["CPUExecutionProvider"])
    input_name = sess.get_inputs()[0].name
    label_name = sess.get_outputs()[0].name
    pred = sess.run([label_name], {input_name: X.astype(numpy.float32)})[0]
    want = ort.InferenceSession(cnn, providers=["CPUExecutionProvider"]).run(
        [label_name], {input_name: X.astype(numpy.float32)}
    )[0]
    _assert_close([pred], [want])


def test_model_bytes_and_awkward_arrays(cnn):
    ref = ort.InferenceSession(cnn, providers=["CPUExecutionProvider"])
    with open(cnn, "rb") as f:
        sess = InferenceSession(f.read())
    x = _feed(ref, 6)["x"]
    want = ref.run(None, {"x": x})
    strided = numpy.asfortranarray(x)
    readonly = x.copy()
    readonly.flags.writeable = False
    for arr in (x, strided, readonly, x[::-1][::-1]):
        _assert_close(sess.run(None, {"x": arr}), want)
    assert not readonly.flags.writeable and numpy.array_equal(readonly, x)


def test_wrong_inputs_raise_value_errors_naming_the_input(mlp):
    sess = InferenceSession(mlp)
    feed = _feed(sess, 2)
    cases = [
        ({"u": feed["u"]}, r"required inputs \['v'\] are missing.*inputs: \['u', 'v'\]"),
        ({**feed, "w": feed["u"]}, r"inputs \['w'\] are unknown"),
        (
            {**feed, "u": feed["u"].astype(numpy.float64)},
            r"input 'u': expected tensor\(float\).*got numpy float64",
        ),
        ({**feed, "v": feed["v"][0]}, r"input 'v': expected rank 2 \(shape \['n', 16\]\), got rank 1"),
        ({**feed, "u": feed["u"][:, :5]}, r"input 'u': expected shape \['n', 6\], got \[2, 5\] \(axes \[1\]"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            sess.run(None, bad)
    with pytest.raises(ValueError, match=r"output names \['q'\] are not outputs of the model; its outputs: "):
        sess.run(["o", "q"], feed)


def test_construction_errors_name_the_remedy(tmp_path, cnn):
    with pytest.raises(ValueError, match="does not exist"):
        InferenceSession(tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match="not an ONNX model"):
        InferenceSession(b"\x08\x07garbage")
    with pytest.raises(ValueError, match=r"'TensorrtExecutionProvider' is not a kernelize provider"):
        InferenceSession(cnn, providers=["TensorrtExecutionProvider"])
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        InferenceSession(cnn, providerz=["CPUExecutionProvider"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"needs a CUDA GPU.*providers=\['CPUExecutionProvider'\]"):
            InferenceSession(cnn, providers=["CUDAExecutionProvider"])
        # a list in order of preference falls back as onnxruntime's does
        sess = InferenceSession(cnn, providers=[("CUDAExecutionProvider", {}), "CPUExecutionProvider"])
        assert sess.get_providers() == ["KernelizeCPUExecutionProvider"]


def test_intra_op_threads_hold_during_run_only(cnn, monkeypatch):
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    calls = []
    real = torch.set_num_threads

    def recorded(n):  # the session's own calls (a run on kernelize's workers sets torch's count too)
        if sys._getframe(1).f_globals.get("__name__") == "kernelize.onnx":
            calls.append(n)
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", recorded)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = want
    for options in (opts, types.SimpleNamespace(intra_op_num_threads=want)):
        calls.clear()
        sess = InferenceSession(cnn, options)
        sess.run(None, _feed(sess, 2))
        assert calls == [want, before] and torch.get_num_threads() == before
    calls.clear()
    InferenceSession(cnn, ort.SessionOptions()).run(None, _feed(sess, 2))  # 0: onnxruntime's default
    assert calls == []


def _reshape_by_shape_model():
    """``c.expand(reshape(concat(shape(x)[0], [4])))  + x`` with a symbolic batch, as BERT's export writes
    its position ids: the expanded shape is a run-time tensor unless the batch has a size at load time."""
    from onnx import TensorProto, helper

    consts = [
        helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
        helper.make_tensor("four", TensorProto.INT64, [1], [4]),
        helper.make_tensor("flat", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("c", TensorProto.FLOAT, [1, 4], [1.0, 2.0, 3.0, 4.0]),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "four"], ["shape"], axis=0),
        helper.make_node("Reshape", ["shape", "flat"], ["shape2"]),
        helper.make_node("Expand", ["c", "shape2"], ["e"]),
        helper.make_node("Add", ["e", "x"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph(nodes, "reshape", [x], [y], consts)
    # IR 8 (opset 17's): onnx's newest IR version is newer than some onnxruntime releases read
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_shape_computed_from_the_input_pins_the_dims_per_call(tmp_path, caplog):
    path = tmp_path / "reshape.onnx"
    path.write_bytes(_reshape_by_shape_model().SerializeToString())
    with caplog.at_level("INFO", logger="kernelize.onnx"):
        sess = InferenceSession(path)
    assert "symbolic dims are pinned per input signature" in caplog.text
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (3, 1, 3, 6):
        feed = _feed(ref, batch, seed=batch)
        _assert_close(sess.run(None, feed), ref.run(None, feed))


def test_outputs_own_their_memory():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 3]) for n in ("y", "z")]
    nodes = [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["x"], ["z"])]
    model = helper.make_model(
        helper.make_graph(nodes, "id", [x], outs), opset_imports=[helper.make_opsetid("", 17)]
    )
    sess = InferenceSession(model.SerializeToString())
    arr = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    y, z = sess.run(None, {"x": arr})
    assert numpy.array_equal(y, arr) and numpy.array_equal(z, arr)
    assert not numpy.shares_memory(y, arr) and not numpy.shares_memory(y, z)


def test_pin_dims_takes_given_then_input_sizes_then_the_default():
    dims = [SymbolicDim("x", 0, "batch"), SymbolicDim("x", 1, "x:1"), SymbolicDim("m", 0, "batch")]
    assert pin_dims(dims, {"x": (8, 5)}) == {"batch": 8, "x:1": 5}
    assert pin_dims(dims, {}, {"x:0": 3}) == {"x:0": 3, "x:1": 2, "batch": 2}
    assert pin_dims(dims, {"m": (4,)}) == {"batch": 4, "x:1": 2}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_provider_matches_onnxruntime_on_the_cpu(cnn):
    sess = InferenceSession(cnn, providers=["CUDAExecutionProvider"])
    ref = ort.InferenceSession(cnn, providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ["KernelizeCUDAExecutionProvider"]
    feed = _feed(ref, 3)
    _assert_close(sess.run(None, feed), ref.run(None, feed))
