"""Differential tests of the CPU backend against the reference executor (``kernelize.ir.evaluate``).

Kernels come from two places: ``kernel_of`` below, a small single-kernel lowering of a graph (layout ops
to strides, like the planner does) that lets us aim at exact layouts (broadcast, transposed, sliced,
flipped, padded, concatenated, gathered operands); and the real planner through ``compile_graph`` once
it is importable.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelize.autokernel.kernels import (
    Compute,
    Indirect,
    Kernel,
    KernelKind,
    Load,
    MatmulKernel,
    PointwiseKernel,
    Store,
    loop_kernel,
    row_invariant,
)
from kernelize.codegen.cpu import MAX_CONCAT_PIECES, inner_pieces, render
from kernelize.codegen.cpu_backend import CpuBackend
from kernelize.codegen.cpu_build import CompilerNotFoundError
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import ELEMENTWISE, REDUCE, ROW, Graph, Node, Op
from kernelize.ir.ops import ConcatArgs
from kernelize.ir.reference import bind_inputs, evaluate
from kernelize.ir.shapes import Sym, bind

BACKEND = CpuBackend()


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    old = os.environ.get("KERNELIZE_CACHE_DIR")
    os.environ["KERNELIZE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kzcache"))
    yield
    if old is None:
        os.environ.pop("KERNELIZE_CACHE_DIR", None)
    else:
        os.environ["KERNELIZE_CACHE_DIR"] = old


@pytest.fixture(params=["generic", "specialized"])
def sizes(request, monkeypatch):
    """Run a test with small kernels' sizes as arguments (the default, autokernel/generic.py) and as
    constants (how every large kernel compiles), so both renderings stay checked against the reference."""
    if request.param == "specialized":
        monkeypatch.setattr("kernelize.autokernel.generic.SMALL_WORK", -1)
    return request.param


# ---- a one-kernel lowering of small graphs ---------------------------------------------------------------
def _contig(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc = d * acc if isinstance(d, Sym) else acc * d
    return tuple(reversed(strides))


def _view_strides(src_shape, src_strides, shape):
    """Strides of a view that only inserts or removes size-1 axes (enough for these tests)."""
    it = [(d, s) for d, s in zip(src_shape, src_strides) if d != 1]
    out, j = [], 0
    for d in shape:
        if d == 1:
            out.append(0)
        else:
            assert j < len(it) and it[j][0] == d, f"unsupported view {src_shape} -> {shape}"
            out.append(it[j][1])
            j += 1
    return tuple(out)


def kernel_of(g: Graph, kind: KernelKind = KernelKind.POINTWISE, domain=None, row_rank: int = 0) -> Kernel:
    """Lower ``g`` (inputs, layout ops, elementwise / row / reduce ops, all outputs over one domain) to one
    kernel; buffers are the graph inputs and outputs."""
    domain = tuple(domain or g.outputs[0].shape)
    rank = len(domain)
    body: list = []
    where: dict[Node, tuple] = {}  # node -> ("buf", buffer, strides, offset) | ("val", body index)
    loads: dict[Node, int] = {}  # node read from a buffer -> its load's body index
    for n in g.nodes:
        if n.op in (Op.INPUT, Op.CONST):
            pad = rank - n.rank
            where[n] = ("buf", n, (0,) * pad + _contig(n.shape), 0)
            continue
        if n.op in (Op.VIEW, Op.BROADCAST, Op.PERMUTE, Op.SLICE, Op.FLIP):
            src = where[n.src[0]]
            if src[0] == "val":  # a broadcast of a per-row value is that value
                where[n] = src
                continue
            _, buf, strides, off = src
            strides = strides[len(strides) - n.src[0].rank :]
            if n.op is Op.VIEW:
                strides = _view_strides(n.src[0].shape, strides, n.shape)
            elif n.op is Op.BROADCAST:
                strides = tuple(0 if a != b else s for a, b, s in zip(n.src[0].shape, n.shape, strides))
            elif n.op is Op.PERMUTE:
                strides = tuple(strides[p] for p in n.arg)
            elif n.op is Op.SLICE:
                off += sum(a * s for (a, _, _), s in zip(n.arg, strides))
                strides = tuple(s * c for (_, _, c), s in zip(n.arg, strides))
            else:  # flip
                off += sum((n.shape[a] - 1) * strides[a] for a in n.arg)
                strides = tuple(-s if a in n.arg else s for a, s in enumerate(strides))
            where[n] = ("buf", buf, (0,) * (rank - n.rank) + strides, off)
            continue
        ids = []
        for s in n.src:
            w = where[s]
            if w[0] == "buf":
                if s not in loads:
                    body.append(Load(w[1], w[2], w[3]))
                    loads[s] = len(body) - 1
                w = ("val", loads[s])
            ids.append(w[1])
        body.append(Compute(n.op, n.dtype, tuple(ids), n.arg))
        where[n] = ("val", len(body) - 1)
    stores = []
    for o in g.outputs:
        w = where[o]
        if w[0] == "buf":
            body.append(Load(w[1], w[2], w[3]))
            w = ("val", len(body) - 1)
        strides = (0,) * (rank - o.rank) + _contig(o.shape)
        strides = tuple(0 if d == 1 else s for d, s in zip((1,) * (rank - o.rank) + o.shape, strides))
        stores.append(Store(w[1], o, strides))
    return loop_kernel(kind, "k", domain, tuple(body), tuple(stores), row_rank)


def run(kernel: Kernel, g: Graph, inputs):
    env = bind_inputs(g, inputs)
    ck = BACKEND.compile(kernel)
    outs = [torch.empty(bind(o.shape, env), dtype=o.dtype.torch) for o in kernel.writes]
    buffers = {n: t.contiguous() for n, t in zip(g.inputs, inputs)}
    buffers.update({n: n.arg.tensor for n in g.nodes if n.op is Op.CONST})
    ck.launch([buffers[b] for b in kernel.reads], outs, {s: env[s] for s in kernel.symbols})
    return dict(zip(kernel.writes, outs))


TOL = {DType.F32: (1e-5, 1e-5), DType.F64: (1e-9, 1e-9), DType.BF16: (2e-2, 2e-2), DType.F16: (2e-3, 2e-3)}


def check(kernel: Kernel, g: Graph, inputs, tol=None):
    got = run(kernel, g, inputs)
    want = evaluate(g, inputs)
    for o, w in zip(g.outputs, want):
        x = got[o]
        if o.dtype.is_float:
            rtol, atol = tol or TOL[o.dtype]
            torch.testing.assert_close(x.double(), w.double(), rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert torch.equal(x, w), (x, w)


def rand(shape, dtype: DType, lo=-3.0, hi=3.0):
    if dtype is DType.BOOL:
        return torch.rand(shape) > 0.5
    if dtype.is_int:
        return torch.randint(-50 if dtype is not DType.U8 else 0, 50, shape, dtype=dtype.torch)
    return (torch.rand(shape, dtype=torch.float64) * (hi - lo) + lo).to(dtype.torch)


# ---- pointwise -------------------------------------------------------------------------------------------
UNARY_F = [
    Op.ABS,
    Op.NEG,
    Op.EXP,
    Op.LOG,
    Op.SQRT,
    Op.RSQRT,
    Op.RECIPROCAL,
    Op.SIN,
    Op.COS,
    Op.TANH,
    Op.SIGMOID,
    Op.ERF,
    Op.SOFTPLUS,
    Op.FLOOR,
    Op.CEIL,
    Op.ROUND,
    Op.SIGN,
]
BINARY_F = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MIN, Op.MAX, Op.POW, Op.MOD]


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16, DType.F64])
def test_every_float_op(dtype):
    g = Graph()
    a = g.input("a", (7, 33), dtype)
    b = g.input("b", (7, 33), dtype)
    outs = [g.unary(op, g.abs(a) if op in (Op.LOG, Op.SQRT, Op.RSQRT) else a) for op in UNARY_F]
    outs += [g.binary(op, g.abs(a) if op is Op.POW else a, b) for op in BINARY_F]
    outs += [g.gelu(a), g.gelu(a, "tanh"), g.clamp(a, -0.5, 0.7), g.where(g.lt(a, b), a, b)]
    outs += [g.cast(g.gt(a, b), dtype), g.cast(g.cast(a, DType.I32), dtype)]
    g.output(*outs)
    x, y = rand((7, 33), dtype), rand((7, 33), dtype)
    check(kernel_of(g), g, [x, y])


@pytest.mark.parametrize("dtype", [DType.I32, DType.I64, DType.I8, DType.U8])
def test_integer_ops(dtype):
    g = Graph()
    a = g.input("a", (5, 17), dtype)
    b = g.input("b", (5, 17), dtype)
    ops = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MOD, Op.MIN, Op.MAX]
    g.output(*[g.binary(op, a, b) for op in ops], g.abs(a), g.sign(a), g.eq(a, b), g.ge(a, b))
    x = rand((5, 17), dtype)
    y = rand((5, 17), dtype)
    y = torch.where(y == 0, torch.ones_like(y), y)
    check(kernel_of(g), g, [x, y])


def test_special_values():
    g = Graph()
    a = g.input("a", (16,), DType.F32)
    b = g.input("b", (16,), DType.F32)
    # gelu is left out: torch gives nan at +inf, the formula (and this backend) gives inf
    g.output(
        g.exp(a),
        g.tanh(a),
        g.sigmoid(a),
        g.softplus(a),
        g.erf(a),
        g.min(a, b),
        g.max(a, b),
        g.sign(a),
        g.round(a),
        g.binary(Op.MOD, a, b),
    )
    vals = [
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        1e4,
        -1e4,
        88.5,
        -100.0,
        2.5,
        -0.5,
        20.5,
        1e-3,
        -7.0,
        3,
        5,
    ]
    x = torch.tensor(vals)
    y = torch.tensor(list(reversed(vals)))
    check(kernel_of(g), g, [x, y])


def test_16bit_round_trip_is_exact():
    """Every f16 and bf16 bit pattern loads to f32 and stores back bit for bit (NaNs stay NaN)."""
    for dtype in (DType.F16, DType.BF16):
        g = Graph()
        a = g.input("a", (65536,), dtype)
        g.output(g.cast(g.cast(a, DType.F32), dtype), g.cast(a, DType.F32))
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype.torch)
        got = run(kernel_of(g), g, [x])
        back, wide = (got[o] for o in g.outputs)
        assert torch.equal(wide.view(torch.int32)[~x.isnan()], x.float().view(torch.int32)[~x.isnan()])
        assert torch.equal(back.view(torch.int16)[~x.isnan()], x.view(torch.int16)[~x.isnan()])
        assert back[x.isnan()].isnan().all()
    # f32 -> 16 bit rounding (ties to even, overflow, denormals) against torch
    f = torch.cat(
        [
            torch.randn(100000) * torch.exp(torch.randn(100000) * 8),
            torch.tensor([65504.0, 65520.0, 65519.99, 6e-8, 2.98e-8, 3.4e38, 1 + 2**-8, 1 + 3 * 2**-8]),
        ]
    )
    for dtype in (DType.F16, DType.BF16):
        g = Graph()
        a = g.input("a", (f.numel(),), DType.F32)
        g.output(g.cast(a, dtype))
        (out,) = run(kernel_of(g), g, [f]).values()
        assert torch.equal(out.view(torch.int16), f.to(dtype.torch).view(torch.int16))


@pytest.mark.usefixtures("sizes")
def test_broadcast_transposed_sliced_flipped_operands():
    g = Graph()
    x = g.input("x", (6, 40), DType.F32)
    t = g.input("t", (40, 6), DType.F32)  # read transposed
    col = g.input("col", (6, 1), DType.F32)  # broadcast along the inner axis
    row = g.input("row", (40,), DType.F32)  # broadcast along the outer axis
    wide = g.input("wide", (6, 90), DType.F32)  # strided slice
    y = g.add(g.mul(x, g.transpose(t)), g.mul(col, row))
    y = g.add(y, g.slice(wide, 1, 5, 85, 2))
    y = g.sub(y, g.flip(x, [1]))
    g.output(y)
    ins = [rand(s, DType.F32) for s in [(6, 40), (40, 6), (6, 1), (40,), (6, 90)]]
    k = kernel_of(g)
    assert any(isinstance(e, Load) and e.strides[-1] == 0 for e in k.body)
    check(k, g, ins)


def test_axis_merging_makes_one_flat_loop():
    g = Graph()
    x = g.input("x", (3, 5, 7), DType.F32)
    g.output(g.exp(x))
    src, _ = render(kernel_of(g))
    assert "for (int64_t i0 = 0; i0 < 105;" in src and "kz_rem" not in src  # one flat axis
    check(kernel_of(g), g, [rand((3, 5, 7), DType.F32)])


@pytest.mark.usefixtures("sizes")
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (1, 1), (1,), (3, 4097), (70000,)])
def test_awkward_shapes(shape):
    g = Graph()
    x = g.input("x", shape, DType.F32)
    w = g.input("w", shape[-1:], DType.F32)
    g.output(g.mul(g.sigmoid(x), w))
    check(kernel_of(g), g, [rand(shape, DType.F32), rand(shape[-1:], DType.F32)])


def test_symbolic_dims_one_kernel_serves_every_size():
    g = Graph()
    x = g.input("x", ("batch", "seq", 8), DType.F32)
    g.output(g.mul(g.mul(x, g.sigmoid(x)), 2.0))
    k = kernel_of(g)
    assert k.symbols == ("batch", "seq")
    for shape in [(1, 1, 8), (3, 5, 8), (2, 0, 8), (7, 1000, 8)]:
        check(k, g, [rand(shape, DType.F32)])


def test_scalar_domain():
    g = Graph()
    a = g.input("a", (), DType.F32)
    g.output(g.exp(a))
    check(kernel_of(g), g, [torch.tensor(0.5)])


@pytest.mark.usefixtures("sizes")
def test_masked_and_concat_and_gather_loads():
    # pad along the inner axis (masked load), concat of two inputs, gather through an index buffer
    x = torch.randn(4, 10)
    yv = torch.randn(4, 6)
    idx = torch.tensor([3, -1, 0, 9, 2], dtype=torch.int64)
    g = Graph()
    gx = g.input("x", (4, 10), DType.F32)
    gy = g.input("y", (4, 6), DType.F32)
    gi = g.input("i", (5,), DType.I64)
    cat = g.concat([g.pad(gx, [(0, 0), (2, 1)], 0.5), gy], 1)
    gath = g.gather(gx, gi, 1)
    g.output(cat, gath)
    body = (
        Load(gx, (10, 1), -2, mask=((1, 2, 12),), other=0.5),  # pad by 2 on the left, 1 on the right
        Load(gy, (6, 1), -13, mask=((1, 13, 19),)),
        Compute(Op.CONCAT, DType.F32, (0, 1), ConcatArgs(1, (13, 19))),
        Load(gi, (0, 1)),
    )
    k1 = PointwiseKernel("cat", (4, 19), body[:3], (Store(2, cat, (19, 1)),))
    k2 = PointwiseKernel(
        "gather",
        (4, 5),
        (body[3], Load(gx, (10, 0), indirect=(Indirect(0, 1, 10),))),
        (Store(1, gath, (5, 1)),),
    )
    want_cat, want_gather = evaluate(g, [x, yv, idx])
    out = torch.empty(4, 19)
    BACKEND.compile(k1).launch([x, yv], [out], {})
    torch.testing.assert_close(out, want_cat)
    out = torch.empty(4, 5)
    BACKEND.compile(k2).launch([idx, x], [out], {})
    torch.testing.assert_close(out, want_gather)
    with pytest.raises(IndexError, match=r"gather index is out of range: .* has 10 entries.*\[-10, 10\)"):
        BACKEND.compile(k2).launch([torch.tensor([0, 1, 2, 3, 10]), x], [out], {})


def _rotate_half_graph(heads: int = 2, d: int = 8) -> Graph:
    """rotate-half of every head, the heads added: masked loads of both halves of the inner axis."""
    g = Graph()
    x = g.input("x", ("n", heads, d), DType.F32)
    halves = [g.slice(x, 1, h, h + 1) for h in range(heads)]
    g.output(g.add(*(g.concat([g.neg(g.slice(h, 2, d // 2)), g.slice(h, 2, 0, d // 2)], 2) for h in halves)))
    return g


def _planned_source(g: Graph) -> tuple[Kernel, str]:
    from kernelize.autokernel.plan import plan

    (k,) = plan(g).kernels
    return k, render(k)[0]


def _check_compiled(g: Graph, xs, tol: float = 1e-5) -> None:
    from kernelize.runtime import compile_graph

    got, want = compile_graph(g, backend="cpu")(*xs), evaluate(g, xs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_inner_loop_splits_at_static_mask_bounds():
    """Masks and concats testing the inner index at static bounds: one simd loop per sub-range between the
    bounds, where every load is plain and no test is left (as tests they ran as 64-bit vector compares)."""
    g = _rotate_half_graph()
    k, src = _planned_source(g)
    assert inner_pieces(k) == [(0, 4), (4, 8)]
    assert "for (int64_t i2 = 0; i2 < 4; ++i2)" in src and "for (int64_t i2 = 4; i2 < 8; ++i2)" in src, src
    assert src.count("#pragma omp simd\n") == 2 and "? kz_ld" not in src and "i2 < 4 ?" not in src, src
    for rows in (1, 7, 129):
        _check_compiled(g, [rand((rows, 2, 8), DType.F32)])


def test_masked_loads_from_index_zero_test_only_the_upper_bound():
    """Past ``MAX_CONCAT_PIECES`` pieces the loop is not split and the masks stay tests; one starting at
    index 0 renders without its always-true lower test: written out, gcc 12 left a loop with several masked
    f32 loads scalar (rotary's cos / sin gradients: rotate-half of every head)."""
    g = Graph()
    width = 2 * (MAX_CONCAT_PIECES + 1)
    x = g.input("x", ("n", width), DType.F32)
    g.output(g.exp(g.concat([g.slice(x, 1, a, a + 2) for a in range(width - 2, -1, -2)], 1)))
    k, src = _planned_source(g)
    assert inner_pieces(k) is None and "for (int64_t i1 = 2;" not in src  # no loop per piece
    assert "(i1 < 2)" in src and "i1 >= 2 && i1 < 4" in src and ">= 0 &&" not in src, src
    _check_compiled(g, [rand((5, width), DType.F32)])


def test_a_concat_of_many_pieces_is_one_loop_per_piece():
    """Cut only at a concat's bounds (its pieces' loads masked there), the loop splits up to
    ``MAX_CONCAT_PIECES`` pieces, each reading only its operand: DenseNet's pre-activation BN + ReLU over the
    channel concat of every earlier layer's output."""
    g = Graph()
    pieces = [g.input(f"x{i}", ("n", w), DType.F32) for i, w in enumerate((24, 12, 12, 12, 12, 12, 12))]
    scale, shift = g.input("s", (96,), DType.F32), g.input("b", (96,), DType.F32)
    g.output(g.clamp(g.add(g.mul(g.concat(pieces, 1), scale), shift), 0.0))
    k, src = _planned_source(g)
    assert inner_pieces(k) == [(0, 24), *((a, a + 12) for a in range(24, 96, 12))]
    assert src.count("#pragma omp simd\n") == 7 and "? kz_ld" not in src, src
    for rows in (1, 7, 129):
        xs = [rand((rows, p.shape[1]), DType.F32) for p in pieces]
        _check_compiled(g, [*xs, rand((96,), DType.F32), rand((96,), DType.F32)])


def test_pad_and_concat_pieces_on_the_inner_axis():
    """A pad with a non-zero value (masked loads outside the source read the value) and a concat of uneven
    pieces give the cuts 2, 3, 7: four loops, masked-out loads as literals, concat operands picked."""
    g = Graph()
    x, y = g.input("x", ("n", 5), DType.F32), g.input("y", ("n", 10), DType.F32)
    padded = g.pad(x, [(0, 0), (2, 3)], 1.5)
    cat = g.concat([g.slice(y, 1, 7), g.exp(g.slice(y, 1, 0, 4)), g.slice(y, 1, 4, 7)], 1)
    g.output(g.mul(padded, cat))
    k, src = _planned_source(g)
    assert inner_pieces(k) == [(0, 2), (2, 3), (3, 7), (7, 10)]
    assert src.count("#pragma omp simd\n") == 4 and "? kz_ld" not in src and "1.5f" in src, src
    for rows in (1, 7, 129):
        _check_compiled(g, [rand((rows, 5), DType.F32), rand((rows, 10), DType.F32)])


def test_symbolic_bounds_or_inner_size_are_not_split():
    """Graphs cannot pad or concat a symbolic axis today; the splitter still refuses symbolic bounds and
    sizes (and a mask on another axis is no reason to split)."""
    g = Graph()
    x = g.input("x", (4, 8), DType.F32)
    m = Sym(("m",), 1)

    def kernel(domain, mask):
        body = (Load(x, (8, 1), mask=mask),)
        return PointwiseKernel("k", domain, body, (Store(0, x, (8, 1)),))

    assert inner_pieces(kernel((4, 8), ((1, 0, m),))) is None
    assert inner_pieces(kernel((4, m), ((1, 0, 3),))) is None
    assert inner_pieces(kernel((4, 8), ((0, 1, 3),))) is None
    assert inner_pieces(kernel((4, 8), ((1, -2, 3),))) == [(0, 3), (3, 8)]


def _rotary_flat(x, cos, sin):
    """NeoX rotary over a flat hidden (the heads a static split of it)."""
    t, d = x.shape[0], cos.shape[-1]
    xh = x.view(t, -1, d)
    rot = torch.cat((-xh[..., d // 2 :], xh[..., : d // 2]), dim=-1)
    return (xh * cos[:, None, :] + rot * sin[:, None, :]).view(t, -1)


@pytest.mark.parametrize(("heads", "d"), [(1, 10), (3, 6), (16, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_forward_and_backward_with_split_inner_loops(dtype, heads, d):
    """Rotary's forward and its dx and cos / sin gradient kernels, whose rotate-half loads split at d / 2,
    against the reference executor on awkward head counts, head dims and rows."""
    from kernelize.autokernel.plan import plan
    from kernelize.ir.autodiff import split, vjp
    from kernelize.ir.torch_frontend import trace
    from kernelize.passes import optimize

    xs = [torch.randn(7, n, dtype=dtype) for n in (heads * d, d, d)]
    fwd = optimize(trace(_rotary_flat, *xs, dynamic_dims=[{0: "n"}] * 3))
    bwd = optimize(split(vjp(fwd)).backward)
    for g in (fwd, bwd):
        srcs = [render(k)[0] for k in plan(g).kernels]
        assert any(s.count("#pragma omp simd\n") > 1 for s in srcs) and not any("? kz_ld" in s for s in srcs)
        for rows in (1, 7, 129):
            inputs = [torch.randn(rows, *i.shape[1:]).to(dtype) for i in g.inputs]
            _check_compiled(g, inputs, tol=1e-5 if dtype == torch.float32 else 2e-2)


# ---- row kernels -----------------------------------------------------------------------------------------
def _row_graph(kind: str, dtype: DType, n, with_params=True):
    g = Graph()
    x = g.input("x", ("rows", n), dtype)
    if kind == "rmsnorm":
        w = g.input("w", (n,), dtype) if with_params else None
        g.output(g.rmsnorm(x, w, 1e-6))
    elif kind == "add_rmsnorm":
        r = g.input("r", ("rows", n), dtype)
        w = g.input("w", (n,), dtype)
        h = g.add(x, r)
        g.output(h, g.rmsnorm(h, w, 1e-6))
    elif kind == "layernorm":
        w = g.input("w", (n,), dtype) if with_params else None
        b = g.input("b", (n,), dtype) if with_params else None
        g.output(g.layernorm(x, w, b, 1e-5))
    elif kind == "softmax":
        g.output(g.softmax(g.mul(x, 0.5)))
    elif kind == "log_softmax":
        g.output(g.log_softmax(x))
    elif kind == "reduce":
        g.output(
            g.reduce(Op.SUM, x, -1, keepdim=True),
            g.reduce(Op.REDUCE_MAX, x, -1, keepdim=True),
            g.reduce(Op.MEAN, x, -1, keepdim=True),
            g.reduce(Op.ARGMAX, x, -1, keepdim=True),
            g.reduce(Op.REDUCE_MIN, x, -1, keepdim=True),
            g.reduce(Op.ARGMIN, x, -1, keepdim=True),
        )
    elif kind == "explicit_softmax":  # reductions feeding elementwise ops feeding a reduction
        m = g.reduce(Op.REDUCE_MAX, x, -1, keepdim=True)
        e = g.exp(g.sub(x, m))
        g.output(g.div(e, g.reduce(Op.SUM, e, -1, keepdim=True)))
    return g


ROW_KINDS = ["rmsnorm", "add_rmsnorm", "layernorm", "softmax", "log_softmax", "reduce", "explicit_softmax"]


@pytest.mark.usefixtures("sizes")
@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16, DType.F16])
def test_row_kernels(kind, dtype):
    g = _row_graph(kind, dtype, 300)
    k = kernel_of(g, KernelKind.ROW, (Sym.of("rows"), 300), row_rank=1)
    per_row = [inv for inv, e in zip(row_invariant(k), k.body) if isinstance(e, Compute)]
    assert any(per_row) == (kind in ("reduce", "explicit_softmax"))
    ins = [rand(tuple(bind(i.shape, {"rows": 9})), dtype) for i in g.inputs]
    tol = {DType.F32: (1e-5, 1e-5), DType.BF16: (3e-2, 3e-2), DType.F16: (3e-3, 3e-3)}[dtype]
    if kind == "reduce" and dtype is not DType.F32:
        ins = [i.float().round().to(dtype.torch) for i in ins]  # argmax ties are well defined
        tol = (1e-2, 1e-1)
    check(k, g, ins, tol)


@pytest.mark.parametrize("n", [1, 7, 4097, 300_000])
def test_row_lengths_including_longer_than_cache(n):
    g = _row_graph("softmax", DType.F32, n)
    k = kernel_of(g, KernelKind.ROW, (Sym.of("rows"), n), row_rank=1)
    check(k, g, [rand((3, n), DType.F32, -30, 30)])
    g = _row_graph("layernorm", DType.F32, n)
    k = kernel_of(g, KernelKind.ROW, (Sym.of("rows"), n), row_rank=1)
    check(k, g, [rand((3, n), DType.F32) + 100, rand((n,), DType.F32), rand((n,), DType.F32)], (1e-4, 1e-4))


def test_row_edge_values():
    g = _row_graph("softmax", DType.F32, 5)
    k = kernel_of(g, KernelKind.ROW, (Sym.of("rows"), 5), row_rank=1)
    x = torch.tensor(
        [
            [0.0, 1.0, math.nan, 2.0, 3.0],
            [-math.inf] * 5,
            [math.inf, 0, 0, 0, 0],
            [1e4, -1e4, 0, 0, 1e4],
            [-0.0, 0.0, 0, 0, 0],
        ]
    )
    check(k, g, [x])
    g = _row_graph("reduce", DType.F32, 5)
    k = kernel_of(g, KernelKind.ROW, (Sym.of("rows"), 5), row_rank=1)
    check(k, g, [x])


@pytest.mark.usefixtures("sizes")
def test_row_rank_two_and_transposed_rows():
    g = Graph()
    x = g.input("x", (4, 6, 8), DType.F32)
    y = g.permute(x, (0, 2, 1))  # rows read with a stride
    s = g.reduce(Op.SUM, y, (1, 2), keepdim=True)
    g.output(g.mul(y, s))
    k = kernel_of(g, KernelKind.ROW, (4, 8, 6), row_rank=2)
    check(k, g, [rand((4, 6, 8), DType.F32)], (1e-4, 1e-4))


@pytest.mark.usefixtures("sizes")
def test_matmul_with_epilogue():
    g = Graph()
    a = g.input("a", (2, 5, 7), DType.F32)
    b = g.input("b", (7, 3), DType.F32)
    bias = g.input("bias", (3,), DType.F32)
    mm = g.matmul(a, b)
    g.output(g.gelu(g.add(mm, bias)))
    body = (
        Load(a, (35, 7, 0, 1)),
        Load(b, (0, 0, 1, 3)),
        Compute(Op.MATMUL, DType.F32, (0, 1), 7),
        Load(bias, (0, 0, 1)),
        Compute(Op.ADD, DType.F32, (2, 3)),
        Compute(Op.GELU, DType.F32, (4,), "none"),
    )
    k = MatmulKernel("mm", (2, 5, 3), body, (Store(5, g.outputs[0], (15, 3, 1)),))
    check(k, g, [rand((2, 5, 7), DType.F32), rand((7, 3), DType.F32), rand((3,), DType.F32)], (1e-4, 1e-4))


def _scaled_sigmoid(shape) -> tuple[Graph, Kernel]:
    g = Graph()
    x = g.input("x", shape, DType.F32)
    w = g.input("w", shape[-1:], DType.F32)
    g.output(g.mul(g.sigmoid(x), w))
    return g, kernel_of(g)


def test_small_kernels_differing_only_in_sizes_share_one_function():
    """A small kernel's sizes are arguments (autokernel/generic.py): two of one structure render to one
    source, compile once, and each computes its own sizes; a large one keeps its sizes in its source."""
    from dataclasses import replace

    (g1, k1), (g2, k2) = _scaled_sigmoid((3, 5, 7)), _scaled_sigmoid((4, 9))
    assert BACKEND.render(k1) == BACKEND.render(k2)  # both named k
    assert "s_kz_c0" in BACKEND.render(k1) and "105" not in BACKEND.render(k1)  # the merged axis, an argument
    k2 = replace(k2, name="k2")
    c1, c2 = BACKEND.compile_many([k1, k2])
    for g, ck in ((g1, c1), (g2, c2)):
        xs = [rand(i.shape, DType.F32) for i in g.inputs]
        out = torch.empty(g.outputs[0].shape)
        ck.launch(xs, [out], {})
        torch.testing.assert_close(out, evaluate(g, xs)[0], rtol=1e-5, atol=1e-5)
    _, big = _scaled_sigmoid((1100, 1000))
    assert "s_kz_c0" not in BACKEND.render(big) and "kz_outer = 1100;" in BACKEND.render(big)


def test_a_matmul_builds_only_the_side_its_rows_reach():
    """Static rows up to FEW_ROWS: the few-row function alone; more, or static dims past it beside a dynamic
    one: the epilogue after the GEMM alone; a dynamic count that may be either: both. Zero rows compute
    nothing."""
    from kernelize.autokernel.matmul import FEW_ROWS
    from kernelize.codegen.cpu_backend import kernel_parts

    def mm(rows):
        g = Graph()
        a = g.input("a", (*rows, 7), DType.F32)
        b = g.input("b", (7, 3), DType.F32)
        g.output(g.sigmoid(g.matmul(a, b)))
        body = (
            Load(a, _contig(a.shape)[:-1] + (0, 1)),
            Load(b, (0,) * len(rows) + (1, 3)),
            Compute(Op.MATMUL, DType.F32, (0, 1), 7),
            Compute(Op.SIGMOID, DType.F32, (2,)),
        )
        y = g.outputs[0]
        return g, MatmulKernel("mm", y.shape, body, (Store(3, y, _contig(y.shape)),))

    def sides(rows):
        return ["few" if p.name == "mm" else "gemm" for p, _ in kernel_parts(mm(rows)[1])]

    assert sides((FEW_ROWS,)) == ["few"]
    assert sides((FEW_ROWS + 1,)) == ["gemm"]
    assert sides(("n", FEW_ROWS + 1)) == ["gemm"]
    assert sides(("n", 2)) == ["few", "gemm"]
    g, k = mm(("n", FEW_ROWS + 1))
    ck = BACKEND.compile(k)
    empty = [torch.empty(0, FEW_ROWS + 1, 7), torch.randn(7, 3)]
    ck.launch(empty, [torch.empty(0, FEW_ROWS + 1, 3)], {"n": 0})  # the few-row side is not built
    xs = [rand((2, FEW_ROWS + 1, 7), DType.F32), rand((7, 3), DType.F32)]
    out = torch.empty(2, FEW_ROWS + 1, 3)
    ck.launch(xs, [out], {"n": 2})
    torch.testing.assert_close(out, evaluate(g, xs)[0], rtol=1e-5, atol=1e-5)


# ---- hypothesis: random elementwise graphs over random layouts ---------------------------------------------
_UN = [Op.NEG, Op.EXP, Op.TANH, Op.SIGMOID, Op.ABS, Op.SIN, Op.ERF]
_BIN = [Op.ADD, Op.SUB, Op.MUL, Op.MAX, Op.MIN]


@st.composite
def _graphs(draw):
    dtype = draw(st.sampled_from([DType.F32, DType.F16, DType.BF16]))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 7, 64, 129]), min_size=rank, max_size=rank)))
    g = Graph()
    vals, ins = [], []
    for i in range(draw(st.integers(1, 3))):
        layout = draw(st.sampled_from(["plain", "bcast", "perm"] if rank > 1 else ["plain", "bcast"]))
        if layout == "plain":
            x = g.input(f"x{i}", shape, dtype)
            ins.append(shape)
            vals.append(x)
        elif layout == "bcast":
            s = tuple(1 if j % 2 == i % 2 else d for j, d in enumerate(shape))
            x = g.input(f"x{i}", s, dtype)
            ins.append(s)
            vals.append(g.broadcast(x, shape))
        else:
            s = tuple(reversed(shape))
            x = g.input(f"x{i}", s, dtype)
            ins.append(s)
            vals.append(g.permute(x, tuple(reversed(range(rank)))))
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()) or len(vals) == 1:
            vals.append(g.unary(draw(st.sampled_from(_UN)), draw(st.sampled_from(vals))))
        else:
            a, b = draw(st.sampled_from(vals)), draw(st.sampled_from(vals))
            vals.append(g.binary(draw(st.sampled_from(_BIN)), a, b))
    g.output(vals[-1])
    return g, dtype, ins


@settings(max_examples=25, deadline=None)
@given(_graphs(), st.booleans())
def test_random_elementwise_graphs(case, specialized):
    g, dtype, shapes = case
    ins = [rand(s, dtype, -2, 2) for s in shapes]
    tol = {DType.F32: (1e-4, 1e-4), DType.F16: (1e-2, 1e-2), DType.BF16: (5e-2, 5e-2)}[dtype]
    if g.outputs[0].op in ELEMENTWISE or g.outputs[0].op not in REDUCE | ROW:
        with pytest.MonkeyPatch.context() as mp:  # sizes as constants, or as arguments (the fixture `sizes`)
            if specialized:
                mp.setattr("kernelize.autokernel.generic.SMALL_WORK", -1)
            check(kernel_of(g), g, ins, tol)


# ---- errors and plumbing ---------------------------------------------------------------------------------
def test_compile_error_carries_log_and_source(monkeypatch):
    from kernelize.codegen import cpu_build
    from kernelize.runtime.backend import KernelCompileError

    monkeypatch.setattr(
        cpu_build, "flags", lambda: (*cpu_build.DEFAULT_FLAGS, "-include", "kz_no_such_header.h")
    )
    g = Graph()
    x = g.input("x", (3,), DType.F32)
    g.output(g.exp(x))
    with pytest.raises(KernelCompileError) as info:
        BACKEND.compile(kernel_of(g))
    assert "kz_no_such_header.h" in info.value.log and 'extern "C"' in str(info.value)


def test_missing_compiler_is_a_clear_error():
    code = (
        "import os; os.environ['KERNELIZE_CXX']='no-such-cxx'; os.environ['CXX']='no-such-cxx';"
        "os.environ['PATH']='/nonexistent';"
        "from kernelize.codegen.cpu_build import compiler, CompilerNotFoundError\n"
        "try:\n    compiler()\nexcept CompilerNotFoundError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("OK") and "KERNELIZE_CXX" in out
    assert issubclass(CompilerNotFoundError, RuntimeError)


def test_thread_count_follows_torch():
    g = Graph()
    x = g.input("x", (64, 4096), DType.F32)
    g.output(g.exp(x))
    k = kernel_of(g)
    src, _ = render(k)
    assert "kz_team_work(kz_nthreads, " in src and "kz_parallel_for(kz_tm, " in src
    old = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            check(k, g, [rand((64, 4096), DType.F32)])
    finally:
        torch.set_num_threads(old)


_ONE_POOL = """
import json, sys, torch
from kernelize.codegen import cpu, cpu_build
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph
sys.path.insert(0, {tests!r})
from test_cpu import kernel_of
g = Graph()
g.output(g.exp(g.input("x", (64, 256), DType.F32)))
lib = cpu_build.load(cpu_build.build_shared_object(cpu.render(kernel_of(g))[0], "one_pool"))
teams = []
for n in (2, 1, 3):
    torch.set_num_threads(n)
    cpu_build.TEAM_DEADLINE.value = 0  # a late start of the previous region must not shrink this one
    teams.append(lib.kz_parallel_team(torch.get_num_threads()))
maps = open("/proc/self/maps").read().split()
runtimes = sorted({{w for w in maps if any(f"/lib{{r}}" in w for r in ("gomp", "omp", "iomp"))}})
print(json.dumps({{"teams": teams, "runtimes": runtimes}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_kernels_share_torchs_openmp_pool():
    """The threads contract (docs/runtime.md): a kernel library in a process that imported torch maps no
    OpenMP runtime of its own (one libgomp: torch's), and a region's team is the thread count passed in,
    which the launchers take from ``torch.get_num_threads()``."""
    code = _ONE_POOL.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["teams"] == [2, 1, 3]
    assert len(seen["runtimes"]) == 1, f"more than one OpenMP runtime mapped: {seen['runtimes']}"


_POOL_AWAY = """
import json, os, threading, torch
from kernelize.codegen import cpu_build
torch.set_num_threads(2)
x = torch.ones(1 << 22)
x.add_(1)  # torch's OpenMP pool has its worker
allowed = os.sched_getaffinity(0)
cpu_build.openmp_away(2)
masks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
kept = [t for t, m in masks.items() if m != allowed]
x.add_(1)
missing = [sorted(allowed - masks[t]) for t in kept]
caller = threading.get_native_id() in kept
print(json.dumps({"kept": missing, "caller": caller, "right": bool((x == 3).all())}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="Linux, 2 cores or more"
)
@pytest.mark.parametrize("switch", ["1", "0"])
def test_openmp_pool_keeps_off_the_callers_core(switch):
    """kz_openmp_away (cpu_workers.cpp): torch's OpenMP worker of a 2-thread team is no longer allowed on
    one core (the caller's), the caller keeps every core, and torch's ops still run; with
    ``KERNELIZE_OPENMP_AWAY=0`` no thread's affinity changes."""
    env = {**os.environ, "KERNELIZE_OPENMP_AWAY": switch}
    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", _POOL_AWAY], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["right"] and not seen["caller"]
    assert [len(missing) for missing in seen["kept"]] == ([1] if switch == "1" else [])


def test_a_run_on_kernelizes_workers_keeps_torch_on_one_thread():
    """cpu_build.with_workers: during the run torch has one thread (its ops wake no OpenMP worker beside
    kernelize's) while kernels get the team torch had (cpu_build.threads()); both come back after, also
    when the run raises. A compiled graph's kernels then still run on two threads: the worker takes shares."""
    import time

    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    if cpu_build.WORKERS.value:
        pytest.skip("KERNELIZE_CPU_WORKERS=kernelize: regions always on kernelize's workers")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        state = lambda: (torch.get_num_threads(), cpu_build.threads(), cpu_build.WORKERS.value)  # noqa: E731
        assert cpu_build.with_workers(state) == (1, 2, 1)
        with pytest.raises(ZeroDivisionError):
            cpu_build.with_workers(lambda: 1 / 0)
        assert state() == (2, 2, 0)
        g = Graph()
        g.output(g.exp(g.input("x", (1024, 4096), DType.F32)))
        cg = compile_graph(g, backend="cpu")
        x = torch.randn(1024, 4096)
        pool = cpu_build.workers()
        before, deadline = pool.kz_workers_shares(), time.monotonic() + 10
        while pool.kz_workers_shares() == before and time.monotonic() < deadline:
            cpu_build.TEAM_DEADLINE.value = 0
            torch.testing.assert_close(cg(x)[0], x.exp())
        assert pool.kz_workers_shares() > before and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_late_worker_sends_every_kernel_library_to_one_thread_for_a_while():
    """The policy of "thread teams under load" (cpu_prelude.h), through two real kernel libraries: a
    region whose workers started late (> 0.5 ms) makes every library run regions on one thread until the
    shared deadline passes; a punctual region changes nothing."""
    import ctypes

    from kernelize.codegen import cpu_build

    libs = []
    for op in ("exp", "sigmoid"):
        g = Graph()
        x = g.input("x", (64, 256), DType.F32)
        g.output(getattr(g, op)(x))
        src, _ = render(kernel_of(g))
        libs.append(cpu_build.load(cpu_build.build_shared_object(src, f"team_{op}")))
    old, policy = cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value
    try:
        cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value = 0, 1  # 1: every late start counts
        assert [lib.kz_team_size(2) for lib in libs] == [2, 2] and libs[0].kz_team_size(1) == 1
        libs[0].kz_team_report(2, ctypes.c_int64(100_000))  # 0.1 ms: punctual
        assert cpu_build.TEAM_DEADLINE.value == 0 and libs[1].kz_team_size(2) == 2
        libs[0].kz_team_report(2, ctypes.c_int64(3_000_000))  # a worker 3 ms late
        assert cpu_build.TEAM_DEADLINE.value > 0
        assert [lib.kz_team_size(2) for lib in libs] == [1, 1]  # the other library follows the deadline
        cpu_build.TEAM_DEADLINE.value = 1  # the deadline has passed: full teams again
        assert [lib.kz_team_size(2) for lib in libs] == [2, 2]
        cpu_build.LATE_POLICY.value = 2  # never
        libs[0].kz_team_report(2, ctypes.c_int64(3_000_000))
        assert cpu_build.TEAM_DEADLINE.value == 1
    finally:
        cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value = old, policy


def test_late_workers_send_the_kernels_solo_only_on_oversubscribed_cores(monkeypatch):
    """The default policy (auto): a late report from a team of two always counts; from a larger team only
    while more threads are runnable than the machine has cores. With 2 x cores + 1 busy processes beside it
    the cores are oversubscribed and a 4-thread team's late report counts; ``$KERNELIZE_LATE_WORKERS``
    picks the policy, and a bad value is named."""
    import ctypes
    import subprocess
    import sys
    import time

    from kernelize.codegen import cpu_build

    assert cpu_build.late_worker_policy() == 0
    monkeypatch.setenv("KERNELIZE_LATE_WORKERS", "never")
    assert cpu_build.late_worker_policy() == 2
    monkeypatch.setenv("KERNELIZE_LATE_WORKERS", "sometimes")
    with pytest.raises(ValueError, match="KERNELIZE_LATE_WORKERS='sometimes': expected one of auto"):
        cpu_build.late_worker_policy()
    g = Graph()
    g.output(g.exp(g.input("x", (64, 256), DType.F32)))
    lib = cpu_build.load(cpu_build.build_shared_object(render(kernel_of(g))[0], "team_auto"))
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1) + 1)
    ]
    old, policy = cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value
    try:
        deadline = time.monotonic() + 20
        while not lib.kz_oversubscribed() and time.monotonic() < deadline:  # until they all run
            time.sleep(0.05)
        assert lib.kz_oversubscribed()
        cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value = 0, 0
        lib.kz_team_report(4, ctypes.c_int64(3_000_000))
        assert cpu_build.TEAM_DEADLINE.value > 0
        cpu_build.TEAM_DEADLINE.value = 0
        lib.kz_team_report(2, ctypes.c_int64(3_000_000))  # two threads: counts without the check too
        assert cpu_build.TEAM_DEADLINE.value > 0
    finally:
        cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value = old, policy
        for p in busy:
            p.kill()
            p.wait()


def test_a_region_gets_the_threads_its_work_pays_for():
    """The grain rule (cpu_prelude.h, "grain"): a region runs on the caller alone unless two threads would
    each get KZ_GRAIN_NS (20 us) of estimated work (flops at 64 per ns, 128 with AVX-512, and bytes at 16
    per ns), and then on the whole team, never a part of it: the 13 x 13 x 288 concat of SqueezeNet (~0.4
    MB, ~25 us) runs on one thread, its 3x3 expand conv (15.7 M multiply-adds) on all."""
    import ctypes

    from kernelize.codegen import cpu_build

    g = Graph()
    g.output(g.exp(g.input("x", (64, 256), DType.F32)))
    lib = cpu_build.load(cpu_build.build_shared_object(render(kernel_of(g))[0], "grain"))
    lib.kz_grain_threads.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    per_ns = 128 if lib.kz_grain_threads(4, 64 * 40_000, 0) == 1 else 64  # AVX-512's flop rate: 20 us
    assert lib.kz_grain_threads(2, 0, 0) == 1 and lib.kz_grain_threads(0, 10**12, 0) == 1
    assert lib.kz_grain_threads(2, 0, 389_376) == 1  # concat of 2 x 13 x 13 x 144 f32
    assert lib.kz_grain_threads(2, 2 * 15_676_000, 747_000) == 2  # SqueezeNet's 55 x 55 3x3 expand
    assert lib.kz_grain_threads(16, per_ns * 50_000, 0) == 16  # 50 us: the whole team, not two of it
    assert lib.kz_grain_threads(4, 0, 16 * 39_999) == 1 and lib.kz_grain_threads(4, 0, 16 * 40_000) == 4
    assert lib.kz_grain_threads(3, 10**12, 10**12) == 3


def test_regions_of_every_size_keep_the_same_worker_threads():
    """libgomp ends the pool threads a smaller team leaves out and creates new ones for a larger team; the
    grain rule's teams are the caller or all threads, so regions of every size reuse the same workers:
    no thread of the process ends across a run of pointwise kernels from 4 KB to 16 MB (threads that other
    code may start meanwhile are not counted)."""
    from kernelize.runtime.compiled import compile_graph

    kernels = []
    for n in (1 << 10, 1 << 13, 1 << 15, 1 << 17, 1 << 20, 1 << 22):
        g = Graph()
        g.output(g.exp(g.input("x", (n,), DType.F32)))
        kernels.append((compile_graph(g, backend="cpu"), torch.randn(n)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        for cg, x in kernels:  # the pool grows to its size once
            cg(x)
        before = set(os.listdir("/proc/self/task"))
        for _ in range(5):
            for cg, x in kernels:
                cg(x)
        assert before <= set(os.listdir("/proc/self/task"))
    finally:
        torch.set_num_threads(threads)


def test_a_caller_waiting_longer_than_its_own_share_counts_as_a_late_worker():
    """A worker preempted inside a region makes the caller wait at the closing barrier: that wait is the
    region's lateness when it is longer than the caller's own share (a balanced region's caller waits far
    less); a real region whose caller waits 5 ms for its worker sets the deadline."""
    import ctypes

    from kernelize.codegen import cpu_build

    g = Graph()
    g.output(g.exp(g.input("x", (64, 256), DType.F32)))
    lib = cpu_build.load(cpu_build.build_shared_object(render(kernel_of(g))[0], "team_uneven"))
    lib.kz_region_lateness.restype = ctypes.c_int64
    lateness = [
        lib.kz_region_lateness(*map(ctypes.c_int64, a))
        for a in ((10, 4_000_000, 2_000_000), (10, 1_000, 3_000_000), (900_000, 1_000, 600_000))
    ]
    assert lateness == [
        10,
        3_000_000,
        900_000,
    ]  # uneven but shorter than its own share; preempted; late start
    old, policy, threads = cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value, torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value = 0, 1
        assert lib.kz_uneven_region(2, 0, 5_000_000) == 0
        assert cpu_build.TEAM_DEADLINE.value > 0
    finally:
        cpu_build.TEAM_DEADLINE.value, cpu_build.LATE_POLICY.value = old, policy
        torch.set_num_threads(threads)


def test_every_kernel_kind_is_exact_on_one_thread_after_a_late_start():
    """While the deadline holds, pointwise, row, few-row matmul and attention kernels run their regions on
    one thread: results equal the reference executor."""
    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    g, xs = _every_kind_graph()
    cg = compile_graph(g, backend="cpu")
    assert {k.kind for k in cg.plan.kernels} >= {KernelKind.ROW, KernelKind.MATMUL, KernelKind.ATTENTION}
    old = cpu_build.TEAM_DEADLINE.value
    try:
        cpu_build.TEAM_DEADLINE.value = 2**62
        for got, want in zip(cg(*xs), evaluate(g, xs)):  # 512-term dot products: summation order differs
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        cpu_build.TEAM_DEADLINE.value = old


def _every_kind_graph():
    """A graph with pointwise, row, few-row matmul and attention kernels, and inputs for it."""
    g = Graph()
    x = g.input("x", (Sym.of("n"), 512), DType.F32)
    w = g.input("w", (384, 512), DType.F32)
    q = g.input("q", (1, 4, 9, 32), DType.F32)
    kv = g.input("kv", (1, 4, 300, 32), DType.F32)
    h = g.rmsnorm(g.exp(g.mul(x, g.scalar(0.01, DType.F32))), None, 1e-6)
    g.output(g.matmul(h, g.transpose(w)), g.attention(q, kv, kv, None, scale=0.2, causal=False))
    return g, [rand(s, DType.F32) for s in [(3, 512), (384, 512), (1, 4, 9, 32), (1, 4, 300, 32)]]


def test_a_graph_whose_gemms_run_in_the_generated_tiles_keeps_kernelizes_workers(monkeypatch):
    """A many-row matmul over a constant weight in the generated tiles is no torch GEMM: the run's regions
    stay on kernelize's workers (with `KERNELIZE_CPU_GEMM=torch` the same graph moves to torch's pool)."""
    from kernelize.autokernel.matmul import FEW_ROWS
    from kernelize.runtime.compiled import compile_graph

    g = Graph()
    x = g.input("x", (Sym.of("n"), 64), DType.F32)
    h = g.rmsnorm(g.exp(g.mul(x, g.scalar(0.01, DType.F32))), None, 1e-6)
    g.output(g.matmul(h, g.const(torch.randn(64, 40) * 0.1)))
    many = [rand((FEW_ROWS + 5, 64), DType.F32)]
    for choice, torch_pool in (("generated", False), ("torch", True)):
        monkeypatch.setenv("KERNELIZE_CPU_GEMM", choice)
        cg = compile_graph(g, backend="cpu", cache=False)
        assert cg._bind(many).torch_pool is torch_pool
        torch.testing.assert_close(cg(*many)[0], evaluate(g, many)[0], rtol=1e-4, atol=1e-4)


def test_a_run_wakes_a_sleeping_worker_before_its_first_region():
    """kz_workers_wake (what a compiled graph's run calls first, cpu_build.with_workers): a worker asleep
    after a pause is woken and spins, so the run's first region finds it awake; then it sleeps again."""
    import time

    from kernelize.codegen import cpu_build

    pool = cpu_build.workers()

    def until(done, pause: float = 0.0) -> bool:
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            time.sleep(pause)
        return done()

    # waiting for the workers to fall asleep, the test sleeps between polls: a busy poll holds one of two
    # cores, and a worker then waits for the other, which a background build may hold (failed once so)
    pool.kz_workers_wake(2)  # starts the worker where none runs yet
    started = pool.kz_workers_started()  # (earlier tests may have started more, for larger teams)
    assert started >= 1
    assert until(lambda: pool.kz_workers_sleeping() == started, 1e-3)  # all asleep once their spin is over
    pool.kz_workers_wake(2)  # polled without sleeping: the woken worker spins for only 0.2 ms
    assert until(lambda: pool.kz_workers_sleeping() < started)  # the team's worker spins for a region
    assert until(lambda: pool.kz_workers_sleeping() == started, 1e-3)
    # (no check that a team of one wakes nobody: a woken worker is asleep again 0.2 ms later, so a later count
    # cannot see it, and one that a busy machine schedules late still counts as asleep until it runs)


def test_a_region_never_waits_for_a_worker_that_has_not_started():
    """kernelize's workers (cpu_workers.cpp): the caller claims a free region's shares as they come, so
    with the workers held back it runs every share itself and returns (an OpenMP region would wait for
    them); released, a worker runs shares again."""
    import ctypes
    import time

    from kernelize.codegen import cpu_build

    g = Graph()
    g.output(g.exp(g.input("x", (64, 256), DType.F32)))
    lib = cpu_build.load(cpu_build.build_shared_object(render(kernel_of(g))[0], "team_shares"))
    lib.kz_share_threads.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
    pool, old, switch = cpu_build.workers(), cpu_build.TEAM_DEADLINE.value, cpu_build.WORKERS.value
    who = (ctypes.c_int * 2)()
    try:
        cpu_build.WORKERS.value = 1
        pool.kz_workers_hold(1)
        cpu_build.TEAM_DEADLINE.value, shares = 0, pool.kz_workers_shares()
        assert lib.kz_share_threads(2, 1_000_000, who) == 0 and list(who) == [1, 1]
        assert pool.kz_workers_shares() == shares
        pool.kz_workers_hold(0)
        deadline, seen = time.monotonic() + 10, set()
        while 2 not in seen and time.monotonic() < deadline:
            cpu_build.TEAM_DEADLINE.value = 0
            lib.kz_share_threads(2, 2_000_000, who)
            seen |= set(who)
        assert 2 in seen and pool.kz_workers_started() >= 1 and pool.kz_workers_shares() > shares
    finally:
        pool.kz_workers_hold(0)
        cpu_build.TEAM_DEADLINE.value, cpu_build.WORKERS.value = old, switch


@pytest.mark.parametrize("mode", ["held", "openmp", "two_callers"])
def test_every_kernel_kind_is_exact_however_its_regions_run(mode):
    """Two threads, each kernel kind equal to the reference executor whether the workers are held back (the
    caller runs every free share; regions with a barrier still take a worker), the regions are OpenMP's
    ($KERNELIZE_CPU_WORKERS=openmp) or two Python threads call kernels at once (one gets the pool, the
    other runs its regions alone)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    g, xs = _every_kind_graph()
    cg = compile_graph(g, backend="cpu")
    cg.own_workers = mode != "openmp"  # the `auto` policy's switch, off: the regions are OpenMP's
    want = evaluate(g, xs)
    threads, old = torch.get_num_threads(), cpu_build.WORKERS.value
    try:
        torch.set_num_threads(2)
        cpu_build.workers().kz_workers_hold(int(mode == "held"))
        cpu_build.WORKERS.value = 0
        if mode == "two_callers":
            with ThreadPoolExecutor(2) as ex:
                results = list(ex.map(lambda _: [cg(*xs) for _ in range(20)], range(2)))
            runs = [r for rs in results for r in rs]
        else:
            runs = [cg(*xs)]
        for got in runs:
            for a, b in zip(got, want):  # 512-term dot products: summation order differs
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        cpu_build.workers().kz_workers_hold(0)
        cpu_build.WORKERS.value = old
        torch.set_num_threads(threads)


def test_a_graph_run_takes_kernelizes_workers_unless_it_calls_torchs_gemms():
    """The `auto` workers policy: a compiled graph's run whose steps are all generated at its sizes (a
    few-row matmul) runs its regions on kernelize's workers; at sizes where the matmul calls torch's GEMM
    the regions stay on torch's OpenMP pool, and the switch is back to OpenMP after either run."""
    from kernelize.autokernel.matmul import FEW_ROWS
    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    g, xs = _every_kind_graph()
    cg = compile_graph(g, backend="cpu")
    assert cpu_build.workers_policy() == "auto" and cg.own_workers and cpu_build.WORKERS.value == 0
    assert not cg._bind(xs).torch_pool
    many = [rand((FEW_ROWS + 1, 512), DType.F32), *xs[1:]]
    assert cg._bind(many).torch_pool
    for inputs in (xs, many):
        for got, want in zip(cg(*inputs), evaluate(g, inputs)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert cpu_build.WORKERS.value == 0


def test_a_forked_child_starts_workers_of_its_own():
    """The parent's workers do not exist in a forked child: its pool starts afresh and its regions run."""
    code = f"""
import os, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_cpu import _every_kind_graph
from kernelize.ir.reference import evaluate
from kernelize.runtime.compiled import compile_graph
torch.set_num_threads(2)
g, xs = _every_kind_graph()
cg = compile_graph(g, backend="cpu")
cg(*xs)
want = evaluate(g, xs)  # in the parent: torch's libgomp is not fork-safe, the child must not need it
pid = os.fork()
if pid == 0:
    ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(cg(*xs), want))
    os._exit(0 if ok else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600
    )
    assert out.stdout.strip().splitlines()[-1:] == ["0"], out.stderr[-2000:]


def test_compile_graph_end_to_end():
    plan = pytest.importorskip("kernelize.autokernel.plan", reason="planner not merged yet")
    from kernelize.runtime.compiled import compile_graph

    g = _row_graph("add_rmsnorm", DType.BF16, 256)
    cg = compile_graph(g, backend="cpu", cache=False)
    x, r, w = (rand(s, DType.BF16) for s in [(5, 256), (5, 256), (256,)])
    for got, want in zip(cg(x, r, w), evaluate(g, [x, r, w])):
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert plan is not None and all(k.backend == "cpu" for k in cg.kernels)


def test_compiled_graph_outputs_are_never_shared_with_the_caller():
    from kernelize.runtime.compiled import compile_graph

    plan = pytest.importorskip("kernelize.autokernel.plan", reason="planner not merged yet")
    assert plan is not None
    g = _row_graph("softmax", DType.F32, 4096)
    cg = compile_graph(g, backend="cpu", cache=False)
    x1, x2 = torch.randn(64, 4096), torch.randn(64, 4096)
    (y1,) = cg(x1)
    (y2,) = cg(x2)  # y1 is held: y2 must be a different buffer
    assert y1.data_ptr() != y2.data_ptr()
    torch.testing.assert_close(y1, torch.softmax(x1 * 0.5, -1))
    ptr = y2.data_ptr()
    del y2
    (y3,) = cg(x1)  # y2 was dropped: its buffer comes back, with the right values
    assert y3.data_ptr() == ptr
    torch.testing.assert_close(y3, y1)


# ---- exp without denormal arithmetic (perf): results must stay the exact ones --------------------------
def test_exp_denormal_range_is_exact():
    """Results below FLT_MIN are built from integer bits, not denormal multiplies: still correctly rounded."""
    g = Graph()
    a = g.input("a", ("n",), DType.F32)
    g.output(g.exp(a), g.sigmoid(a), g.erf(a))
    x = torch.cat([torch.linspace(-110.0, -80.0, 30001), torch.tensor([-math.inf, -87.3365, -103.97, 88.72])])
    got = run(kernel_of(g, KernelKind.POINTWISE, (Sym.of("n"),)), g, [x])
    e, sig, erf = (got[o] for o in g.outputs)
    want = torch.exp(x.double())
    # within 2 ulp of the true value at every scale: denormal ulps are 2^-149
    ulp = torch.maximum(want.abs() * 2.0**-23, torch.full_like(want, 2.0**-149))
    assert ((e.double() - want).abs() <= 2 * ulp).all()
    sub = (x < -87.4) & (x > -103.2)
    assert (e[x < -87.4] < 1.2e-38).all() and (e[sub] > 0).all()  # real denormals, not flushed to 0
    assert e[-4] == 0.0 and torch.isinf(torch.exp(torch.tensor(88.8))) and e[-1] > 3e38
    torch.testing.assert_close(sig.double(), torch.sigmoid(x.double()), rtol=1e-6, atol=1e-30)
    assert torch.equal(erf, torch.sign(x))


def test_exp_sigmoid_erf_are_within_a_few_ulp_everywhere():
    """The vector exp (shift rounding, degree-6 polynomial) and the sigmoid from exp(-|x|) against float64,
    over a dense range and the edges: 0, -0, the clamps, +-inf, NaN, 1e4, awkward lengths (tails)."""
    g = Graph()
    a = g.input("a", ("n",), DType.F32)
    g.output(g.exp(a), g.sigmoid(a), g.erf(a), g.mul(a, g.sigmoid(a)))
    edges = [0.0, -0.0, 1e4, -1e4, 87.3, -87.3, -87.29, -87.31, 88.7, -88.7, 89.0, math.inf, -math.inf, 1e-30]
    for n in (1, 7, 33, 4097):
        x = torch.cat([torch.linspace(-90.0, 89.0, n), torch.tensor(edges + [math.nan])])
        got = run(kernel_of(g, KernelKind.POINTWISE, (Sym.of("n"),)), g, [x])
        e, sig, erf, silu = (got[o] for o in g.outputs)
        xd = x.double()
        ulp = torch.maximum(torch.exp(xd).abs() * 2.0**-23, torch.full_like(xd, 2.0**-149))
        fin = x < 88.7
        assert ((e.double() - torch.exp(xd)).abs()[fin] <= 2 * ulp[fin]).all()
        # sigmoid: relative 4e-7 (~3 ulp) down to FLT_MIN; below -87.3 (1.23e-38) the result is 0
        want = torch.sigmoid(xd)
        ok = (sig.double() - want).abs() <= 4e-7 * want + 1.3e-38
        assert ok[:-1].all(), x[:-1][~ok[:-1]]
        torch.testing.assert_close(silu.double(), xd * want, rtol=4e-7, atol=90 * 1.3e-38, equal_nan=True)
        torch.testing.assert_close(erf.double(), torch.erf(xd), rtol=0, atol=4e-7, equal_nan=True)
        assert sig[-1].isnan() and e[-1].isnan() and erf[-1].isnan() and silu[-1].isnan()
        assert sig[x == -math.inf].eq(0).all() and sig[x == math.inf].eq(1).all()


def test_tanh_saturates_to_exactly_one_as_torch_does():
    """From |x| = 9.01084 the f32 tanh is exactly +-1 (torch's is); a comparison with -1 takes torch's branch
    (`where(tanh(x * 1e5) > -1, ...)` once took the other branch for 8 of 119 elements)."""
    g = Graph()
    a = g.input("a", ("n",), DType.F32)
    w = g.input("w", (1,), DType.F32)
    t = g.tanh(a)
    g.output(t, g.where(g.gt(g.tanh(g.mul(a, g.const(1e5, DType.F32))), w), a, w))
    x = torch.cat([torch.linspace(-12.0, 12.0, 4097), torch.tensor([9.01, -9.01, 1e4, -1e4, -math.inf])])
    got = run(kernel_of(g, KernelKind.POINTWISE, (Sym.of("n"),)), g, [x, torch.tensor([-1.0])])
    tanh, picked = (got[o] for o in g.outputs)
    want = torch.tanh(x)
    big = x.abs() >= 9.01084
    assert torch.equal(tanh[big], want[big]) and tanh[big].abs().eq(1).all()
    torch.testing.assert_close(tanh, want, rtol=0, atol=3e-7)
    assert torch.equal(picked, torch.where(torch.tanh(x * 1e5) > -1.0, x, torch.tensor(-1.0)))


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_masked_softmax_matches_reference(dtype):
    """softmax(x * scale + mask) with a causal -inf mask, very negative (finite) scores and whole masked
    rows, through the real planner (one row kernel) against the reference."""
    from kernelize.runtime.compiled import compile_graph

    n = 64
    g = Graph()
    x = g.input("x", ("rows", n), dtype)
    m = g.input("m", ("rows", n), DType.F32)
    g.output(g.softmax(g.add(g.mul(g.cast(x, DType.F32), 0.125), m)))
    causal = torch.full((n, n), -math.inf).triu(1)
    scores = rand((n, n), DType.F32, -20, 20)
    scores[3] = -1e4  # very negative finite logits: every exp(x - max) underflows but the max
    scores[5, ::2] = -200.0
    mask = causal.clone()
    mask[7, :] = -1e30  # a fully "masked" row with finite values: uniform
    ins = [scores.to(dtype.torch), mask]
    (got,) = compile_graph(g, backend="cpu")(*ins)
    (want,) = evaluate(g, ins)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float().sum(-1), torch.ones(n), rtol=1e-2, atol=1e-2)


# ---- compile units: identical kernels compile once ------------------------------------------------
def _layers_graph(layers: int) -> Graph:
    """``layers`` identical blocks (norm, matmul, exp) over weights of one shape: one kernel per block and
    kind, with the same source up to the kernel's name."""
    g = Graph()
    h = g.input("x", (Sym.of("n"), 64), DType.F32)
    for i in range(layers):
        w = g.input(f"w{i}", (64, 64), DType.F32)
        h = g.exp(g.mul(g.matmul(g.rmsnorm(h, None, 1e-6), w), g.scalar(0.01, DType.F32)))
    g.output(h)
    return g


def test_identical_kernels_compile_once_and_run_each_with_its_own_operands(monkeypatch):
    import re

    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    units: list[str] = []
    real = cpu_build.build_shared_object

    def spy(source: str, name: str = "kernel"):
        units.append(source)
        return real(source, name)

    monkeypatch.setattr(cpu_build, "build_shared_object", spy)
    g = _layers_graph(4)
    cg = compile_graph(g, backend="cpu", cache=False)
    defined = {m for src in units for m in re.findall(r"\bkz_k\d+\b", src)}
    assert len(cg.kernels) >= 4 and 0 < len(defined) < len(cg.kernels)
    xs = [rand((5, 64), DType.F32)] + [rand((64, 64), DType.F32) for _ in range(4)]
    for rows in (5, 40):  # the few-row function and torch's GEMM plus the epilogue
        xs[0] = rand((rows, 64), DType.F32)
        for got, want in zip(cg(*xs), evaluate(g, xs)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_identical_attention_kernels_compile_in_one_unit(monkeypatch):
    """Kernels built in a unit of their own (attention) compile once per distinct source, like the others:
    a transformer's twelve layers' attention kernels made twelve compiler runs (BERT-base cold: 18 -> 11 s)"""
    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    units: list[str] = []
    real = cpu_build.build_shared_object
    monkeypatch.setattr(
        cpu_build, "build_shared_object", lambda src, name="k": units.append(src) or real(src, name)
    )
    g = Graph()
    h = g.input("x", (1, 2, 5, 8), DType.F32)
    for _ in range(3):
        h = g.exp(g.mul(g.attention(h, h, h, None, scale=0.3, causal=True), g.scalar(0.5, DType.F32)))
    g.output(h)
    cg = compile_graph(g, backend="cpu", cache=False)
    attention = [k for k in cg.plan.kernels if k.kind is KernelKind.ATTENTION]
    assert len(attention) == 3
    assert sum(f"kz_{k.name}" in src for k in attention for src in units) == 1
    xs = [rand((1, 2, 5, 8), DType.F32)]
    torch.testing.assert_close(cg(*xs)[0], evaluate(g, xs)[0], rtol=1e-4, atol=1e-5)


def test_distinct_attention_kernels_share_a_unit_with_the_other_kernels(monkeypatch):
    """Attention kernels join the units of the other kernels (each in a namespace of its own, fp-contract fast
    only within it): two different ones (causal and not, other head dims) and the pointwise kernels between
    them compile in as many units as cores, not one unit per attention kernel (Swin-tiny cold: 4 -> 2)."""
    import re

    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    units: list[str] = []
    real = cpu_build.build_shared_object
    monkeypatch.setattr(
        cpu_build, "build_shared_object", lambda src, name="k": units.append(src) or real(src, name)
    )
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # one unit: every kernel in it
    g = Graph()
    x = g.input("x", (1, 2, 5, 8), DType.F32)
    y = g.input("y", (1, 2, 7, 16), DType.F32)
    a = g.exp(g.mul(g.attention(x, x, x, None, scale=0.3, causal=True), g.scalar(0.5, DType.F32)))
    g.output(a, g.tanh(g.attention(y, y, y, None, scale=0.2, causal=False)))
    cg = compile_graph(g, backend="cpu", cache=False)
    kernels = [u for u in units if "kz_attention_" in u]
    assert len(kernels) == 1 and len(set(re.findall(r"namespace (kz_attention_\w+) \{", kernels[0]))) == 2
    xs = [rand((1, 2, 5, 8), DType.F32), rand((1, 2, 7, 16), DType.F32)]
    for got, want in zip(cg(*xs), evaluate(g, xs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_same_source_groups_blank_only_the_entry_points_name():
    from kernelize.codegen.cpu_build import same_source_groups

    k = {n: PointwiseKernel(name=n, domain=()) for n in ("k1", "k10")}
    parts = {0: [(k["k1"], ())], 1: [(k["k10"], ())], 2: [(k["k1"], ())]}
    rendered = {"k1": ("void kz_k1(){kz_k10();}", "kz_k1"), "k10": ("void kz_k10(){kz_k10();}", "kz_k10")}
    # k1 calls kz_k10, k10 calls itself: not the same program
    assert same_source_groups([0, 1, 2], parts, rendered) == {0: [0, 2], 1: [1]}


def test_unit_chunks_balance_by_size_and_keep_order():
    from kernelize.codegen.cpu_build import unit_chunks

    chunks = unit_chunks([10, 11, 12, 13], [100, 1, 1, 100], most=2)
    assert sorted(chunks) == [[10, 11], [12, 13]] or sorted(chunks) == [[10, 12], [11, 13]]
    assert all(c == sorted(c) for c in chunks)


def test_matmul_of_static_many_rows_builds_only_its_epilogue(monkeypatch):
    import re

    from kernelize.codegen import cpu_build
    from kernelize.runtime.compiled import compile_graph

    units: list[str] = []
    real = cpu_build.build_shared_object
    monkeypatch.setattr(
        cpu_build, "build_shared_object", lambda src, name="k": units.append(src) or real(src, name)
    )
    g = Graph()
    x, w = g.input("x", (40, 64), DType.F32), g.input("w", (64, 32), DType.F32)
    g.output(g.exp(g.mul(g.matmul(x, w), g.scalar(0.01, DType.F32))))
    cg = compile_graph(g, backend="cpu", cache=False)
    (k,) = [k for k in cg.plan.kernels if k.kind is KernelKind.MATMUL]
    names = {m for src in units for m in re.findall(r"\bkz_\w+", src)}
    assert f"kz_{k.name}_epilogue" in names and f"kz_{k.name}" not in names
    xs = [rand((40, 64), DType.F32), rand((64, 32), DType.F32)]
    torch.testing.assert_close(cg(*xs)[0], evaluate(g, xs)[0], rtol=1e-4, atol=1e-5)


def test_compile_many_gives_each_kernel_the_source_and_results_of_compiling_it_alone():
    from kernelize.autokernel.plan import plan

    g = _layers_graph(3)
    kernels = [k for k in plan(g, BACKEND.plan_settings).kernels if k.kind is not KernelKind.LIBRARY]
    many = BACKEND.compile_many(kernels)
    alone = [BACKEND.compile(k) for k in kernels]
    assert [c.source for c in many] == [c.source for c in alone]
    assert [c.name for c in many] == [k.name for k in kernels]


def test_row_kernel_keeps_a_costly_value_in_scratch_for_the_write_pass():
    """``e = exp(z - max)`` summed in one pass and scaled in the write pass (the fused loss's chunk kernel):
    the statistics pass stores it into a scratch row, the write pass loads it instead of a second exp."""
    from kernelize.autokernel.plan import plan

    g = Graph()
    z = g.input("z", ("n", 300), DType.F32)
    e = g.exp(g.sub(z, g.reduce(Op.REDUCE_MAX, z, -1, keepdim=True)))
    s = g.reduce(Op.SUM, e, -1, keepdim=True)
    g.output(g.mul(e, g.reciprocal(s)), g.log(s))
    (k,) = [k for k in plan(g).kernels if k.kind is KernelKind.ROW]
    src = render(k)[0]
    assert "kz_scratch<float>" in src, src
    write_pass = src[src.rindex("#pragma omp simd") :]
    assert "kz_exp" not in write_pass, write_pass
    for rows in (1, 7, 129):
        _check_compiled(g, [rand((rows, 300), DType.F32) * 5])


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86 assembly")
@pytest.mark.parametrize("what", ["swish_mul", "softmax"])
def test_exp_kernels_compile_to_packed_vector_math(what):
    """The exp-based kernels' hot loops are vector code: packed FMAs and no calls to libm. A merge once
    turned the exp polynomial into an array read in a loop, which gcc left scalar in simd loops (SiluAndMul
    forward + backward 5x slower) while every result stayed right."""
    from kernelize.codegen.cpu_build import compiler, flags

    g = Graph()
    x = g.input("x", (64, 4096), DType.F32)
    if what == "swish_mul":
        g.output(g.mul(g.mul(x, g.sigmoid(x)), g.input("y", (64, 4096), DType.F32)))
    else:
        g.output(g.softmax(x))
    _, src = _planned_source(g)
    cmd = [compiler()[0], *flags(), "-x", "c++", "-", "-S", "-o", "-"]
    asm = subprocess.run(cmd, input=src, capture_output=True, text=True, check=True).stdout
    packed = [ln for ln in asm.splitlines() if "vfmadd" in ln and "ps" in ln.split()[0] and "mm" in ln]
    assert len(packed) >= 5, "no packed FMAs: the exp polynomial did not vectorise"
    assert "call\texpf" not in asm and "call\texp" not in asm
