"""The classic-CNN corpus (``benchmarks/cnn_zoo.py``: AlexNet, VGG, GoogLeNet, SqueezeNet, DenseNet,
ShuffleNet v1/v2, MobileNet v1, ResNet-18, pre-activation ResNet and the odd spellings), exported in opset
9, through the route ``kernelize run model.onnx`` and ``benchmarks/onnx_models.py`` take (load, optimize,
compile for the CPU), against onnxruntime and the torch module.

Exports are cached in ``benchmarks/.onnx_cache/`` under the digest of ``cnn_zoo.py``; the first run
exports and compiles (minutes), later runs reuse both.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernelize.ir import load_onnx, optimize
from kernelize.runtime.compiled import compile_graph
from kernelize.runtime.graph_cache import load_optimized_onnx

ort = pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[2]
MAX_REL = 1e-4  # of the largest |output|, the accuracy target
SIZE = 64  # the smallest input every architecture takes (AlexNet's features end at 1x1)


def _zoo():
    spec = importlib.util.spec_from_file_location("cnn_zoo", ROOT / "benchmarks" / "cnn_zoo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


zoo = _zoo()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _check(name: str, batch: int, size: int = SIZE) -> None:
    path = zoo.export(name, size)
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
    graph = load_optimized_onnx(path, dynamic_dims={"batch": batch})
    (got,) = compile_graph(graph, backend="cpu", device="cpu")(x)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = torch.from_numpy(sess.run(None, {"x": x.numpy()})[0])
    with torch.no_grad():
        eager = zoo.build(name, size)(x)
    assert got.shape == want.shape == eager.shape
    assert torch.isfinite(got).all()
    assert _rel(got, want) <= MAX_REL, f"{name} batch {batch}: {_rel(got, want):.2e} from onnxruntime"
    assert _rel(got, eager) <= MAX_REL, f"{name} batch {batch}: {_rel(got, eager):.2e} from torch"


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_model_matches_onnxruntime_and_torch(name):
    _check(name, batch=1)


def test_channel_shuffle_at_batch_3():
    """ShuffleNet v2 reshapes with the batch size read from the input's shape (Shape -> Gather -> Concat
    -> Reshape) and splits channels: a batch other than 1 tells a batch-sized view from a fixed one."""
    _check("shufflenet_v2", batch=3)


def test_symbolic_batch_runs_any_batch():
    """Loaded with the batch left symbolic, one compiled graph serves batches 2 and 1."""
    path = zoo.export("shufflenet_v1", SIZE)
    cg = compile_graph(optimize(load_onnx(path)), backend="cpu", device="cpu")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (2, 1):
        x = torch.randn(batch, 3, SIZE, SIZE)
        want = torch.from_numpy(sess.run(None, {"x": x.numpy()})[0])
        assert _rel(cg(x)[0], want) <= MAX_REL


def test_exports_are_opset_9_with_separate_batch_norms():
    """The corpus is what the issue describes: opset 9, batch norms not folded by the exporter, LRN both
    as the ONNX op (GoogLeNet) and as torch's 3-d average pool (AlexNet)."""
    import onnx

    ops = {}
    for name in ("alexnet", "googlenet", "densenet_small"):
        model = onnx.load(str(zoo.export(name, SIZE)))
        assert model.opset_import[0].version == 9
        ops[name] = {n.op_type for n in model.graph.node}
    assert "LRN" in ops["googlenet"] and "LRN" not in ops["alexnet"] and "AveragePool" in ops["alexnet"]
    assert "BatchNormalization" in ops["densenet_small"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_model_at_224(name):
    _check(name, batch=2, size=224)
