"""The Triton code generator, run under the Triton interpreter on CPU tensors against ``ir.evaluate``.

Kernel specs are built by hand here (see triton_specs.py) so each kernel shape is checked on its own;
tests/codegen/test_triton_layers.py goes through trace -> plan -> compile_graph.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import py_compile
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton_specs import broadcast_strides, check, contiguous, pointwise_from_graph, randn, row_kernel

from kernelize.autokernel.kernels import (
    Compute,
    Indirect,
    LibraryKernel,
    Load,
    MatmulKernel,
    PointwiseKernel,
    RowKernel,
    Store,
)
from kernelize.codegen.template import TemplateError, fill
from kernelize.codegen.triton import TritonBackend, TritonRenderer, launch_config, render
from kernelize.codegen.triton_base import cache_dir, load_module
from kernelize.codegen.triton_rows import looped
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Op
from kernelize.ir.ops import ClampArgs, ConcatArgs, NormArgs
from kernelize.ir.shapes import Sym
from kernelize.runtime import diskcache
from kernelize.runtime.cache import KERNELS
from kernelize.runtime.compiled import compile_graph

B, S = Sym.of("batch"), Sym.of("seq")
FLOATS = [DType.F32, DType.F16, DType.BF16]


def test_interpreter_is_on():
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert TritonBackend().device_ok(torch.device("cpu"))


# -- render table --------------------------------------------------------------------------------------
def test_renderer_overrides():
    r = TritonRenderer()
    assert r.expr(Compute(Op.MAX, DType.F32, (0, 1)), ["a", "b"]) == (
        "tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)"
    )
    assert r.expr(Compute(Op.MAX, DType.I32, (0, 1)), ["a", "b"]) == "tl.maximum(a, b)"
    assert r.expr(Compute(Op.DIV, DType.I32, (0, 1)), ["a", "b"]) == "(a // b)"
    assert r.expr(Compute(Op.CAST, DType.F16, (0,)), ["a"]) == "a.to(tl.float16).to(tl.float32)"
    assert r.expr(Compute(Op.CLAMP, DType.F32, (0,), ClampArgs(hi=6.0)), ["a"]) == (
        "tl.minimum(a, 6.0, propagate_nan=tl.PropagateNan.ALL)"
    )
    assert r.literal(float("-inf"), DType.F32) == 'float("-inf")'
    assert r.dim(Sym(("batch", "seq"), 64)) == "(64 * s_batch * s_seq)"


def test_source_is_deterministic_and_readable():
    g = Graph()
    x = g.input("x", (B, 64), "f32")
    w = g.input("w", (64,), "f32")
    y = g.rmsnorm(x, w, 1e-6)
    g.output(y)
    k = row_kernel(g, x, y, [Compute(Op.RMSNORM, DType.F32, (0, 1), NormArgs(1e-6, True))], [w])
    a, b = render(k), render(k)
    assert a == b
    assert "def k0(x_ptr, w_ptr, out0_ptr, s_batch, BLOCK: tl.constexpr, IDX64: tl.constexpr):" in a
    assert "do_not_specialize=['s_batch']" in a
    assert "tl.rsqrt" in a and "for start in range" not in a
    compile(a, "<generated>", "exec")  # valid python


def test_template_filler_rejects_bad_keys():
    with pytest.raises(TemplateError):
        fill("a $X$ $Y$", X="1")
    with pytest.raises(TemplateError):
        fill("a $X$", X="1", Z="2")


# -- pointwise ------------------------------------------------------------------------------------------
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


@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_float_ops(dtype):
    g = Graph()
    x = g.input("x", (7, 33), dtype)
    outs = []
    for op in UNARY_F:
        v = g.abs(x) if op in (Op.LOG, Op.SQRT, Op.RSQRT) else x
        outs.append(g.unary(op, g.add(v, 0.5) if op in (Op.LOG, Op.RSQRT, Op.RECIPROCAL) else v))
    outs += [g.gelu(x), g.gelu(x, "tanh"), g.clamp(x, -0.5, 0.75)]
    for o in outs:
        sub = Graph()
        xi = sub.input("x", x.shape, dtype)
        sub.output(_replay(sub, g, o, {x: xi}))
        xs = [randn(x.shape, dtype) * 3]
        xs[0].view(-1)[:4] = torch.tensor([2.5, -2.5, 0.5, 1.5]).to(dtype.torch)  # round-half-even cases
        check(sub, [pointwise_from_graph(sub)], xs)


def _replay(dst: Graph, src: Graph, node, env):
    """Copy the nodes ``node`` depends on from ``src`` into ``dst`` (a sub-graph per op)."""
    for n in src.nodes:
        if n in env or n.op is Op.INPUT:
            continue
        env[n] = dst.push(n.op, n.dtype, n.shape, [env[s] for s in n.src], n.arg)
        if n is node:
            break
    return env[node]


@pytest.mark.parametrize("dtype", [DType.I32, DType.I64, DType.I8])
def test_integer_ops(dtype):
    g = Graph()
    a = g.input("a", (5, 9), dtype)
    b = g.input("b", (9,), dtype)
    nz = g.where(g.eq(b, 0), g.scalar(3, dtype), b)
    y = g.add(g.div(a, nz), g.mul(g.mod(a, nz), g.scalar(7, dtype)))
    y = g.sub(g.max(y, g.min(a, b)), g.cast(g.and_(g.gt(a, b), g.not_(g.le(a, 0))), dtype))
    y = g.add(y, g.sign(g.neg(g.abs(a))))
    g.output(y)
    check(g, [pointwise_from_graph(g)], [randn((5, 9), dtype), randn((9,), dtype)])


def test_casts_compares_and_where_mixed():
    g = Graph()
    x = g.input("x", (3, 1, 17), "f16")
    m = g.input("m", (4, 1), "bool")
    xf = g.cast(x, "f32")
    y = g.where(m, g.pow(g.abs(xf), g.scalar(1.5, "f32")), g.mod(xf, g.scalar(0.7, "f32")))
    g.output(g.add(g.cast(y, "bf16"), g.scalar(1.0, "bf16")))
    check(g, [pointwise_from_graph(g)], [randn((3, 1, 17), DType.F16), randn((4, 1), DType.BOOL)])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from([(1,), (7,), (33, 7), (4097,), (2, 3, 5), (0, 5), (3, 1, 33)]),
    dtype=st.sampled_from(FLOATS),
    ops=st.lists(
        st.sampled_from([Op.ADD, Op.MUL, Op.SUB, Op.MAX, Op.EXP, Op.TANH, Op.SIGMOID, Op.NEG]),
        min_size=1,
        max_size=5,
    ),
    bcast=st.booleans(),
)
def test_random_elementwise_chains(shape, dtype, ops, bcast):
    g = Graph()
    x = g.input("x", shape, dtype)
    w = g.input("w", (shape[-1],) if bcast else shape, dtype)
    v = x
    for op in ops:
        if op in (Op.EXP, Op.TANH, Op.SIGMOID, Op.NEG):
            v = g.unary(op, g.clamp(v, -3.0, 3.0) if op is Op.EXP else v)
        else:
            v = g.binary(op, v, w)
    g.output(v)
    check(g, [pointwise_from_graph(g)], [randn(shape, dtype), randn(w.shape, dtype)])


def test_symbolic_dims_share_one_compiled_kernel():
    g = Graph()
    x = g.input("x", (B, S, 16), "f32")
    g.output(g.mul(g.sigmoid(x), x))
    k = pointwise_from_graph(g)
    before = len(KERNELS)
    for b, s in [(1, 1), (2, 5), (3, 7)]:
        check(g, [k], [torch.randn(b, s, 16)])
    assert len(KERNELS) - before <= 1  # the same source, loaded once
    assert "s_batch" in render(k) and "s_seq" in render(k)


def test_silu_and_mul_reads_halves_of_one_buffer():
    h = 48
    g = Graph()
    x = g.input("x", (B, 2 * h), "f16")
    a, b = g.slice(x, 1, 0, h), g.slice(x, 1, h)
    y = g.mul(g.mul(a, g.sigmoid(a)), b)
    g.output(y)
    k = PointwiseKernel(
        "silu_and_mul",
        (B, h),
        (
            Load(x, (2 * h, 1)),
            Load(x, (2 * h, 1), offset=h),
            Compute(Op.SIGMOID, DType.F16, (0,)),
            Compute(Op.MUL, DType.F16, (0, 2)),
            Compute(Op.MUL, DType.F16, (3, 1)),
        ),
        (Store(4, y, (h, 1)),),
    )
    check(g, [k], [torch.randn(5, 2 * h).half()])


def test_noncontiguous_load_and_concat_with_masks():
    """Rotary's rotate_half: cat(-x2, x1) as masked loads plus a CONCAT, reading a transposed input."""
    d = 8
    g = Graph()
    xt = g.input("xt", (d, 6), "f32")  # the kernel reads it transposed: x = xt.T
    x = g.transpose(xt)
    x1, x2 = g.slice(x, 1, 0, d // 2), g.slice(x, 1, d // 2)
    y = g.concat([g.neg(x2), x1], 1)
    g.output(y)
    tr = (1, 6)  # strides of x = xt.T over (6, d)
    k = PointwiseKernel(
        "rot",
        (6, d),
        (
            Load(xt, tr, offset=d // 2 * 6, mask=((1, 0, d // 2),)),
            Compute(Op.NEG, DType.F32, (0,)),
            Load(xt, tr, offset=-(d // 2) * 6, mask=((1, d // 2, d),)),
            Compute(Op.CONCAT, DType.F32, (1, 2), ConcatArgs(1, (d // 2, d))),
        ),
        (Store(3, y, (d, 1)),),
    )
    check(g, [k], [torch.randn(d, 6)])


def test_indirect_gather_load():
    g = Graph()
    table = g.input("table", (10, 4), "f32")
    idx = g.input("idx", (B,), "i64")
    y = g.gather(table, idx, 0)
    g.output(y)
    k = PointwiseKernel(
        "emb",
        (B, 4),
        (
            Load(idx, (1, 0)),
            Load(table, (0, 1), indirect=(Indirect(0, 4, 10),)),
        ),
        (Store(1, y, (4, 1)),),
    )
    check(g, [k], [torch.randn(10, 4), torch.tensor([0, 9, -1, 3, -10])])
    # out of range (past either end): the kernel sets its error flag, which the launcher asserts is 0
    # (asynchronously on a GPU; here at once), and reads element 0, never outside the table
    cg = compile_graph(g, backend="triton", device="cpu", plan=[k])
    assert "kz_err_ptr" in cg.kernels[0].source
    table_in = torch.randn(10, 4)
    for bad in ([10], [-11], [3, 1 << 40], [-(1 << 40), 0]):
        with pytest.raises(RuntimeError, match="triton kernel emb: a gather index is out of range"):
            cg(table_in, torch.tensor(bad))
    got = torch.empty(5, 4)
    launch = cg.kernels[0].launch
    with pytest.raises(RuntimeError, match="out of range"):
        launch([torch.tensor([10, -11, 3, 1 << 40, -(1 << 40)]), table_in], [got], {"batch": 5})
    torch.testing.assert_close(got, table_in[[0, 0, 3, 0, 0]])


# -- rows ----------------------------------------------------------------------------------------------
ROW_OPS = ["rmsnorm", "layernorm", "softmax", "log_softmax"]


def _row_graph(kind: str, n: int, dtype: DType, rows=B):
    g = Graph()
    x = g.input("x", (rows, n), dtype)
    w = g.input("w", (n,), dtype)
    b = g.input("b", (n,), dtype)
    if kind == "rmsnorm":
        y, e, params = g.rmsnorm(x, w, 1e-6), Compute(Op.RMSNORM, dtype, (0, 1), NormArgs(1e-6, True)), [w]
    elif kind == "layernorm":
        y, params = g.layernorm(x, w, b, 1e-5), [w, b]
        e = Compute(Op.LAYERNORM, dtype, (0, 1, 2), NormArgs(1e-5, True, True))
    else:
        op = Op.SOFTMAX if kind == "softmax" else Op.LOG_SOFTMAX
        y, e, params = g._row(op, x, 1), Compute(op, dtype, (0,), 1), []
    g.output(y)
    used = [x, *params]
    g.inputs = [i for i in g.inputs if i in used]
    return g, row_kernel(g, x, y, [e], params)


@pytest.mark.parametrize("kind", ROW_OPS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 33, 4097, 70000])
def test_row_ops(kind, dtype, n):
    rows = 3 if n > 5000 else 6
    g, k = _row_graph(kind, n, dtype, rows)
    assert looped(k) == (n > 65536)
    check(g, [k], [randn(i.shape, dtype) for i in g.inputs])


@pytest.mark.parametrize("kind", ROW_OPS)
def test_row_ops_symbolic_row_loops(kind):
    g, k = _row_graph(kind, S, DType.F32)
    assert looped(k) and "for start in range(0, (s_seq), BLOCK)" in render(k)
    for n in (5, 300):
        check(g, [k], [torch.randn(4, n) * 4] + [torch.randn(n) for _ in g.inputs[1:]])


REDUCES = [Op.SUM, Op.MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN, Op.PROD, Op.ARGMAX, Op.ARGMIN]


@pytest.mark.parametrize("op", REDUCES)
@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("n", [7, 70001])
def test_reductions_over_any_axis(op, axis, n):
    """Reduce axis ``axis`` of a (2, 3, 4) tensor scaled up: the reduced axis goes last through strides."""
    shape = [2, 3, 4]
    shape[axis] = n
    g = Graph()
    x = g.input("x", tuple(shape), "f32")
    y = g.reduce(op, x, axis, keepdim=True)
    g.output(y)
    outer = [i for i in range(3) if i != axis]
    xs = contiguous(shape)
    domain = (*(shape[i] for i in outer), n)
    ys = contiguous(y.shape)
    k = RowKernel(
        "red",
        domain,
        (
            Load(x, (*(xs[i] for i in outer), xs[axis])),
            Compute(op, y.dtype, (0,), (2,)),
        ),
        (Store(1, y, (*(ys[i] for i in outer), 0)),),
        row_rank=1,
    )
    scale = 0.05 if op is Op.PROD else 1.0
    check(g, [k], [1.0 + torch.randn(*shape) * scale if op is Op.PROD else torch.randn(*shape)])


def test_row_kernel_with_per_row_and_full_stores():
    """add + rmsnorm: stores the residual sum (full) and its row mean (per row) from one kernel."""
    g = Graph()
    x, r, w = g.input("x", (B, 64), "bf16"), g.input("r", (B, 64), "bf16"), g.input("w", (64,), "bf16")
    h = g.add(x, r)
    y = g.rmsnorm(h, w, 1e-6)
    m = g.reduce(Op.MEAN, h, 1, keepdim=True)
    g.output(y, h, m)
    k = RowKernel(
        "add_rms",
        (B, 64),
        (
            Load(x, (64, 1)),
            Load(r, (64, 1)),
            Compute(Op.ADD, DType.BF16, (0, 1)),
            Load(w, (0, 1)),
            Compute(Op.RMSNORM, DType.BF16, (2, 3), NormArgs(1e-6, True)),
            Compute(Op.MEAN, DType.BF16, (2,), (1,)),
        ),
        (Store(4, y, (64, 1)), Store(2, h, (64, 1)), Store(5, m, (1, 0))),
        row_rank=1,
    )
    check(g, [k], [torch.randn(5, 64).bfloat16() for _ in range(2)] + [torch.randn(64).bfloat16()])


# -- matmul --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16])
@pytest.mark.parametrize("mnk", [(7, 33, 20), (1, 16, 70), (40, 5, 16)])
def test_matmul_bias_relu_epilogue(dtype, mnk):
    m, n, kk = mnk
    g = Graph()
    x = g.input("x", (2, m, kk), dtype)
    w = g.input("w", (n, kk), dtype)  # nn.Linear layout: the kernel reads w transposed
    bias = g.input("bias", (n,), dtype)
    mm = g.matmul(x, g.transpose(w))
    y = g.max(g.add(mm, bias), g.scalar(0, dtype))
    g.output(y)
    k = MatmulKernel(
        "linear_relu",
        (2, m, n),
        (
            Compute(Op.MATMUL, dtype, (1, 2), kk),
            Load(x, (m * kk, kk, 0, 1)),
            Load(w, (0, 0, kk, 1)),
            Load(bias, (0, 0, 1)),
            Compute(Op.ADD, dtype, (0, 3)),
            Load(g.scalar(0, dtype), (0, 0, 0)),
            Compute(Op.MAX, dtype, (4, 5)),
        ),
        (Store(6, y, contiguous(y.shape)),),
    )
    grid, meta = launch_config(k, {})
    assert meta["BK"] >= 16 and grid[1] == 2
    check(g, [k], [randn(x.shape, dtype), randn(w.shape, dtype), randn(bias.shape, dtype)])


def test_zero_size_and_library_kernels_in_one_plan():
    """A conv runs as a library call; its bias + relu neighbour is a generated kernel; empty batches work."""
    g = Graph()
    x = g.input("x", (B, 2, 5, 5), "f32")
    w = g.input("w", (3, 2, 3, 3), "f32")
    c = g.conv(x, w)
    y = g.max(c, g.scalar(0.0, "f32"))
    g.output(y)
    lib = LibraryKernel("conv", c.shape, node=c, inputs=(x, w))
    zero = y.src[1]
    while zero.op is not Op.CONST:
        zero = zero.src[0]
    relu = PointwiseKernel(
        "relu",
        y.shape,
        (Load(c, contiguous(c.shape)), Load(zero, (0, 0, 0, 0)), Compute(Op.MAX, DType.F32, (0, 1))),
        (Store(2, y, contiguous(y.shape)),),
    )
    for b in (2, 0):
        check(g, [lib, relu], [torch.randn(b, 2, 5, 5), torch.randn(3, 2, 3, 3)])


def test_broadcast_strides_helper():
    assert broadcast_strides((1, 4), (3, 4)) == (0, 1)
    assert broadcast_strides((4,), (2, 3, 4)) == (0, 0, 1)


# -- module cache: generated modules are imported only from a folder this user alone can write ----------
@pytest.mark.parametrize("case", ["world_writable", "other_owner"])
def test_planted_bytecode_in_unsafe_module_folder_is_never_loaded(case, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    source = f"ANSWER = 42\n# {'x' * 200} {tmp_path}\n"  # unique per test: the module name holds its hash
    root = tmp_path / "shared"
    (root / "triton").mkdir(parents=True)
    planted = root / "triton" / f"kz_plant_{hashlib.sha256(source.encode()).hexdigest()[:16]}.py"
    planted.write_text(source)  # the exact source kernelize would write...
    evil = tmp_path / "evil.py"  # ...next to bytecode of other code that claims that source's size and time
    evil_src = f"open({str(marker)!r}, 'w').write('ran'); ANSWER = 0\n"
    evil.write_text(evil_src + "#" * (len(source) - len(evil_src) - 1) + "\n")
    assert evil.stat().st_size == planted.stat().st_size
    for p in (planted, evil):
        os.utime(p, (1_700_000_000, 1_700_000_000))
    py_compile.compile(
        str(evil),
        cfile=importlib.util.cache_from_source(str(planted)),
        invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP,
        doraise=True,
    )
    if case == "other_owner":
        for p in (root, *root.rglob("*")):
            os.chown(p, 4242, 4242)
    else:
        for p in (root, root / "triton"):
            p.chmod(0o777)
    private = tmp_path / "tmpdir"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.setattr(diskcache, "_fallback", None)
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(root))
    with pytest.warns(RuntimeWarning, match=f"{root}.*(writable by group or others|owned by uid 4242)"):
        module = load_module(source, "kz_plant", interpret=True)
    assert not marker.exists(), "bytecode planted in an unsafe module folder ran"
    assert module.ANSWER == 42 and Path(module.__file__).is_relative_to(private)
    assert cache_dir() == Path(module.__file__).parent and cache_dir().name == "triton"
