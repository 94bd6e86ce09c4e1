"""Autodiff on the IR: vjp rules against torch autograd (f64, reference executor), and the forward/backward
split's choice of what to save."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kernelize.ir.autodiff import VJP, NotDifferentiable, split, vjp, worth_saving
from kernelize.ir.graph import ELEMENTWISE, LAYOUT, REDUCE, ROW, Graph, Op, Sym
from kernelize.ir.reference import evaluate
from kernelize.ir.torch_frontend import trace
from kernelize.passes.optimize import optimize

D = torch.float64


def _grads_via_vjp(graph: Graph, inputs: list[torch.Tensor], cts: list[torch.Tensor], wrt=None):
    joint = vjp(graph, wrt)
    outs = evaluate(joint.graph, [*inputs, *cts])
    return outs[: joint.n_outputs], outs[joint.n_outputs :], joint


def _grads_via_split(graph: Graph, inputs: list[torch.Tensor], cts: list[torch.Tensor]):
    cut = split(vjp(graph))
    fwd = evaluate(optimize(cut.forward), inputs)
    n = len(graph.outputs)
    saved = [fwd[i] for i in cut.saved_index]
    bwd = evaluate(optimize(cut.backward), [*(inputs[i] for i in cut.primals_read), *saved, *cts])
    return fwd[:n], bwd


def _torch_grads(fn, inputs: list[torch.Tensor], cts: list[torch.Tensor]):
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, tuple | list) else [outs]
    want = [x for x in leaves if x.requires_grad]
    return torch.autograd.grad(outs, want, cts, allow_unused=True, materialize_grads=True)


def _check(fn, *inputs: torch.Tensor, dynamic: bool = True, opt: bool = True) -> None:
    """Trace `fn`, differentiate on the IR (joint graph and the split pair), compare with torch autograd."""
    dims = [{0: "n"} if dynamic and k == 0 and x.dim() > 1 else None for k, x in enumerate(inputs)]
    graph = trace(fn, *inputs, dynamic_dims=dims)
    graph = optimize(graph) if opt else graph
    with torch.no_grad():
        ref_out = fn(*inputs)
    ref_out = list(ref_out) if isinstance(ref_out, tuple | list) else [ref_out]
    cts = [torch.randn_like(o) for o in ref_out]
    want = _torch_grads(fn, list(inputs), cts)
    _, got, _ = _grads_via_vjp(graph, list(inputs), cts)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    _, got2 = _grads_via_split(graph, list(inputs), cts)
    for g, w in zip(got2, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def r(*shape, positive: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, dtype=D)
    return t.abs() + 0.5 if positive else t


# ---- hand-written cases: every rule family ----------------------------------------------------------------
UNARY_CASES = {
    "exp": torch.exp,
    "log": lambda x: torch.log(x.abs() + 0.5),
    "sqrt": lambda x: torch.sqrt(x.abs() + 0.5),
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.5),
    "reciprocal": lambda x: 1 / (x.abs() + 0.5),
    "sin_cos": lambda x: torch.sin(x) * torch.cos(x),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "softplus": F.softplus,
    "abs": lambda x: torch.abs(x + 0.01),
    "neg_floor": lambda x: -x + torch.floor(x),
    "clamp": lambda x: torch.clamp(x, -0.5, 0.7),
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "pow3": lambda x: x**3,
    "cast_f32": lambda x: x.float().exp().double(),
}


@pytest.mark.parametrize("name", list(UNARY_CASES))
def test_unary_rules_match_torch(name: str) -> None:
    _check(UNARY_CASES[name], r(7, 9))


BINARY_CASES = {
    "add_broadcast": lambda x, y: x + y[0],
    "sub": lambda x, y: x - y,
    "mul_broadcast_col": lambda x, y: x * y[:, :1],
    "div": lambda x, y: x / (y.abs() + 0.5),
    "max": lambda x, y: torch.maximum(x, y),
    "min_and_tie": lambda x, y: torch.maximum(x, x) + torch.minimum(x, y),
    "pow": lambda x, y: (x.abs() + 0.5) ** y,
    "where": lambda x, y: torch.where(x > 0, x * 2, y),
}


@pytest.mark.parametrize("name", list(BINARY_CASES))
def test_binary_rules_match_torch(name: str) -> None:
    _check(BINARY_CASES[name], r(7, 9), r(7, 9), dynamic=False)


LAYOUT_CASES = {
    "view": lambda x: (x.reshape(7, 3, 3) * torch.arange(3, dtype=D)).reshape(7, 9),
    "permute": lambda x: x.reshape(7, 3, 3).permute(0, 2, 1).reshape(7, 9) * torch.arange(9, dtype=D),
    "slice_cat": lambda x: torch.cat((-x[:, 5:], x[:, :5]), dim=-1) * torch.arange(9, dtype=D),
    "pad": lambda x: F.pad(x, (2, 1)) * torch.arange(12, dtype=D),
    "flip": lambda x: x.flip(-1) * torch.arange(9, dtype=D),
    "transpose_matmul": lambda x: x.t() @ x,
}


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
def test_layout_rules_match_torch(name: str) -> None:
    _check(LAYOUT_CASES[name], r(7, 9), dynamic=False)


REDUCE_CASES = {
    "sum_rows": lambda x: x.sum(-1, keepdim=True) * x,
    "sum_cols": lambda x: x.sum(0),
    "mean": lambda x: x.mean(-1),
    "mean_cols_symbolic": lambda x: x.mean(0),
    "amax": lambda x: x.amax(-1),
    "amax_ties": lambda x: torch.cat([x, x], -1).amax(-1),
    "amin": lambda x: x.amin(-1),
    "prod": lambda x: (x.abs() + 0.5).prod(-1),
}


@pytest.mark.parametrize("name", list(REDUCE_CASES))
def test_reduction_rules_match_torch(name: str) -> None:
    _check(REDUCE_CASES[name], r(7, 9))


def test_matmul_rule_batched_and_weights() -> None:
    _check(lambda x, w, b: F.linear(x, w, b), r(5, 7, 9), r(4, 9), r(4))
    _check(lambda a, b: torch.matmul(a, b), r(2, 3, 4), r(4, 5), dynamic=False)


ROW_CASES = {
    "softmax": (lambda x: torch.softmax(x, -1), [r(7, 16)]),
    "softmax_axis0": (lambda x: torch.softmax(x, 0), [r(7, 16)]),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), [r(7, 16)]),
    "layernorm": (lambda x, w, b: F.layer_norm(x, (16,), w, b, 1e-5), [r(7, 16), r(16), r(16)]),
    "layernorm_plain": (lambda x: F.layer_norm(x, (16,), eps=1e-5), [r(7, 16)]),
    "rmsnorm": (
        lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
        [r(3, 7, 16), r(16)],
    ),
    "rmsnorm_plain": (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), [r(7, 16)]),
}


@pytest.mark.parametrize("name", list(ROW_CASES))
def test_recognised_row_ops_use_closed_forms(name: str) -> None:
    fn, inputs = ROW_CASES[name]
    graph = optimize(trace(fn, *inputs))
    assert any(n.op in ROW for n in graph.nodes), "the optimizer should recognise the row op"
    _check(fn, *inputs)


def test_half_precision_graph_accumulates_in_f32() -> None:
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    w = torch.randn(32, dtype=torch.bfloat16)
    g = Graph()
    gx, gw = g.input("x", ("n", 32), "bf16"), g.input("w", (32,), "bf16")
    g.output(g.rmsnorm(gx, gw, 1e-6))
    dy = torch.randn(6, 32, dtype=torch.bfloat16)
    _, (dx, dw), joint = _grads_via_vjp(g, [x, w], [dy])
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    assert any(n.op is Op.CAST and n.dtype.name == "F32" for n in joint.graph.nodes)
    want = _torch_grads(
        lambda a, b: a.float() * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True) + 1e-6) * b.float(),
        [x, w],
        [dy.float()],
    )
    torch.testing.assert_close(dx.float(), want[0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), want[1].float(), rtol=2e-2, atol=5e-2)


# ---- the split ------------------------------------------------------------------------------------------
def test_norm_saves_only_its_row_statistic() -> None:
    g = Graph()
    x, w = g.input("x", ("n", 64), "f32"), g.input("w", (64,), "f32")
    g.output(g.rmsnorm(x, w, 1e-6))
    cut = split(vjp(g))
    saved = cut.forward.outputs[1:]
    assert [tuple(map(str, s.shape)) for s in saved] == [("n", "1")]
    assert cut.primals_read == (0, 1)  # backward reads x and w, recomputes x * rstd


def test_layernorm_saves_its_mean_too_so_backward_reduces_no_input_row() -> None:
    """xhat is recomputed, but not the mean inside it: backward's only row reductions are over gradients
    (one pass computes both), none over x alone."""
    g = Graph()
    x, w, b = g.input("x", ("n", 64), "f64"), g.input("w", (64,), "f64"), g.input("b", (64,), "f64")
    g.output(g.layernorm(x, w, b, 1e-5))
    cut = split(vjp(g))
    assert [tuple(map(str, s.shape)) for s in cut.forward.outputs[1:]] == [("n", "1"), ("n", "1")]
    backward = optimize(cut.backward)
    x_in = backward.inputs[0]
    means = [n for n in backward.nodes if n.op in (Op.MEAN, Op.SUM) and n.src[0] is x_in]
    assert means == [] and cut.primals_read == (0, 1)
    fwd_ops = {n.op for n in optimize(cut.forward).nodes}  # the statistics are computed once, shared
    assert Op.LAYERNORM not in fwd_ops and Op.RSQRT in fwd_ops
    inputs = [torch.randn(5, 64, dtype=D), torch.rand(64, dtype=D) + 0.5, torch.randn(64, dtype=D)]
    dy = torch.randn(5, 64, dtype=D)
    _, grads = _grads_via_split(g, inputs, [dy])
    want = _torch_grads(lambda a, c, d: F.layer_norm(a, (64,), c, d, 1e-5), inputs, [dy])
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)


def test_activation_saves_nothing_and_recomputes_from_its_input() -> None:
    x = torch.randn(4, 32)
    graph = optimize(trace(lambda t: F.silu(t[:, :16]) * t[:, 16:], x, dynamic_dims=[{0: "n"}]))
    cut = split(vjp(graph))
    assert cut.n_saved == 0 and cut.primals_read == (0,)


def test_worth_saving_compares_bytes() -> None:
    g = Graph()
    x = g.input("x", ("n", 1024), "f32")
    stat = g.reduce(Op.MEAN, g.mul(x, x), -1, keepdim=True)
    assert worth_saving([stat], [x], [stat])
    big = g.exp(x)
    assert not worth_saving([big], [x], [])


def test_no_rule_raises_naming_the_op() -> None:
    g = Graph()
    x = g.input("x", (5, 4), "f64")
    idx = g.const(torch.tensor([0, 2]))
    g.output(g.gather(x, idx, 0))
    with pytest.raises(NotDifferentiable, match="gather"):
        vjp(g)


def test_integer_input_is_not_differentiated() -> None:
    g = Graph()
    x, i = g.input("x", (5,), "f64"), g.input("i", (5,), "i64")
    g.output(g.mul(x, g.cast(i, "f64")))
    assert vjp(g).wrt == (0,)
    with pytest.raises(NotDifferentiable, match="'i'"):
        vjp(g, wrt=[1])


def test_every_differentiable_op_has_a_rule() -> None:
    no_rule = {Op.INPUT, Op.CONST, Op.GATHER, Op.CONV, Op.POOL, Op.ATTENTION, Op.EXPERTS, Op.TOPK, Op.ROUTE}
    assert set(Op) - set(VJP) == no_rule
    assert ELEMENTWISE | LAYOUT | REDUCE | ROW <= set(VJP) | no_rule


# ---- random graphs ----------------------------------------------------------------------------------------
SAFE_UNARY = [Op.EXP, Op.TANH, Op.SIGMOID, Op.SIN, Op.NEG, Op.ERF, Op.SOFTPLUS]
BINARY_OPS = [Op.ADD, Op.SUB, Op.MUL]


@st.composite
def random_graphs(draw):
    """A chain of elementwise, broadcast, reduction, row and layout steps over [n, 8] f64 values."""
    g = Graph()
    x = g.input("x", ("n", 8), "f64")
    w = g.input("w", (8,), "f64")
    vals = [x]
    for _ in range(draw(st.integers(1, 7))):
        a = draw(st.sampled_from(vals))
        kind = draw(st.sampled_from(["unary", "binary", "weight", "reduce", "row", "permute"]))
        if kind == "unary":
            v = g.unary(draw(st.sampled_from(SAFE_UNARY)), a)
        elif kind == "binary":
            v = g.binary(draw(st.sampled_from(BINARY_OPS)), a, draw(st.sampled_from(vals)))
        elif kind == "weight":
            v = g.mul(a, w)
        elif kind == "reduce":
            v = g.broadcast(
                g.reduce(draw(st.sampled_from([Op.SUM, Op.MEAN, Op.REDUCE_MAX])), a, -1, True), a.shape
            )
        elif kind == "row":
            op = draw(st.sampled_from([Op.SOFTMAX, Op.LOG_SOFTMAX, Op.RMSNORM, Op.LAYERNORM]))
            if op is Op.RMSNORM:
                v = g.rmsnorm(a, w, 1e-6)
            elif op is Op.LAYERNORM:
                v = g.layernorm(a, w, None, 1e-5)
            elif op is Op.SOFTMAX:
                v = g.softmax(a, 1)
            else:
                v = g.log_softmax(a, 1)
        else:
            v = g.permute(g.view(a, (Sym.of("n"), 2, 4)), (0, 2, 1))
            v = g.mul(g.view(v, a.shape), g.view(g.permute(g.view(w, (2, 4)), (1, 0)), (8,)))
        vals.append(v)
    g.output(vals[-1], g.reduce(Op.SUM, vals[draw(st.integers(0, len(vals) - 1))], 0, True))
    return g


@given(random_graphs(), st.sampled_from([1, 7]))
def test_random_graphs_match_torch_autograd(graph: Graph, rows: int) -> None:
    x = torch.randn(rows, 8, dtype=D)
    w = torch.randn(8, dtype=D)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    outs = evaluate(graph, leaves)  # the reference executor is torch ops: autograd through it is the oracle
    cts = [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, leaves, cts, allow_unused=True, materialize_grads=True)
    _, got, _ = _grads_via_vjp(graph, [x, w], cts)
    for gv, wv in zip(got, want):
        torch.testing.assert_close(gv, wv, rtol=1e-7, atol=1e-7)
    _, got2 = _grads_via_split(optimize(graph), [x, w], cts)
    for gv, wv in zip(got2, want):
        torch.testing.assert_close(gv, wv, rtol=1e-7, atol=1e-7)


def test_forward_outputs_backward_reads_are_kept_by_reference() -> None:
    """softmax's backward reads its result (not x, no recomputation); add+RMSNorm's recomputes x_hat from
    the sum h it returns (not from x and r, and not a stored x_hat); neither is returned twice."""
    g = Graph()
    x = g.input("x", ("n", 64), "f32")
    g.output(g.softmax(x, -1))
    cut = split(vjp(g))
    assert cut.saved_index == (0,) and cut.primals_read == () and len(cut.forward.outputs) == 1
    g = Graph()
    x, r, w = g.input("x", ("n", 64), "f64"), g.input("r", ("n", 64), "f64"), g.input("w", (64,), "f64")
    h = g.add(x, r)
    g.output(h, g.rmsnorm(h, w, 1e-6))
    cut = split(vjp(g))
    assert 0 in cut.saved_index and len(cut.forward.outputs) == 3  # h, y, rstd
    assert [tuple(map(str, o.shape)) for o in cut.forward.outputs[2:]] == [("n", "1")]
    assert cut.primals_read == (2,)  # only w
    xs = [torch.randn(5, 64, dtype=torch.float64) for _ in range(2)] + [torch.randn(64, dtype=torch.float64)]
    cts = [torch.randn(5, 64, dtype=torch.float64) for _ in range(2)]
    got = _grads_via_split(g, xs, cts)[1]
    want = _torch_grads(lambda a, b, c: (a + b, _rms(a + b, c)), xs, cts)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _rms(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_equal_gradients_are_distinct_outputs() -> None:
    """x + r gives x and r the same gradient: two graph values, so one kernel stores both (a shared value
    would be copied by the runtime, a read and a write more)."""
    g = Graph()
    x, r = g.input("x", ("n", 64), "f64"), g.input("r", ("n", 64), "f64")
    g.output(g.exp(g.add(x, r)))
    joint = vjp(g)
    dx, dr = joint.graph.outputs[1:]
    assert dx is not dr
    xs = [torch.randn(3, 64, dtype=torch.float64) for _ in range(2)]
    ct = torch.randn(3, 64, dtype=torch.float64)
    out = evaluate(joint.graph, [*xs, ct])
    torch.testing.assert_close(out[1], out[2])
    torch.testing.assert_close(out[1], ct * (xs[0] + xs[1]).exp())
