"""The disk cache of optimized ONNX graphs: real ONNX files, a miss then a hit that skips the loader, keys
that change with the file and the settings, external data, corrupt entries, and the description's round
trip of every argument kind."""

from __future__ import annotations

import math
import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kernelize.ir.onnx_frontend as onnx_frontend
import kernelize.runtime.diskcache as diskcache
from kernelize.ir.graph import Constant, Graph
from kernelize.ir.ops import AttentionArgs
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import Sym
from kernelize.passes.optimize import OptimizerSettings, optimize
from kernelize.runtime.cache import graph_fingerprint
from kernelize.runtime.compiled import compile_graph
from kernelize.runtime.graph_cache import (
    UncacheableGraph,
    decode,
    encode,
    graph_from_state,
    graph_state,
    load_optimized_onnx,
    wait_for_cache_writes,
)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(cache))
    return cache


def encoder_model(seed: int = 0) -> onnx.ModelProto:
    """``softmax(where(mask, layernorm(x @ W + b), -inf))`` over ``x [batch, 8, 32]``: a dynamic batch, float
    attributes, an infinite constant and weights to fold."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((32, 48)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(48).astype(np.float32), "b"),
        numpy_helper.from_array(np.ones(48, np.float32) * 1.5, "gamma"),
        numpy_helper.from_array(np.zeros(48, np.float32), "beta"),
        numpy_helper.from_array(rng.random((8, 48)) > 0.2, "mask"),
        numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["lin"]),
        helper.make_node("LayerNormalization", ["lin", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5),
        helper.make_node("Where", ["mask", "ln", "ninf"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 48])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "encoder.onnx"
    onnx.save(encoder_model(), str(path))
    return path


@pytest.fixture
def loads(monkeypatch):
    """Counts the calls of ``load_onnx`` (a cache hit makes none)."""
    calls = []
    real = onnx_frontend.load_onnx

    def spy(*args, **kw):
        calls.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(onnx_frontend, "load_onnx", spy)
    return calls


def entries(cache) -> list:
    wait_for_cache_writes()  # entries are written in the background
    return sorted(cache.glob("*.graph.pt"))


def test_miss_then_hit_gives_the_same_graph_without_loading(model_path, loads, _cache_dir):
    dims = {"batch": "batch"}
    want = optimize(onnx_frontend.load_onnx(model_path, dynamic_dims=dims))
    first = load_optimized_onnx(model_path, dynamic_dims=dims)
    assert len(loads) == 2 and len(entries(_cache_dir)) == 1
    second = load_optimized_onnx(model_path, dynamic_dims=dims)
    assert len(loads) == 2  # the hit did not load the model
    assert graph_fingerprint(first) == graph_fingerprint(second) == graph_fingerprint(want)
    assert any(isinstance(d, Sym) for n in second.nodes for d in n.shape)
    x = torch.randn(3, 8, 32)
    (ref,) = evaluate(want, [x])
    (got,) = evaluate(second, [x])
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_cached_graph_compiles_and_matches_onnxruntime(model_path):
    ort = pytest.importorskip("onnxruntime")
    load_optimized_onnx(model_path, dynamic_dims={"batch": "batch"})
    graph = load_optimized_onnx(model_path, dynamic_dims={"batch": "batch"})
    x = torch.randn(2, 8, 32)
    (got,) = compile_graph(graph, backend="cpu", cache=False)(x)
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x.numpy()})
    torch.testing.assert_close(got, torch.from_numpy(want), atol=1e-5, rtol=1e-4)


def test_key_follows_file_content_dims_and_settings(model_path, loads, _cache_dir):
    load_optimized_onnx(model_path, dynamic_dims={"batch": 2})
    load_optimized_onnx(model_path, dynamic_dims={"batch": 3})
    load_optimized_onnx(model_path, dynamic_dims={"batch": 2}, settings=OptimizerSettings(affine=False))
    assert len(entries(_cache_dir)) == 3
    onnx.save(encoder_model(seed=1), str(model_path))  # same name, other weights
    g = load_optimized_onnx(model_path, dynamic_dims={"batch": 2})
    assert len(entries(_cache_dir)) == 4
    fresh = optimize(onnx_frontend.load_onnx(model_path, dynamic_dims={"batch": 2}))
    assert graph_fingerprint(g) == graph_fingerprint(fresh)


def _edit_weight_in_place(path, seed: int = 0) -> None:
    """Change one float of the initializer ``w`` inside the file, keeping its size (and inode)."""
    w = np.random.default_rng(seed).standard_normal((32, 48)).astype(np.float32)
    with open(path, "r+b") as f:
        data = f.read()
        at = data.find(w.tobytes())
        assert at >= 0
        f.seek(at)
        f.write(np.float32(w.flat[0] + 1.0).tobytes())


def test_file_edited_in_place_right_after_a_load_is_never_a_stale_hit(model_path):
    """The same size, inode and (within one timestamp tick) maybe the same mtime: the digest of a file
    changed this recently is not remembered, so the edit is seen."""
    x = torch.randn(2, 8, 32)
    (before,) = evaluate(load_optimized_onnx(model_path, dynamic_dims={"batch": 2}), [x])
    size = model_path.stat().st_size
    _edit_weight_in_place(model_path)
    assert model_path.stat().st_size == size
    g = load_optimized_onnx(model_path, dynamic_dims={"batch": 2})
    (after,) = evaluate(g, [x])
    assert not torch.equal(before, after)
    fresh = optimize(onnx_frontend.load_onnx(model_path, dynamic_dims={"batch": 2}))
    assert graph_fingerprint(g) == graph_fingerprint(fresh)


def test_unchanged_file_is_hashed_once_and_an_edit_is_seen(model_path, monkeypatch):
    hashed = []
    real = diskcache.file_sha256
    monkeypatch.setattr(diskcache, "file_sha256", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(diskcache, "RACY_SECONDS", 0.0)  # the file was written just now
    monkeypatch.setattr(diskcache, "_digests", {})
    first = load_optimized_onnx(model_path)
    wait_for_cache_writes()
    model_hashes = lambda: sum(1 for p in hashed if p == model_path)  # noqa: E731
    assert model_hashes() == 1
    diskcache._digests.clear()  # a new process: the digest comes from the cache folder
    second = load_optimized_onnx(model_path)
    assert model_hashes() == 1 and graph_fingerprint(first) == graph_fingerprint(second)
    # the published entry is never rehashed: its stamp is the one recorded (only the temporary was hashed)
    assert not [p for p in hashed if p.suffix == ".pt" and not p.name.startswith(".tmp-")]
    _edit_weight_in_place(model_path)
    os.utime(model_path, ns=(model_path.stat().st_atime_ns, 0))  # even with an old mtime: the ctime moved
    third = load_optimized_onnx(model_path)
    assert model_hashes() == 2 and graph_fingerprint(third) != graph_fingerprint(first)


def test_model_with_external_data_is_not_cached(tmp_path, _cache_dir):
    path = tmp_path / "ext.onnx"
    onnx.save(encoder_model(), str(path), save_as_external_data=True, size_threshold=0, location="ext.bin")
    g = load_optimized_onnx(path, dynamic_dims={"batch": 2})
    assert entries(_cache_dir) == []
    fresh = optimize(onnx_frontend.load_onnx(path, dynamic_dims={"batch": 2}))
    assert graph_fingerprint(g) == graph_fingerprint(fresh)


def test_corrupt_entry_is_rebuilt(model_path, loads, _cache_dir):
    load_optimized_onnx(model_path)
    (entry,) = entries(_cache_dir)
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    g = load_optimized_onnx(model_path)
    assert len(loads) == 2
    assert graph_fingerprint(g) == graph_fingerprint(optimize(onnx_frontend.load_onnx(model_path)))
    assert graph_fingerprint(load_optimized_onnx(model_path)) == graph_fingerprint(g)


def test_missing_file_raises_the_loader_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_optimized_onnx(tmp_path / "nope.onnx")


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -7,
        "name",
        1e-12,
        -0.0,
        math.inf,
        (1, (2, 3), [4.5, None]),
        [],
        Sym(("batch", "seq"), 3),
        AttentionArgs(0.125, causal=True, mask="add", groups=4),
    ],
)
def test_description_round_trips_each_argument_kind(value):
    consts: list[Constant] = []
    back = decode(encode(value, consts), consts)
    assert back == value and type(back) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, back) == math.copysign(1, value)


def test_nan_and_constants_round_trip_by_digest():
    consts: list[Constant] = []
    c = Constant(torch.arange(6.0).reshape(2, 3))
    enc = encode((math.nan, c), consts)
    nan, back = decode(enc, consts)
    assert math.isnan(nan) and back is c


def test_unknown_argument_type_makes_the_graph_uncacheable():
    g = Graph()
    x = g.input("x", (2,), "f32")
    g.output(g.push(x.op, x.dtype, x.shape, (x,), arg=object()))
    with pytest.raises(UncacheableGraph, match="type object"):
        graph_state(g)


def test_state_keeps_views_small_and_digests_unchanged():
    g = Graph()
    big = torch.arange(1000.0)
    x = g.input("x", (10,), "f32")
    g.output(g.add(x, g.const(big[10:20])))
    state = graph_state(g)
    (t,) = state["tensors"]
    assert t.untyped_storage().nbytes() == 40
    back = graph_from_state(state)
    assert graph_fingerprint(back) == graph_fingerprint(g)


def test_every_op_argument_class_has_a_description() -> None:
    """A node argument class the description does not name would make every graph using it uncacheable
    (silently slow warm loads): each frozen dataclass the IR defines for node arguments is listed."""
    import dataclasses

    from kernelize.ir import ops
    from kernelize.runtime.graph_cache import DATACLASSES

    arg_classes = {
        name for name, c in vars(ops).items() if name.endswith("Args") and dataclasses.is_dataclass(c)
    }
    assert len(arg_classes) >= 6 and arg_classes <= set(DATACLASSES), arg_classes - set(DATACLASSES)


def test_file_changed_while_loading_writes_no_entry(model_path, monkeypatch, _cache_dir):
    real = onnx_frontend.load_onnx

    def load_then_edit(*args, **kw):
        graph = real(*args, **kw)
        edited = encoder_model(seed=2)
        edited.doc_string = "edited"  # another size: the edit is seen even within one timestamp tick
        onnx.save(edited, str(model_path))  # the digest in the key is now stale
        return graph

    monkeypatch.setattr(onnx_frontend, "load_onnx", load_then_edit)
    load_optimized_onnx(model_path)
    assert entries(_cache_dir) == []
