"""The CPU matmul kernels (few-row kernel and library path) against the reference executor.

Graphs go through the real planner (``compile_graph(g, backend="cpu")``): weight matmuls with every
epilogue the planner fuses (bias, activation, ``silu(gate) * up`` over one merged gate|up weight, residual
add), weights in f32 / f16 / bf16, row counts on both sides of ``FEW_ROWS``, K and N awkward.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kernelize.autokernel.kernels import Compute, KernelKind
from kernelize.autokernel.matmul import FEW_ROWS
from kernelize.autokernel.plan import PlanSettings, plan
from kernelize.codegen import cpu_gemv
from kernelize.codegen.cpu_backend import CpuBackend
from kernelize.codegen.cpu_gemv import DirectGemm, direct_gemm, lowp_gemm_in_f32
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Op
from kernelize.ir.reference import evaluate
from kernelize.runtime.compiled import compile_graph

EPILOGUES = ("none", "bias", "bias_gelu", "gated_silu", "residual")
TOL = {DType.F32: (2e-4, 2e-4), DType.F16: (2e-2, 2e-2), DType.BF16: (5e-2, 5e-2)}


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    old = os.environ.get("KERNELIZE_CACHE_DIR")
    os.environ["KERNELIZE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kzcache"))
    yield
    if old is None:
        os.environ.pop("KERNELIZE_CACHE_DIR", None)
    else:
        os.environ["KERNELIZE_CACHE_DIR"] = old


def silu(g: Graph, v):
    return g.mul(v, g.sigmoid(v))


def linear_graph(rows, k: int, n: int, dtype: DType, epilogue: str, transposed_w: bool = False) -> Graph:
    """``epilogue(x @ W.T)`` with x (rows..., K) and W (N, K) (or W (K, N) when ``transposed_w``)."""
    g = Graph()
    rows = tuple(rows)
    x = g.input("x", (*rows, k), dtype)
    n_w = 2 * n if epilogue == "gated_silu" else n
    w = g.input("w", (k, n_w) if transposed_w else (n_w, k), dtype)
    wt = w if transposed_w else g.transpose(w)
    if epilogue == "gated_silu":
        gate = g.matmul(x, g.slice(wt, 1, 0, n))
        up = g.matmul(x, g.slice(wt, 1, n, 2 * n))
        g.output(g.mul(silu(g, gate), up))
        return g
    y = g.matmul(x, wt)
    if epilogue in ("bias", "bias_gelu"):
        y = g.add(y, g.input("b", (n,), dtype))
    if epilogue == "bias_gelu":
        y = g.gelu(y)
    if epilogue == "residual":
        y = g.add(y, g.input("r", (*rows, n), dtype))
    g.output(y)
    return g


def inputs_for(g: Graph, sizes: dict[str, int], gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for node in g.inputs:
        shape = [sizes[str(d)] if not isinstance(d, int) else d for d in node.shape]
        t = torch.randn(shape, generator=gen) * (1.0 / max(1, shape[-1]) ** 0.5 if node.arg == "w" else 1.0)
        out.append(t.to(node.dtype.torch))
    return out


def check(g: Graph, inputs: list[torch.Tensor], dtype: DType) -> None:
    cg = compile_graph(g, backend="cpu", cache=False)
    (got,) = cg(*inputs)
    (want,) = evaluate(g, inputs)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_planner_merges_gate_and_up_into_one_matmul_kernel():
    g = linear_graph(("m",), 64, 32, DType.F32, "gated_silu")
    merged = plan(g, PlanSettings(merge_matmuls=True))
    (k,) = merged.kernels
    assert k.kind is KernelKind.MATMUL
    assert sum(isinstance(e, Compute) and e.op is Op.MATMUL for e in k.body) == 2
    assert len(plan(g).kernels) == 2  # without the switch: one matmul per kernel


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
def test_epilogues_and_dtypes_few_and_many_rows(epilogue, dtype):
    """One compiled graph with symbolic rows serves 1, 3 and 16 rows (few-row kernel) and 17 (library)."""
    gen = torch.Generator().manual_seed(0)
    g = linear_graph(("m",), 67, 33, dtype, epilogue)
    cg = compile_graph(g, backend="cpu", cache=False)
    for m in (1, 3, FEW_ROWS, FEW_ROWS + 1):
        inputs = inputs_for(g, {"m": m}, gen)
        (got,) = cg(*inputs)
        (want,) = evaluate(g, inputs)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=f"{m} rows")


@pytest.mark.parametrize("k,n", [(1, 7), (7, 1), (4097, 7), (64, 4097), (4097, 1)])
def test_awkward_sizes(k, n):
    """Split-K (few columns, long K), one column, K shorter than a vector, a tail block of columns."""
    gen = torch.Generator().manual_seed(1)
    for m in (1, 2):
        g = linear_graph((m,), k, n, DType.F32, "bias")
        check(g, inputs_for(g, {}, gen), DType.F32)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_weight_contiguous_along_n_and_batched_rows(dtype):
    """W stored (K, N) takes the axpy form; rows spread over two leading axes are flattened."""
    gen = torch.Generator().manual_seed(2)
    g = linear_graph((2, 3), 45, 70, dtype, "residual", transposed_w=True)
    check(g, inputs_for(g, {}, gen), dtype)


def test_non_contiguous_inputs_and_transposed_activation():
    gen = torch.Generator().manual_seed(3)
    g = Graph()
    xt = g.input("x", (40, 3), DType.F32)  # x read through a transpose: K stride 40... no, 3
    w = g.input("w", (9, 40), DType.F32)
    g.output(g.matmul(g.transpose(xt), g.transpose(w)))
    x = torch.randn(3, 40, generator=gen).t()  # a non-contiguous tensor for a contiguous input
    wv = torch.randn(40, 9, generator=gen).t()
    assert not x.is_contiguous() and not wv.is_contiguous()
    check(g, [x, wv], DType.F32)


def test_batched_right_operand_keeps_per_row_weights():
    """A matmul whose right operand varies with the batch (attention-like) reads its own columns per row."""
    gen = torch.Generator().manual_seed(4)
    g = Graph()
    a = g.input("a", (3, 1, 20), DType.F32)
    b = g.input("b", (3, 20, 5), DType.F32)
    g.output(g.matmul(a, b))
    check(g, [torch.randn(3, 1, 20, generator=gen), torch.randn(3, 20, 5, generator=gen)], DType.F32)


def test_f64_accumulates_in_f64():
    gen = torch.Generator().manual_seed(5)
    g = linear_graph((2,), 33, 9, DType.F64, "bias")
    inputs = inputs_for(g, {}, gen)
    cg = compile_graph(g, backend="cpu", cache=False)
    torch.testing.assert_close(cg(*inputs)[0], evaluate(g, inputs)[0], atol=1e-12, rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
def test_full_grid(dtype):
    """M in {1, 2, 3, 16, 17} x K, N in {1, 7, 64, 4097} x every epilogue."""
    gen = torch.Generator().manual_seed(6)
    for k, n, epilogue in itertools.product((1, 7, 64, 4097), (1, 7, 64, 4097), EPILOGUES):
        g = linear_graph(("m",), k, n, dtype, epilogue)
        cg = compile_graph(g, backend="cpu", cache=False)
        for m in (1, 2, 3, 16, 17):
            inputs = inputs_for(g, {"m": m}, gen)
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(
                cg(*inputs)[0].float(),
                evaluate(g, inputs)[0].float(),
                atol=atol,
                rtol=rtol,
                msg=f"m={m} k={k} n={n} {epilogue}",
            )


def test_linear_over_image_rows_is_one_gemm_above_few_rows():
    """x [B, H, W, C] @ W.T: above FEW_ROWS the weights are shared by every batch index, so torch runs one
    GEMM over B*H*W rows (not a batched GEMM of H small ones); results equal the reference."""
    gen = torch.Generator().manual_seed(3)
    g = linear_graph(("b", "h", "w"), 16, 24, DType.F32, "bias_gelu")
    for sizes in ({"b": 1, "h": 7, "w": 9}, {"b": 2, "h": 3, "w": 1}, {"b": 1, "h": 1, "w": 5}):
        check(g, inputs_for(g, sizes, gen), DType.F32)


@pytest.mark.parametrize("dtype", [DType.BF16, DType.F16])
@pytest.mark.parametrize("choice", ["f32", "native"])
def test_16bit_gemm_above_few_rows_widened_or_native(monkeypatch, dtype, choice):
    """Above FEW_ROWS a bf16 / f16 GEMM runs widened to f32 (`f32`: the product equals torch's f32 GEMM of
    the widened operands, rounded once) or in torch's 16-bit GEMM (`native`); both match the reference,
    over shared weights on two row axes too."""
    monkeypatch.setenv("KERNELIZE_CPU_LOWP_GEMM", choice)
    assert lowp_gemm_in_f32(dtype) is (choice == "f32")
    gen = torch.Generator().manual_seed(4)
    for rows, sizes in ((("m",), {"m": 40}), (("b", "s"), {"b": 2, "s": 20})):
        g = linear_graph(rows, 96, 50, dtype, "none")
        x, w = inputs_for(g, sizes, gen)
        (got,) = compile_graph(g, backend="cpu", cache=False)(x, w)
        widened = (x.float() @ w.float().T).to(dtype.torch)
        if choice == "f32":
            torch.testing.assert_close(got, widened, atol=0, rtol=0)
        check(g, [x, w], dtype)


def test_16bit_gemm_choice_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("KERNELIZE_CPU_LOWP_GEMM", "fast")
    with pytest.raises(ValueError, match="KERNELIZE_CPU_LOWP_GEMM='fast'"):
        lowp_gemm_in_f32(DType.BF16)


def const_linear_graph(rows, w: torch.Tensor, epilogue: str, bias: torch.Tensor | None = None) -> Graph:
    """``epilogue(x @ W.T + b)`` with W (N, K) and b constants of the graph, as ``load_onnx`` gives them."""
    g = Graph()
    x = g.input("x", (*rows, w.shape[1]), DType.F32)
    wt = g.transpose(g.const(w))
    y = g.matmul(x, wt)
    if bias is not None:
        y = g.add(y, g.const(bias))
    if epilogue in ("gelu", "gelu_tanh"):
        y = g.gelu(y, "tanh" if epilogue == "gelu_tanh" else "none")
    if epilogue == "residual":
        y = g.add(y, g.input("r", (*rows, w.shape[0]), DType.F32))
    if epilogue == "gate":  # a gated MLP's act(gate) * up, act(gate) computed by an earlier kernel
        y = g.mul(g.input("r", (*rows, w.shape[0]), DType.F32), y)
    g.output(y)
    return g


def check_row_counts(g: Graph, gen: torch.Generator) -> None:
    """One compiled graph over ``(b, s)`` rows against the reference: 40, 51 and 258 rows (the GEMM
    path) and 2 (the few-row kernel)."""
    cg = compile_graph(g, backend="cpu", cache=False)
    for sizes in ({"b": 1, "s": 40}, {"b": 3, "s": 17}, {"b": 1, "s": 2}, {"b": 2, "s": 129}):
        inputs = inputs_for(g, sizes, gen)
        (got,) = cg(*inputs)
        (want,) = evaluate(g, inputs)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=str(sizes))


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts the GEMMs that ran in oneDNN over a packed constant weight (with or without the epilogue
    kernel after them)."""
    from kernelize.codegen import cpu_gemv

    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "onednn")  # (the default only where torch runs AVX-512)
    if not cpu_gemv.onednn_gemm(torch.zeros(1, 1), torch.zeros(1, 1)):
        pytest.skip("torch without oneDNN linear ops")
    calls = []
    real = cpu_gemv._packed

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(cpu_gemv, "_packed", spy)
    return calls


@pytest.mark.parametrize("epilogue", ["none", "gelu", "residual"])
def test_constant_weight_gemm_runs_packed_in_onednn(packed_calls, epilogue):
    """Above FEW_ROWS an f32 matmul over a constant weight runs in oneDNN with the weight packed once; the
    same compiled graph serves other row counts (one pack), two row axes, and the few-row kernel below."""
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(70, 45, generator=gen) / 7, torch.randn(70, generator=gen)
    g = const_linear_graph(("b", "s"), w, epilogue, b)
    check_row_counts(g, gen)
    assert len(packed_calls) == 3  # the 2-row call took the few-row kernel


def test_constant_weight_stored_k_by_n_and_non_contiguous_activation(packed_calls):
    """An ONNX MatMul weight (K, N), read by an activation seen through a transpose."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(33, 50, generator=gen)  # (K, N)
    g = Graph()
    xt = g.input("x", (33, 40), DType.F32)
    g.output(g.matmul(g.transpose(xt), g.const(w)))
    x = torch.randn(40, 33, generator=gen).t().contiguous()
    check(g, [x], DType.F32)
    assert len(packed_calls) == 1


def test_cpu_gemm_choice_torch_skips_onednn_and_rejects_unknown_values(packed_calls, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    g = const_linear_graph(("m",), torch.randn(24, 16, generator=gen), "gelu")
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "torch")
    check(g, inputs_for(g, {"m": 30}, gen), DType.F32)
    assert packed_calls == []
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="KERNELIZE_CPU_GEMM='mkl'"):
        check(g, inputs_for(g, {"m": 30}, gen), DType.F32)


@pytest.fixture
def tiles_calls(monkeypatch):
    """Records the epilogue form of every GEMM that ran in the generated tiles (``tiles_gemm``)."""
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "generated")
    calls = []
    real = cpu_gemv._gemm_function

    def spy(*form):
        calls.append(form)
        return real(*form)

    monkeypatch.setattr(cpu_gemv, "_gemm_function", spy)
    return calls


@pytest.mark.parametrize(
    "epilogue,bias,form",
    [
        ("none", False, (False, "none", "", None)),
        ("none", True, (True, "none", "", None)),
        ("gelu", True, (True, "gelu", "none", None)),
        ("gelu_tanh", False, (False, "gelu", "tanh", None)),
        ("residual", True, (True, "none", "", "add")),
        ("gate", False, (False, "none", "", "mul")),
    ],
)
def test_constant_weight_gemm_runs_in_generated_tiles_with_its_epilogue(tiles_calls, epilogue, bias, form):
    """Above FEW_ROWS an f32 matmul over a constant weight runs the conv driver's tiles as a GEMM, its bias,
    GELU or residual applied before the store, into the kernel's output; rows that fill no whole tile, a
    contraction and columns that fill no whole panel (45, 70), several row counts on one compiled graph."""
    gen = torch.Generator().manual_seed(21)
    w, b = torch.randn(70, 45, generator=gen) / 7, torch.randn(70, generator=gen)
    g = const_linear_graph(("b", "s"), w, epilogue, b if bias else None)
    check_row_counts(g, gen)
    assert tiles_calls == [form] * 3  # the 2-row call took the few-row kernel


@pytest.mark.parametrize("m,k,n", [(17, 1, 1), (23, 3, 16), (31, 17, 33), (200, 300, 5), (7 * 6 + 1, 64, 48)])
def test_generated_tiles_gemm_on_awkward_sizes(tiles_calls, m, k, n):
    """The tiles' edges: one input channel, one output column, columns past a whole panel, rows past a
    whole tile, against the reference; bias + residual fused."""
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    g = const_linear_graph(("m",), w, "residual", b)
    inputs = inputs_for(g, {"m": m}, gen)
    (got,) = compile_graph(g, backend="cpu", cache=False)(*inputs)
    (want,) = evaluate(g, inputs)
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, k**0.5), rtol=1e-4)
    # one output column: the bias of one value is no per-column bias to the planner; the epilogue kernel adds
    assert tiles_calls == [(True, "none", "", "add") if n > 1 else (False, "none", "", None)]


def test_other_epilogues_run_the_plain_tiles_then_the_epilogue_kernel(tiles_calls):
    """A sigmoid after the GEMM (no fused form): the tiles write the product, the epilogue kernel the rest;
    a contraction longer than the tiles' zero row (KZ_ZERO_ROW) takes the library GEMM."""
    gen = torch.Generator().manual_seed(22)
    g = Graph()
    x = g.input("x", ("m", 16), DType.F32)
    g.output(g.sigmoid(g.matmul(x, g.transpose(g.const(torch.randn(24, 16, generator=gen))))))
    check(g, inputs_for(g, {"m": 33}, gen), DType.F32)
    assert tiles_calls == [(False, "none", "", None)]
    long_k = const_linear_graph(("m",), torch.randn(5, 8200, generator=gen) / 90, "none")
    check(long_k, inputs_for(long_k, {"m": 20}, gen), DType.F32)
    assert len(tiles_calls) == 1


def test_gemm_forms_a_graph_builds_before_its_first_call(monkeypatch):
    """The epilogue forms compile_many starts building in the background: a fused form per direct plan, the
    bare product for other epilogues, none where the tiles do not run the GEMMs or where the rows are static
    and few (a classifier at batch 1: the few-row kernel runs it)."""
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "generated")
    gen = torch.Generator().manual_seed(23)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    fused = plan(const_linear_graph(("m",), w, "gelu", b), CpuBackend().plan_settings).kernels
    g = Graph()
    g.output(g.sigmoid(g.matmul(g.input("x", ("m", 16), DType.F32), g.transpose(g.const(w)))))
    bare = plan(g, CpuBackend().plan_settings).kernels
    assert cpu_gemv.gemm_forms(fused) == {(True, "gelu", "none", None)}
    assert cpu_gemv.gemm_forms([*fused, *bare]) == {(True, "gelu", "none", None), cpu_gemv.PLAIN}
    few = plan(const_linear_graph((16,), w, "gelu", b), CpuBackend().plan_settings).kernels
    many = plan(const_linear_graph((17,), w, "gelu", b), CpuBackend().plan_settings).kernels
    assert cpu_gemv.gemm_forms(few) == set() and cpu_gemv.gemm_forms(many) == {(True, "gelu", "none", None)}
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "torch")
    assert cpu_gemv.gemm_forms(fused) == set()


@pytest.mark.parametrize("avx512", [False, True])
def test_cpu_gemm_default_is_the_generated_tiles_with_or_without_avx512(monkeypatch, avx512: bool):
    monkeypatch.delenv("KERNELIZE_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_gemv, "_avx512", lambda: avx512)
    assert cpu_gemv.cpu_gemm() == "generated"
    assert cpu_gemv.cpu_gemm(packed=False) == "onednn"  # training's unpacked products
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "generated")
    assert cpu_gemv.cpu_gemm(packed=False) == "generated"


def _matmul_kernel_of(g: Graph):
    (k,) = [k for k in plan(g, CpuBackend().plan_settings).kernels if k.kind is KernelKind.MATMUL]
    return k


@pytest.mark.parametrize(
    "epilogue,bias,want",
    [
        ("none", False, DirectGemm(None, None, "none", "")),
        ("none", True, DirectGemm(2, None, "none", "")),
        ("gelu", True, DirectGemm(2, None, "gelu", "none")),
        ("gelu", False, DirectGemm(None, None, "gelu", "none")),
        ("residual", True, "residual"),
        ("residual", False, "residual"),
        ("gate", False, "gate"),
    ],
)
def test_direct_gemm_recognises_bias_gelu_and_residual(monkeypatch, epilogue, bias, want):
    monkeypatch.setattr(cpu_gemv, "onednn_gelu", lambda: True)  # (by default only on AVX-512)
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(24, 16, generator=gen)
    g = const_linear_graph(("m",), w, epilogue, torch.randn(24, generator=gen) if bias else None)
    got = direct_gemm(_matmul_kernel_of(g))
    assert got is not None
    if want in ("residual", "gate"):
        assert got.residual is not None and (got.bias is not None) == bias and got.attr == "none"
        assert got.binary == ("add" if want == "residual" else "mul")
    else:
        assert got._replace(bias=got.bias is not None) == want._replace(bias=want.bias is not None)


@pytest.mark.parametrize("epilogue", ["gelu", "residual"])
def test_direct_gemm_takes_a_leading_axis_of_size_one(direct_calls, epilogue):
    """A static batch of 1 (an ONNX encoder at batch 1) is stored with stride 0 on that axis: still one
    oneDNN call (BERT and ViT at batch 1 had run every GEMM through the epilogue kernel)."""
    gen = torch.Generator().manual_seed(13)
    g = const_linear_graph((1, 40), torch.randn(24, 16, generator=gen) / 4, epilogue)
    assert direct_gemm(_matmul_kernel_of(g)) is not None
    check(g, inputs_for(g, {}, gen), DType.F32)
    assert direct_calls == [True]


def test_direct_gemm_declines_what_onednn_cannot_fuse():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(24, 16, generator=gen)
    g = Graph()  # an activation after the residual add: the epilogue kernel runs it
    x = g.input("x", ("m", 16), DType.F32)
    y = g.add(g.matmul(x, g.transpose(g.const(w))), g.input("r", ("m", 24), DType.F32))
    g.output(g.gelu(y))
    assert direct_gemm(_matmul_kernel_of(g)) is None
    g = Graph()  # a multiply by a per-column vector is not a bias
    x = g.input("x", ("m", 16), DType.F32)
    g.output(g.mul(g.matmul(x, g.transpose(g.const(w))), g.const(torch.randn(24, generator=gen))))
    assert direct_gemm(_matmul_kernel_of(g)) is None
    g = Graph()  # sigmoid is not a post-op here
    x = g.input("x", ("m", 16), DType.F32)
    g.output(g.sigmoid(g.matmul(x, g.transpose(g.const(w)))))
    assert direct_gemm(_matmul_kernel_of(g)) is None
    g = linear_graph(("m",), 16, 12, DType.F32, "gated_silu")  # two matmuls in one kernel
    assert direct_gemm(_matmul_kernel_of(g)) is None
    g = Graph()  # a weight of symbolic shape
    x = g.input("x", ("m", 16), DType.F32)
    g.output(g.matmul(x, g.input("w", (16, "n"), DType.F32)))
    assert direct_gemm(_matmul_kernel_of(g)) is None


@pytest.mark.parametrize("epilogue", ["none", "bias", "bias_gelu", "residual"])
def test_input_weight_in_linear_layout_runs_one_unpacked_onednn_call(direct_calls, packed_calls, epilogue):
    """A hub layer's weight is an input (it may change between calls): oneDNN reads it as it is, no pack;
    its bias (an input too) is a post-op. Results equal the reference, also after the weight changes."""
    gen = torch.Generator().manual_seed(14)
    g = linear_graph(("b", "s"), 45, 70, DType.F32, epilogue)
    plan_ = direct_gemm(_matmul_kernel_of(g))
    assert plan_ is not None and not plan_.packed
    cg = compile_graph(g, backend="cpu", cache=False)
    for sizes in ({"b": 2, "s": 40}, {"b": 1, "s": 3}):
        inputs = inputs_for(g, sizes, gen)
        for _ in range(2):
            (got,) = cg(*inputs)
            (want,) = evaluate(g, inputs)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=str(sizes))
            inputs[1].mul_(-0.5)  # an optimizer step in place: nothing of the old weight may be kept
    assert direct_calls == [True, True] and packed_calls == []


def test_input_weight_stored_k_by_n_takes_the_library_gemm(direct_calls):
    """A (K, N) weight input is not in the layout oneDNN reads unpacked: the GEMM + epilogue path runs."""
    gen = torch.Generator().manual_seed(15)
    g = linear_graph(("m",), 33, 50, DType.F32, "bias", transposed_w=True)
    check(g, inputs_for(g, {"m": 40}, gen), DType.F32)
    assert direct_calls == [False]


@pytest.fixture
def direct_calls(monkeypatch):
    """Counts the kernels whose output one oneDNN call produced (no epilogue kernel)."""
    from kernelize.codegen import cpu_gemv

    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "onednn")  # (the default only where torch runs AVX-512)
    monkeypatch.setattr(cpu_gemv, "onednn_gelu", lambda: True)  # (likewise)
    if not cpu_gemv.onednn_gemm(torch.zeros(1, 1), torch.zeros(1, 1)):
        pytest.skip("torch without oneDNN linear ops")
    calls = []
    real = cpu_gemv.run_direct

    def spy(*args, **kw):
        out = real(*args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_gemv, "run_direct", spy)
    return calls


@pytest.mark.parametrize("epilogue", ["none", "gelu", "residual", "gate"])
@pytest.mark.parametrize("bias", [False, True])
def test_direct_gemm_matches_the_reference(direct_calls, epilogue, bias):
    """Bias, exact GELU, the residual add and a multiplying gate as oneDNN post-ops, the output written by
    the GEMM itself, over two row axes; a non-contiguous residual; few-row calls still take the generated
    kernel."""
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(70, 45, generator=gen) / 7
    g = const_linear_graph(("b", "s"), w, epilogue, torch.randn(70, generator=gen) if bias else None)
    cg = compile_graph(g, backend="cpu", cache=False)
    for sizes in ({"b": 1, "s": 40}, {"b": 3, "s": 17}, {"b": 1, "s": 3}):
        inputs = inputs_for(g, sizes, gen)
        if epilogue in ("residual", "gate"):
            r = inputs[1]
            inputs[1] = torch.randn(r.shape[-1], *r.shape[:-1], generator=gen).movedim(0, -1)
        (got,) = cg(*inputs)
        (want,) = evaluate(g, inputs)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=str(sizes))
    assert direct_calls == [True, True]


def test_direct_gemm_off_with_torch_gemm(direct_calls, monkeypatch):
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "torch")
    gen = torch.Generator().manual_seed(11)
    g = const_linear_graph(("m",), torch.randn(24, 16, generator=gen), "gelu", torch.randn(24, generator=gen))
    check(g, inputs_for(g, {"m": 30}, gen), DType.F32)
    assert direct_calls == [False]


def test_gelu_stays_in_the_epilogue_kernel_where_onednn_gelu_is_slow(monkeypatch):
    """Where oneDNN's GELU post-op is slow (an AVX2 CPU's default), a GEMM with a bias and GELU is no direct
    oneDNN call: the epilogue kernel applies both, and the result matches the reference."""
    monkeypatch.setattr(cpu_gemv, "onednn_gelu", lambda: False)
    gen = torch.Generator().manual_seed(13)
    g = const_linear_graph(("m",), torch.randn(24, 16, generator=gen), "gelu", torch.randn(24, generator=gen))
    assert direct_gemm(_matmul_kernel_of(g)) is None
    check(g, inputs_for(g, {"m": 30}, gen), DType.F32)


def test_constant_weight_with_other_epilogue_runs_packed_then_the_epilogue_kernel(packed_calls, direct_calls):
    gen = torch.Generator().manual_seed(12)
    g = Graph()
    x = g.input("x", ("m", 16), DType.F32)
    g.output(g.sigmoid(g.matmul(x, g.transpose(g.const(torch.randn(24, 16, generator=gen))))))
    check(g, inputs_for(g, {"m": 33}, gen), DType.F32)
    assert len(packed_calls) == 1 and direct_calls == []


@pytest.mark.parametrize("k,n", [(24, 32), (7, 33), (40, 5)])
def test_a_gemm_weight_packs_in_one_copy_into_the_conv_panels(k, n):
    """The tiles' GEMM weight ``[K, N]`` (row major or a transposed view) packs to the dense conv panels of a
    1x1 conv of K inputs and N outputs, padding included."""
    from kernelize.codegen.cpu_conv import pack_dense, pack_gemm

    for w in (torch.randn(k, n), torch.randn(n, k).t()):
        torch.testing.assert_close(pack_gemm(w), pack_dense(w.t().reshape(n, k, 1, 1)), rtol=0, atol=0)
