"""The runtime: compile_graph, CompiledGraph calls (checks, buffers, library kernels, outputs), the
torch.library custom op under torch.compile, the graph cache, print_kernels and ``kernelize run``."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
import weakref
from argparse import Namespace

import pytest
import torch

from kernelize.autokernel.kernels import (
    Compute,
    LibraryKernel,
    Load,
    PointwiseKernel,
    Store,
)
from kernelize.ir import evaluate, optimize
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Op
from kernelize.ir.shapes import ShapeError, Sym
from kernelize.runtime import BACKENDS, CompiledModule, compile_graph, print_kernels
from kernelize.runtime.cache import GRAPHS, graph_fingerprint

B = Sym.of("batch")


def _norm_graph(eps: float = 1e-6) -> Graph:
    g = Graph()
    x = g.input("x", (B, 32), "f32")
    w = g.input("w", (32,), "f32")
    h = g.mul(g.sigmoid(x), x)
    g.output(g.rmsnorm(h, w, eps), h)
    return g


def test_reference_backend_is_evaluate_and_module_wrapper():
    g = _norm_graph()
    cg = compile_graph(g, backend="reference")
    xs = [torch.randn(3, 32), torch.randn(32)]
    for a, b in zip(cg(*xs), evaluate(g, xs)):
        torch.testing.assert_close(a, b)
    y, h = CompiledModule(cg)(*xs)
    torch.testing.assert_close(h, evaluate(g, xs)[1])


def test_inputs_are_checked_with_clear_errors():
    cg = compile_graph(_norm_graph(), backend="triton", device="cpu")
    with pytest.raises(TypeError, match="input 'x' must have dtype torch.float32"):
        cg(torch.randn(3, 32).double(), torch.randn(32))
    with pytest.raises(ShapeError, match="input 'w'"):
        cg(torch.randn(3, 32), torch.randn(31))
    with pytest.raises(ValueError, match="takes 2 inputs"):
        cg(torch.randn(3, 32))
    with pytest.raises(ValueError, match="compiled for cpu"):
        cg.run([torch.randn(3, 32, device="meta"), torch.randn(32, device="meta")])


def test_unknown_backend_and_unusable_device(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        compile_graph(_norm_graph(), backend="tpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        compile_graph(_norm_graph(), backend="triton", device="cpu", cache=False)
    assert set(BACKENDS) == {"triton", "cuda", "cpu"}


def test_gpu_generators_leave_matmuls_to_cublas_on_a_real_gpu_only(monkeypatch):
    from kernelize.autokernel.plan import plan
    from kernelize.codegen.cuda import CudaBackend
    from kernelize.codegen.triton import TritonBackend

    g = Graph()
    x, w = g.input("x", (B, 64), "f32"), g.input("w", (64, 32), "f32")
    g.output(g.sigmoid(g.matmul(x, w)))
    kinds = lambda backend: [str(k.kind) for k in plan(g, backend.plan_settings).kernels]  # noqa: E731
    assert kinds(TritonBackend()) == ["matmul"]  # no GPU here: the generated matmul is what tests check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kinds(CudaBackend(arch="sm_90")) == ["library", "pointwise"]  # cuBLAS, then the epilogue
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kinds(TritonBackend()) == ["library", "pointwise"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kinds(TritonBackend()) == ["matmul"]


def test_triton_plan_end_to_end_with_symbolic_batch():
    g = _norm_graph()
    cg = compile_graph(g, backend="triton", device="cpu")
    assert [str(k.kind) for k in cg.plan.kernels] == ["row"] and len(cg.kernels) == 1
    assert "def k0(" in cg.kernels[0].source
    for b in (1, 5, 2):
        xs = [torch.randn(b, 32), torch.randn(32)]
        for a, w in zip(cg(*xs), evaluate(g, xs)):
            torch.testing.assert_close(a, w)
    # non-contiguous inputs are made contiguous by the runtime
    xt = torch.randn(32, 4).T
    torch.testing.assert_close(cg(xt, torch.ones(32))[1], evaluate(g, [xt.contiguous(), torch.ones(32)])[1])


def test_library_kernel_views_liveness_and_aliasing():
    """conv (library) -> relu (generated); outputs include a view of a buffer and an input itself."""
    g = Graph()
    x = g.input("x", (B, 2, 6, 6), "f32")
    w = g.input("w", (4, 2, 3, 3), "f32")
    c = g.conv(x, w)
    zero = g.scalar(0.0, "f32")
    y = g.max(c, zero)
    flat = g.view(y, (B, 64))
    g.output(flat, x)
    lib = LibraryKernel("conv", c.shape, node=c, inputs=(x, w))
    relu = PointwiseKernel(
        "relu",
        c.shape,
        (Load(c, (64, 16, 4, 1)), Load(zero, (0, 0, 0, 0)), Compute(Op.MAX, DType.F32, (0, 1))),
        (Store(2, y, (64, 16, 4, 1)),),
    )
    cg = compile_graph(g, backend="triton", device="cpu", plan=[lib, relu])
    assert cg._steps[1].free == (c,)  # the conv output dies after the relu kernel reads it
    xs = [torch.randn(2, 2, 6, 6), torch.randn(4, 2, 3, 3)]
    got = cg(*xs)
    want = evaluate(g, xs)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], xs[0]) and got[1].data_ptr() != xs[0].data_ptr()  # copied, not aliased


def test_only_graphs_whose_outputs_are_kernel_buffers_skip_the_alias_check():
    """Outputs that generated kernels write (or views of them) are fresh: no copy, no check. An output that
    is an input, or two outputs viewing one buffer, still come back as separate memory."""
    own = compile_graph(optimize(_norm_graph()), backend="cpu")
    assert own._own_outputs
    xs = [torch.randn(5, 32), torch.randn(32)]
    got = own(*xs)
    assert len({t.data_ptr() for t in (*got, *xs)}) == 4

    g = Graph()
    x = g.input("x", (B, 32), "f32")
    y = g.exp(x)
    g.output(y, g.view(y, (B, 2, 16)), x)
    shared = compile_graph(g, backend="cpu")
    assert not shared._own_outputs
    xs = [torch.randn(3, 32)]
    got = shared(*xs)
    assert len({t.data_ptr() for t in (*got, *xs)}) == 4  # the second view and the input were copied
    torch.testing.assert_close(got[1], torch.exp(xs[0]).view(3, 2, 16))
    assert torch.equal(got[2], xs[0])


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_an_output_viewing_a_buffer_a_later_kernel_reads_outlives_that_kernel(backend):
    """`v` is a slice of the matmul's buffer, which the sigmoid kernel also reads last: the buffer must
    stay alive until the outputs are materialised (it was freed after the sigmoid kernel)."""
    g = Graph()
    x = g.input("x", (B, 8), "f32")
    w = g.input("w", (12, 8), "f32")
    y = g.matmul(x, g.transpose(w))
    head, v = g.slice(y, 1, 0, 8), g.slice(y, 1, 8, 12)
    g.output(g.sigmoid(head), g.view(v, (B, 2, 2)))
    cg = compile_graph(g, backend=backend, device="cpu")
    assert len(cg.plan.kernels) == 2, cg.plan.kernels
    xs = [torch.randn(3, 8), torch.randn(12, 8)]
    for got, want in zip(cg(*xs), evaluate(g, xs)):
        torch.testing.assert_close(got, want)


def test_graph_cache_and_fingerprint():
    a, b, c = _norm_graph(), _norm_graph(), _norm_graph(eps=1e-5)
    assert graph_fingerprint(a) == graph_fingerprint(b) != graph_fingerprint(c)
    cg1 = compile_graph(a, backend="triton", device="cpu")
    before = GRAPHS.hits
    cg2 = compile_graph(b, backend="triton", device="cpu")
    assert cg1 is cg2 and GRAPHS.hits == before + 1
    assert compile_graph(c, backend="triton", device="cpu") is not cg1


def test_torch_compile_fullgraph_traces_through_the_custom_op():
    g = _norm_graph()
    cg = compile_graph(g, backend="triton", device="cpu")

    def model(x, w):
        y, h = cg(x * 2, w)
        return y + h

    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    xs = [torch.randn(3, 32), torch.randn(32)]
    want = sum(evaluate(g, [xs[0] * 2, xs[1]]))
    torch.testing.assert_close(compiled(*xs), want)
    # the fake implementation gives shapes and dtypes without running anything
    with torch._subclasses.FakeTensorMode():
        y, h = torch.ops.kernelize.run_graph(cg.key, [torch.empty(7, 32), torch.empty(32)])
    assert y.shape == (7, 32) and h.dtype == torch.float32


def test_print_kernels_shows_plan_and_source():
    out = io.StringIO()
    print_kernels(optimize(_norm_graph()), "triton", file=out)
    text = out.getvalue()
    assert "# plan: 1 kernels" in text and "@triton.jit" in text and "tl.rsqrt" in text


def _tiny_onnx(path):
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 4], torch.randn(8, 4).flatten().tolist())
    b = helper.make_tensor("b", TensorProto.FLOAT, [4], torch.randn(4).tolist())
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("Softmax", ["r"], ["y"], axis=-1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    graph = helper.make_graph(nodes, "tiny", [x], [y], [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_run_main_compares_with_reference(tmp_path, capsys):
    from kernelize.tools import run_main

    model = tmp_path / "tiny.onnx"
    _tiny_onnx(model)
    for backend in ("reference", "triton"):
        assert run_main(Namespace(model=str(model), backend=backend, inputs=None, repeat=2)) == 0
        out = capsys.readouterr().out
        assert "output [2, 4] f32: max |diff| vs reference" in out and "ms per run" in out
        diff = float(out.split("vs reference = ")[1].split()[0])
        assert diff < 1e-5
    import numpy as np

    np.savez(tmp_path / "in.npz", x=np.ones((3, 8), dtype=np.float32))
    args = Namespace(model=str(model), backend="triton", inputs=str(tmp_path / "in.npz"), repeat=1)
    assert run_main(args) == 0
    assert "output [3, 4]" in capsys.readouterr().out


def _reshape_by_shape_onnx(path):
    """``expand(c, reshape(concat(shape(x)[0], [4]), [-1]))`` with a symbolic batch, as BERT's export
    writes its position ids: the reshaped shape is a run-time tensor unless the batch has a size at load."""
    import onnx
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
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_run_pins_symbolic_dims_that_a_reshape_needs_at_load_time(tmp_path, capsys):
    from kernelize.ir.errors import UnsupportedOpError
    from kernelize.ir.onnx_frontend import load_onnx
    from kernelize.tools import run_main

    model = tmp_path / "reshape.onnx"
    _reshape_by_shape_onnx(model)
    with pytest.raises(UnsupportedOpError, match="symbolic sizes"):
        load_onnx(model)  # what `kernelize run` did before it pinned the dims
    args = Namespace(model=str(model), backend="cpu", inputs=None, repeat=1, dim=None)
    assert run_main(args) == 0
    out = capsys.readouterr().out
    assert "batch=2" in out and "output [2, 4] f32: max |diff| vs reference = 0" in out
    assert run_main(Namespace(**{**vars(args), "dim": ["batch=3"]})) == 0
    assert "output [3, 4]" in capsys.readouterr().out
    assert run_main(Namespace(**{**vars(args), "dim": ["batch"]})) == 2
    assert "expected NAME=SIZE" in capsys.readouterr().err


def test_run_compare_onnxruntime_prints_both_times_and_the_difference(tmp_path, capsys, monkeypatch):
    from kernelize.tools import run_main

    model = tmp_path / "tiny.onnx"
    _tiny_onnx(model)
    args = Namespace(model=str(model), backend="cpu", inputs=None, repeat=2, compare="onnxruntime")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if the extra were not installed
    with pytest.raises(RuntimeError, match=r"kernelize\[onnx\]"):
        run_main(args)
    monkeypatch.undo()
    pytest.importorskip("onnxruntime")
    capsys.readouterr()
    assert run_main(args) == 0
    out = capsys.readouterr().out
    rel = float(out.split("vs onnxruntime = ")[1].split("relative ")[1].split(")")[0])
    assert rel < 1e-5 and "kernelize / onnxruntime = " in out and "onnxruntime: " in out


def test_cli_run_sets_the_interpreter_itself(tmp_path):
    model = tmp_path / "tiny.onnx"
    _tiny_onnx(model)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "kernelize", "run", str(model), "--backend", "triton", "--repeat", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interpreter" in proc.stdout and "max |diff| vs reference" in proc.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_gpu_matches_reference():
    g = _norm_graph()
    cg = compile_graph(g, backend="triton", device="cuda")
    xs = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    for a, w in zip(cg(*xs), evaluate(g, [x.cpu() for x in xs])):
        torch.testing.assert_close(a.cpu(), w, rtol=1e-4, atol=1e-5)


def test_repeated_shapes_reuse_the_bindings_and_new_ones_are_still_checked():
    """(perf) The per-shape bindings cache: the same signature runs without re-checking, a new shape is
    bound afresh, and wrong inputs after a cached call still raise the same errors."""
    g = _norm_graph()
    cg = compile_graph(g, backend="cpu")
    for rows in (3, 3, 5, 3, 1):
        xs = [torch.randn(rows, 32), torch.randn(32)]
        for a, b in zip(cg(*xs), evaluate(g, xs)):
            torch.testing.assert_close(a, b)
    assert len(cg._bound) == 3
    with pytest.raises(TypeError, match="input 'x' must have dtype torch.float32"):
        cg(torch.randn(3, 32).double(), torch.randn(32))
    with pytest.raises(ShapeError, match="input 'w'"):
        cg(torch.randn(3, 32), torch.randn(31))
    with pytest.raises(ValueError, match="takes 2 inputs"):
        cg(torch.randn(3, 32))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        cg(torch.randn(3, 32), [1.0] * 32)
    with pytest.raises(ValueError, match="compiled for cpu"):
        cg.run([torch.randn(3, 32, device="meta"), torch.randn(32, device="meta")])
    xs = [torch.randn(0, 32), torch.randn(32)]  # empty outputs skip the launch
    assert [tuple(o.shape) for o in cg(*xs)] == [(0, 32), (0, 32)]


def test_one_kernel_graphs_take_the_direct_path_and_keep_the_output_rules():
    """(perf) A graph of one generated kernel from inputs (and constants) to outputs skips the buffer
    bookkeeping; graphs returning an input, one value twice or a view keep the general path's copies."""
    g = _norm_graph()
    cg = compile_graph(g, backend="cpu")
    assert cg._direct is not None  # one row kernel writing both outputs
    xs = [torch.randn(32, 5).t(), torch.randn(32)]  # a non-contiguous x
    for a, b in zip(cg(*xs), evaluate(g, xs)):
        torch.testing.assert_close(a, b)
    c = Graph()
    x = c.input("x", (B, 8), "f32")
    c.output(c.add(x, c.const(torch.arange(8.0))))
    cc = compile_graph(c, backend="cpu")
    assert cc._direct is not None and any(isinstance(r, torch.Tensor) for r in cc._direct[0])
    torch.testing.assert_close(cc(torch.ones(3, 8))[0], torch.ones(3, 8) + torch.arange(8.0))
    twice = Graph()
    x = twice.input("x", (B, 8), "f32")
    y = twice.unary(Op.EXP, x)
    twice.output(y, y, x)
    ct = compile_graph(twice, backend="cpu")
    assert ct._direct is None
    x0 = torch.randn(2, 8)
    a, b, same = ct(x0)
    assert a.data_ptr() != b.data_ptr() and same.data_ptr() != x0.data_ptr() and torch.equal(same, x0)


def test_outputs_that_reshape_the_kernels_write_take_the_direct_path():
    """(perf) A projection of ``[B, 1, K]`` rows writes ``[B, N]`` and returns it viewed as ``[B, 1, N]``
    (every decode step of a hub layer): the direct path returns the view of the buffer it wrote."""
    g = Graph()
    x = g.input("x", (B, 1, 16), "f32")
    w = g.input("w", (8, 16), "f32")
    y = g.matmul(g.view(x, (B, 16)), g.transpose(w))
    g.output(g.view(g.unary(Op.TANH, y), (B, 1, 8)))
    cg = compile_graph(g, backend="cpu")
    assert cg._direct is not None and cg._direct.views == ((B, 1, 8),)
    for rows in (1, 3, 40):  # few-row kernel; library GEMM with the epilogue (FEW_ROWS is 16)
        xs = [torch.randn(rows, 1, 16), torch.randn(8, 16)]
        (got,) = cg(*xs)
        assert got.shape == (rows, 1, 8) and got.is_contiguous()
        torch.testing.assert_close(got, evaluate(g, xs)[0])
    with pytest.raises(ValueError, match="not one generated kernel"):  # run_into takes exact writes only
        cg.run_into(xs, [torch.empty(40, 1, 8)])


def test_a_declined_library_call_is_one_row_of_the_profile():
    """A matmul kernel tries its library call (``fresh``) and, below its rows, launches the few-row kernel:
    the profile counts one call, not two."""
    from torch.profiler import profile

    g = Graph()
    x = g.input("x", (B, 16), "f32")
    w = g.input("w", (8, 16), "f32")
    g.output(g.add(g.matmul(x, g.transpose(w)), g.input("b", (8,), "f32")))
    cg = compile_graph(g, backend="cpu")
    xs = [torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)]
    cg(*xs)
    assert cg._steps[0].compiled.fresh is not None
    with profile() as prof:
        cg(*xs)
        cg(*[torch.randn(40, 16), *xs[1:]])
    rows = [e for e in prof.key_averages() if e.key.startswith("kernelize::matmul[")]
    assert [e.count for e in rows] == [2], [(e.key, e.count) for e in rows]


def _const_graph(value: float) -> tuple[Graph, torch.Tensor]:
    g = Graph()
    x = g.input("x", (256, 1024), "f32")
    c = g.const((value + torch.arange(1024.0)).repeat(256, 1))  # 1 MiB: a weight folded into the graph
    g.output(g.add(x, c))
    return g, c.arg.tensor


def test_graphs_nobody_references_are_released_with_their_constants():
    refs = []
    for i in range(3):
        g, const = _const_graph(float(i))
        cg = compile_graph(g, backend="cpu", device="cpu")
        assert cg(torch.ones(256, 1024))[0][0, 0] == i + 1 and len(cg.kernels) == 1
        refs.append((weakref.ref(cg), weakref.ref(const), cg.key))
        del g, const, cg
    kept, const = _const_graph(7.0)
    kept_cg = compile_graph(kept, backend="cpu", device="cpu")
    del kept, const
    gc.collect()
    assert [r() for r, _, _ in refs] == [None] * 3, "a compiled graph outlived every user reference"
    assert [c() for _, c, _ in refs] == [None] * 3, "a dropped graph's constant is still held"
    with pytest.raises(RuntimeError, match="released"):
        torch.ops.kernelize.run_graph(refs[0][2], [torch.ones(256, 1024)])
    # a live graph is still found by its key (the custom op torch.compile traces to)
    (y,) = torch.ops.kernelize.run_graph(kept_cg.key, [torch.zeros(256, 1024)])
    assert torch.equal(y, (7.0 + torch.arange(1024.0)).repeat(256, 1))
    assert compile_graph(_const_graph(7.0)[0], backend="cpu", device="cpu") is kept_cg  # still cached


def test_inputs_that_require_grad_raise_instead_of_dropping_the_gradient():
    g = _norm_graph()
    cg = compile_graph(g, backend="cpu", device="cpu")
    x, w = torch.randn(3, 32, requires_grad=True), torch.randn(32)
    with pytest.raises(ValueError, match=r"input 'x' .*requires grad.*torch\.no_grad\(\).*Mode\.TRAINING"):
        cg(x, w)
    with pytest.raises(ValueError, match="requires grad"):
        CompiledModule(cg)(x.detach(), w.requires_grad_())
    w.requires_grad_(False)
    with torch.no_grad():
        y, _ = cg(x, w)
    torch.testing.assert_close(y, evaluate(g, [x.detach(), w])[0])

    class Wrapped(torch.autograd.Function):  # how hub layers call compiled graphs when training
        @staticmethod
        def forward(ctx, x, w):
            return cg(x, w)[0]

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None

    out = Wrapped.apply(x, w)
    out.sum().backward()
    assert out.requires_grad and torch.equal(x.grad, torch.full_like(x, 2.0))


def test_generated_kernels_are_named_rows_in_a_torch_profile():
    from torch.profiler import profile

    from kernelize.attention import scaled_dot_product_attention

    g = Graph()
    x = g.input("x", ("n", 64), "f32")
    g.output(g.softmax(g.mul(x, 2.0)))
    cg = compile_graph(g, backend="cpu")
    q = torch.randn(1, 2, 5, 16)
    cg(torch.randn(3, 64))
    scaled_dot_product_attention(q, q, q, is_causal=True)
    with profile() as prof:
        cg(torch.randn(3, 64))
        scaled_dot_product_attention(q, q, q, is_causal=True)
    names = {e.key for e in prof.key_averages()}
    assert any(n.startswith("kernelize::row[") and "softmax" in n for n in names), names
    assert "kernelize::attention[none, causal=True]" in names, names


def test_unpooled_outputs_are_fresh_and_cached_apart() -> None:
    """pool_outputs=False: every call's outputs are new tensors nothing else references (the pool would
    hand the dropped buffer out again and keep a reference to it)."""
    g = Graph()
    x = g.input("x", ("n", 1024), "f32")
    g.output(g.exp(x))
    pooled = compile_graph(g, backend="cpu")
    fresh = compile_graph(g, backend="cpu", pool_outputs=False)
    assert pooled is not fresh and fresh is compile_graph(g, backend="cpu", pool_outputs=False)
    a = torch.randn(512, 1024)
    out = pooled(a)[0]
    assert sys.getrefcount(out) == 3  # `out`, the argument and the pool's slot
    ptr = out.data_ptr()
    del out
    assert pooled(a)[0].data_ptr() == ptr
    out = fresh(a)[0]
    assert sys.getrefcount(out) == 2
    torch.testing.assert_close(out, a.exp())


def test_progress_bar_is_drawn_while_a_slow_compile_runs(monkeypatch):
    """Kernels finish a translation unit at a time: the bar must show (and tick) before the first one."""
    import time

    from kernelize.runtime import compiled

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    seen_during: list[str] = []

    class Slow:
        name = "slow"

        def compile_many(self, kernels, progress):
            time.sleep(compiled.BAR_DELAY_S + 0.6)
            seen_during.append(err.getvalue())
            progress(len(kernels))
            return ["done"] * len(kernels)

    kernels = [PointwiseKernel(name=f"k{i}", domain=()) for i in range(3)]
    assert compiled._compile_all(Slow(), kernels) == {"k0": "done", "k1": "done", "k2": "done"}
    assert "compiling slow kernels" in seen_during[0] and "0/3" in seen_during[0]


def _chain_graph() -> Graph:
    """Three kernels with two intermediates between them (a library matmul splits the pointwise work)."""
    g = Graph()
    x = g.input("x", (B, 64), "f32")
    w = g.const(torch.randn(64, 48) * 0.1)
    h = g.exp(g.mul(x, g.const(0.5)))
    y = g.add(g.matmul(h, w), g.const(1.0))
    g.output(g.softmax(g.mul(y, y)))
    return g


def test_intermediates_live_in_one_arena_that_outputs_never_alias():
    import threading

    g = _chain_graph()
    cg = compile_graph(g, backend="cpu", cache=False)
    assert cg._lives, "the chain has intermediates"
    xs = [torch.randn(n, 64) for n in (5, 9, 5)]
    outs = [cg(x)[0] for x in xs]
    for x, out in zip(xs, outs, strict=True):  # earlier outputs survive later calls
        torch.testing.assert_close(out, evaluate(g, [x])[0], rtol=1e-5, atol=1e-6)
    arena = cg._arenas[next(iter(cg._arenas))]
    lo, hi = arena.block.data_ptr(), arena.block.data_ptr() + arena.block.numel()
    assert not any(lo <= o.data_ptr() < hi for o in outs)
    assert len(cg._arenas) == 2  # one per input signature
    # calls from two threads at once: one takes the arena, the other allocates
    results: dict[int, torch.Tensor] = {}
    big = [torch.randn(4096, 64) for _ in range(2)]

    def call(i: int) -> None:
        for _ in range(5):
            results[i] = cg(big[i])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        torch.testing.assert_close(results[i], evaluate(g, [big[i]])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_run_into_writes_outputs_where_asked_even_over_an_input(backend) -> None:
    """A row kernel (softmax: statistics, then one write pass) may write its output over its input; the
    other outputs go to new buffers; a wrong out and a graph of several kernels raise."""
    from kernelize import hub

    def softmax_and_max(x):
        return torch.softmax(x, -1), x.amax(-1, keepdim=True)

    x = torch.randn(37, 300)
    want = softmax_and_max(x)
    with hub.use_backend(backend):
        buf = x.clone()
        got = hub.run_into(softmax_and_max, [buf], [buf, None])
        assert got[0].data_ptr() == buf.data_ptr()
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        with pytest.raises(ValueError, match="output 0"):
            hub.run_into(softmax_and_max, [x], [torch.empty(37, 299), None])

    def two_kernels(x):  # a row reduction, then a column reduction of its result: two kernels
        return torch.softmax(x, -1).sum(0)

    if backend == "cpu":
        with pytest.raises(ValueError, match="not one generated kernel"):
            hub.run_into(two_kernels, [x], [None])
