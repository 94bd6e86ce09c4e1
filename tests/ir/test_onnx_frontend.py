"""load_onnx on small hand-built models (onnx.helper) and on models exported by torch (tests/ir/data).

Expected values come from torch directly or from ``onnx.reference.ReferenceEvaluator``, an independent
implementation of the ONNX spec.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kernelize.ir.errors import UnsupportedOpError
from kernelize.ir.graph import Op
from kernelize.ir.onnx_frontend import OPS, load_onnx
from kernelize.ir.printer import op_counts
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import ShapeError, Sym

DATA = Path(__file__).parent / "data"
F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17, name="g") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _out(name: str, rank: int, elem_type: int = F32) -> onnx.ValueInfoProto:
    """A graph output of known rank and unknown sizes (the checker wants a shape)."""
    return helper.make_tensor_value_info(name, elem_type, [None] * rank)


def _init(name: str, a) -> TensorProto:
    return numpy_helper.from_array(np.asarray(a), name)


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, feeds)


def _ops(graph) -> set[str]:
    return {k for k, v in op_counts(graph).items() if v}


# -- models --------------------------------------------------------------------------------------------------
def test_conv_bn_relu_cnn_matches_torch():
    rng = np.random.RandomState(0)
    w = rng.randn(8, 3, 3, 3).astype(np.float32) * 0.3
    b = rng.randn(8).astype(np.float32)
    scale, shift = rng.rand(8).astype(np.float32) + 0.5, rng.randn(8).astype(np.float32)
    mean, var = rng.randn(8).astype(np.float32), rng.rand(8).astype(np.float32) + 0.5
    w2 = rng.randn(4, 8, 1, 1).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv1"),
        helper.make_node("BatchNormalization", ["c", "s", "t", "m", "v"], ["n"], epsilon=1e-3, name="bn1"),
        helper.make_node("Relu", ["n"], ["r"], name="relu1"),
        helper.make_node("Conv", ["r", "w2"], ["c2"], name="conv2"),
        helper.make_node("GlobalAveragePool", ["c2"], ["y"], name="gap"),
    ]
    inits = [_init(k, v) for k, v in dict(w=w, b=b, s=scale, t=shift, m=mean, v=var, w2=w2).items()]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 3, 9, 9])], [_out("y", 4)], inits)
    g = load_onnx(model)
    assert g.inputs[0].shape == (Sym.of("N"), 3, 9, 9)
    assert {"conv", "mean"} <= _ops(g) and not _ops(g) & {"layernorm", "softmax"}
    x = torch.from_numpy(rng.randn(2, 3, 9, 9).astype(np.float32))
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    ref = F.conv2d(x, t(w), t(b), stride=2, padding=1)
    ref = F.relu(F.batch_norm(ref, t(mean), t(var), t(scale), t(shift), eps=1e-3))
    ref = F.conv2d(ref, t(w2)).mean((2, 3), keepdim=True)
    (got,) = evaluate(g, [x])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_attention_block_with_einsum_softmax_matmul():
    """Multi-head attention: MatMul projections, Einsum scores (bhqd,bhkd->bhqk), Softmax, Einsum output."""
    rng = np.random.RandomState(1)
    d, h = 16, 4
    wq, wk, wv = (rng.randn(d, d).astype(np.float32) * 0.3 for _ in range(3))
    shape4 = np.array([0, 0, h, d // h], dtype=np.int64)  # 0 copies the input dim (batch, seq)
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q0"]),
        helper.make_node("MatMul", ["x", "wk"], ["k0"]),
        helper.make_node("MatMul", ["x", "wv"], ["v0"]),
        *[helper.make_node("Reshape", [f"{n}0", "shape4"], [f"{n}1"]) for n in "qkv"],
        *[helper.make_node("Transpose", [f"{n}1"], [n], perm=[0, 2, 1, 3]) for n in "qkv"],
        helper.make_node("Einsum", ["q", "k"], ["s0"], equation="bhqd,bhkd->bhqk"),
        helper.make_node("Mul", ["s0", "scale"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("Einsum", ["p", "v"], ["o"], equation="bhqk,bhkd->bqhd"),
        helper.make_node("Reshape", ["o", "shape3"], ["y"]),
    ]
    inits = [
        _init("wq", wq),
        _init("wk", wk),
        _init("wv", wv),
        _init("shape4", shape4),
        _init("scale", np.float32(1 / np.sqrt(d // h))),
        _init("shape3", np.array([0, 0, -1])),
    ]
    model = _model(
        nodes, [helper.make_tensor_value_info("x", F32, ["batch", "seq", d])], [_out("y", 3)], inits
    )
    g = load_onnx(model)
    assert op_counts(g)["matmul"] == 5 and op_counts(g)["softmax"] == 1
    for b, s in ((1, 1), (2, 7)):
        x = rng.randn(b, s, d).astype(np.float32)
        (got,) = evaluate(g, [torch.from_numpy(x)])
        np.testing.assert_allclose(got.numpy(), _reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_shape_subgraph_folds_to_a_view():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape with a symbolic batch becomes one view node."""
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [_init("zero", np.int64(0)), _init("axes0", np.array([0])), _init("minus1", np.array([-1]))]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["batch", 3, 4])], [_out("y", 2)], inits)
    g = load_onnx(model)
    batch = Sym.of("batch")
    assert [n.op for n in g.nodes] == [Op.INPUT, Op.VIEW]
    assert g.outputs[0].shape == (batch, 12)
    x = torch.randn(5, 3, 4)
    torch.testing.assert_close(evaluate(g, [x])[0], x.reshape(5, 12))
    # with a static batch the same subgraph is folded to constants as well
    g = load_onnx(model, dynamic_dims={"batch": 2})
    assert [n.op for n in g.nodes] == [Op.INPUT, Op.VIEW] and g.outputs[0].shape == (2, 12)


def test_constant_subgraphs_fold():
    six = _init("v", np.arange(6, dtype=np.float32).reshape(2, 3))
    nodes = [
        helper.make_node("Constant", [], ["c"], value=six),
        helper.make_node("Transpose", ["c"], ["ct"]),
        helper.make_node("Mul", ["ct", "two"], ["c2"]),
        helper.make_node("Range", ["zero", "six", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=F32),
        helper.make_node("Reshape", ["rf", "shape"], ["r2"]),
        helper.make_node("Add", ["c2", "r2"], ["k"]),
        helper.make_node("MatMul", ["x", "k"], ["y"]),
    ]
    inits = [
        _init("two", np.float32(2)),
        _init("zero", np.int64(0)),
        _init("six", np.int64(6)),
        _init("one", np.int64(1)),
        _init("shape", np.array([3, 2])),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, [4, 3])], [_out("y", 2)], inits)
    g = load_onnx(model)
    assert [n.op for n in g.nodes] == [Op.INPUT, Op.CONST, Op.MATMUL]
    x = np.random.RandomState(2).randn(4, 3).astype(np.float32)
    np.testing.assert_allclose(
        evaluate(g, [torch.from_numpy(x)])[0].numpy(), _reference(model, {"x": x})[0], rtol=1e-6
    )


def test_uniform_constants_become_broadcast_scalars():
    fill = _init("v", np.array([1.5], np.float32))
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["c"], value=fill),
        helper.make_node("Add", ["x", "c"], ["y"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F32, [64, 64])],
        [_out("y", 2)],
        [_init("shape", np.array([64, 64]))],
    )
    g = load_onnx(model)
    assert max(n.arg.tensor.numel() for n in g.nodes if n.op is Op.CONST) == 1
    x = torch.randn(64, 64)
    torch.testing.assert_close(evaluate(g, [x])[0], x + 1.5)


# -- symbolic dims -------------------------------------------------------------------------------------------
def test_dynamic_dims_rename_pin_and_make_symbolic():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", F32, ["N", 8, 4])],
        [_out("y", 3)],
    )
    assert load_onnx(model).inputs[0].shape == (Sym.of("N"), 8, 4)
    assert load_onnx(model, dynamic_dims={"N": "batch"}).inputs[0].shape == (Sym.of("batch"), 8, 4)
    assert load_onnx(model, dynamic_dims={"N": 3}).inputs[0].shape == (3, 8, 4)
    assert load_onnx(model, dynamic_dims={"x:1": "seq"}).inputs[0].shape == (Sym.of("N"), Sym.of("seq"), 4)
    with pytest.raises(ValueError, match="dynamic_dims keys.*'M'"):
        load_onnx(model, dynamic_dims={"M": 2})


def test_unnamed_dims_and_odd_dim_params_become_identifiers():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", F32, ["batch size", None, 2])],
        [_out("y", 3)],
    )
    d0, d1, _ = load_onnx(model).inputs[0].shape
    assert isinstance(d0, Sym) and isinstance(d1, Sym) and d0 != d1
    assert all(n.isidentifier() for n in d0.names + d1.names)


def _single(op: str, x_shape, extra_inputs=(), inits=(), out_rank=None, opset=17, **attrs) -> onnx.ModelProto:
    names = ["x", *[n for n, _ in extra_inputs], *[t.name for t in inits]]
    inputs = [helper.make_tensor_value_info("x", F32, x_shape)]
    inputs += [helper.make_tensor_value_info(n, F32, s) for n, s in extra_inputs]
    rank = len(x_shape) if out_rank is None else out_rank
    return _model([helper.make_node(op, names, ["y"], **attrs)], inputs, [_out("y", rank)], inits, opset)


SYMBOLIC_CASES = {
    "softmax": lambda: _single("Softmax", ["B", 5, 7], axis=1),
    "layernorm_2_axes": lambda: _single(
        "LayerNormalization",
        ["B", 3, 4],
        inits=[
            _init("s", np.linspace(0.5, 2, 12, dtype=np.float32).reshape(3, 4)),
            _init("b", np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)),
        ],
        axis=1,
        epsilon=1e-3,
    ),
    "gemm_trans": lambda: _single(
        "Gemm",
        ["B", 6],
        inits=[
            _init("w", np.random.RandomState(3).randn(4, 6).astype(np.float32)),
            _init("c", np.ones(4, np.float32)),
        ],
        transB=1,
        alpha=0.5,
        beta=2.0,
    ),
    "conv1d": lambda: _single(
        "Conv",
        ["B", 2, 9],
        inits=[_init("w", np.random.RandomState(4).randn(4, 1, 3).astype(np.float32))],
        group=2,
        pads=[1, 2],
        dilations=[2],
    ),
    "maxpool_same": lambda: _single(
        "MaxPool", ["B", 2, 7, 6], kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER"
    ),
    # symmetric pads torch's pooling takes itself (padding is -inf, inputs are negative too), with dilation
    "maxpool_pads": lambda: _single(
        "MaxPool", ["B", 3, 9, 8], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
    ),
    "maxpool_pads_dilated": lambda: _single(
        "MaxPool", ["B", 2, 9, 9], kernel_shape=[3, 2], dilations=[2, 2], pads=[1, 1, 1, 1]
    ),
    "slice_static_axis": lambda: _single(
        "Slice",
        ["B", 10],
        inits=[
            _init("st", np.array([8])),
            _init("en", np.array([1])),
            _init("ax", np.array([1])),
            _init("sp", np.array([-3])),
        ],
    ),
    "instance_norm": lambda: _single(
        "InstanceNormalization",
        ["B", 3, 4, 5],
        inits=[_init("s", np.array([1, 2, 3], np.float32)), _init("b", np.array([0, 1, -1], np.float32))],
    ),
    "reduce_l2": lambda: _single(
        "ReduceL2", ["B", 3, 4], inits=[_init("axes", np.array([-1]))], out_rank=2, opset=18, keepdims=0
    ),
    "resize_linear": lambda: _single(
        "Resize",
        ["B", 2, 3, 4],
        inits=[_init("roi", np.zeros(0, np.float32)), _init("sc", np.array([1, 1, 2, 1.5], np.float32))],
        mode="linear",
    ),
    "einsum_implicit": lambda: _single(
        "Einsum", ["B", 3, 4], extra_inputs=[("z", ["B", 4, 5])], equation="bij,bjk"
    ),
}


@pytest.mark.parametrize("name", sorted(SYMBOLIC_CASES))
def test_symbolic_batch_matches_onnx_reference(name):
    model = SYMBOLIC_CASES[name]()
    g = load_onnx(model)
    assert g.inputs[0].shape[0] == Sym.of("B")
    rng = np.random.RandomState(5)
    for batch in (1, 3):
        feeds = {
            i.name: rng.randn(batch, *[d.dim_value for d in i.type.tensor_type.shape.dim[1:]]).astype(
                np.float32
            )
            for i in model.graph.input
        }
        (got,) = evaluate(g, {k: torch.from_numpy(v) for k, v in feeds.items()})
        np.testing.assert_allclose(got.numpy(), _reference(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_slicing_a_symbolic_dim_is_unsupported_not_wrong():
    model = _single(
        "Slice",
        ["B", 10],
        inits=[_init("st", np.array([1])), _init("en", np.array([3])), _init("ax", np.array([0]))],
    )
    with pytest.raises(UnsupportedOpError, match="symbolic dimension B"):
        load_onnx(model)


# -- exported models -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,shapes", [("tiny_cnn", [(1, 3, 16, 16), (3, 3, 16, 16)]), ("tiny_block", [(1, 1, 32), (2, 7, 32)])]
)
def test_torch_exported_models_match_onnx_reference(name, shapes):
    path = DATA / f"{name}.onnx"
    g = load_onnx(path)
    assert all(isinstance(d, Sym) for d in g.inputs[0].shape[: -3 if name == "tiny_cnn" else -1])
    assert not _ops(g) & {"gather", "concat"}, "shape subgraphs must fold away"
    ref = ReferenceEvaluator(str(path))
    for shape in shapes:
        x = np.random.RandomState(6).randn(*shape).astype(np.float32)
        (got,) = evaluate(g, [torch.from_numpy(x)])
        np.testing.assert_allclose(got.numpy(), ref.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)


# -- errors --------------------------------------------------------------------------------------------------
def test_unsupported_op_names_op_node_and_opset():
    model = _model(
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="my_topk")],
        [helper.make_tensor_value_info("x", F32, [4])],
        [_out("v", 1), _out("i", 1, TensorProto.INT64)],
        [_init("k", np.array([2]))],
        opset=16,
    )
    with pytest.raises(UnsupportedOpError) as e:
        load_onnx(model)
    assert "TopK" in str(e.value) and "my_topk" in str(e.value) and "opset 16" in str(e.value)
    assert isinstance(e.value, NotImplementedError)


def test_unsupported_attribute_value_and_dtype():
    model = _single("Pad", [2, 3], inits=[_init("pads", np.array([0, 1, 0, 1]))], mode="mirror", name="p0")
    with pytest.raises(UnsupportedOpError, match=r"'p0' \(Pad, opset 17\).*pad mode 'mirror'"):
        load_onnx(model)
    u16 = TensorProto.UINT16
    model = _model(
        [helper.make_node("Abs", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", u16, [3])],
        [_out("y", 1, u16)],
    )
    with pytest.raises(UnsupportedOpError, match="UINT16"):
        load_onnx(model)
    model = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv3d")],
        [helper.make_tensor_value_info("x", F32, [1, 1, 4, 4, 4])],
        [_out("y", 5)],
        [_init("w", np.ones((1, 1, 2, 2, 2), np.float32))],
    )
    with pytest.raises(UnsupportedOpError, match=r"conv3d.*Conv, opset 17.*3-d"):
        load_onnx(model)


def test_malformed_models_raise_value_error_naming_the_source(tmp_path):
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(b"\x08\x07\x12\xff\xff not a protobuf")
    with pytest.raises(ValueError, match="garbage.onnx"):
        load_onnx(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_onnx(tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match="model bytes"):
        load_onnx(b"\x01\x02\x03")
    with pytest.raises(TypeError):
        load_onnx(42)
    # a node reading a value nobody defines: the checker rejects it
    model = _model(
        [helper.make_node("Relu", ["nowhere"], ["y"])],
        [helper.make_tensor_value_info("x", F32, [2])],
        [_out("y", 1)],
    )
    path = tmp_path / "dangling.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ValueError, match="dangling.onnx"):
        load_onnx(path)


def test_shape_mismatch_names_the_node():
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        [helper.make_tensor_value_info("x", F32, [2, 3])],
        [_out("y", 2)],
        [_init("w", np.ones((4, 5), np.float32))],
    )
    with pytest.raises(ShapeError, match=r"'proj' \(MatMul, opset 17\).*inner dims"):
        load_onnx(model)


def test_op_table_covers_the_kyanite_set_and_the_extras():
    kyanite = """Conv Clip Relu Sigmoid Tanh Erf Softplus Mish Add Sub Mul Div Pow Min Max Equal Where Flatten
        Gemm MatMul BatchNormalization InstanceNormalization LayerNormalization Constant ConstantOfShape Cast
        Reshape Expand Unsqueeze Squeeze Transpose Gather Slice Concat Split Pad Shape Identity Softmax
        ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd MaxPool AveragePool GlobalMaxPool
        GlobalAveragePool Resize """
    extras = """CastLike Size RMSNormalization Gelu LeakyRelu HardSigmoid HardSwish Neg Reciprocal Not Less
        Greater LessOrEqual GreaterOrEqual Range ArgMax Einsum Attention"""
    assert set((kyanite + extras).split()) <= set(OPS)


def test_models_failing_the_onnx_checker_are_refused_from_a_file_bytes_or_a_proto(tmp_path):
    """The checker runs on every source (on a file it reads the file itself: no re-serialised proto)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    node = helper.make_node("Relu", ["undefined"], ["y"])  # reads a value nothing defines
    model = helper.make_model(helper.make_graph([node], "bad", [x], [y]))
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    for src in (path, str(path), model.SerializeToString(), model):
        with pytest.raises(ValueError, match="fails the ONNX checker"):
            load_onnx(src)


def test_large_initializers_are_checked_by_size_and_the_graph_by_the_checker(tmp_path):
    """Large weights skip the checker (parsing them took seconds), yet a bad model is still refused."""
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    good = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", F32, [2, 64])],
        [_out("y", 2)],
        [_init("w", w)],
    )
    x = np.ones((2, 64), np.float32)
    (y,) = evaluate(load_onnx(good), [torch.from_numpy(x)])
    torch.testing.assert_close(y, torch.from_numpy(x @ w))
    dangling = _model(
        [helper.make_node("MatMul", ["nowhere", "w"], ["y"])],
        [helper.make_tensor_value_info("x", F32, [2, 64])],
        [_out("y", 2)],
        [_init("w", w)],
    )
    short = onnx.ModelProto()
    short.CopyFrom(good)
    short.graph.initializer[0].raw_data = w.tobytes()[:-4]
    for model in (dangling, short):
        path = tmp_path / "bad.onnx"
        onnx.save(model, str(path))
        with pytest.raises(ValueError, match="fails the ONNX checker"):
            load_onnx(path)
