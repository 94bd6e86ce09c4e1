"""Hub layers in training: generated forward+backward kernels against torch autograd through the plain math.

The oracle is eager torch autograd on the layer's own math function (not the reference backend, which runs
the same IR autodiff)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from kernelize import hub, hub_autograd

ROWS = (1, 7, 129)


def _cases(pkg, dtype: torch.dtype, rows: int):
    """name -> (math fn, activations, weights, params); every tensor requires grad."""
    norm, act, soft, rot = pkg["layer_norm"], pkg["activation"], pkg["softmax"], pkg["rotary"]

    def t(*shape):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    h = 48
    return {
        "rms_norm": (norm.rms_norm_math, [t(rows, h)], [t(h)], {"eps": 1e-6}),
        "gemma_rms_norm": (norm.gemma_rms_norm_math, [t(rows, 3, h)], [t(h)], {"eps": 1e-6}),
        "layer_norm": (norm.layer_norm_math, [t(rows, h)], [t(h), t(h)], {"eps": 1e-5}),
        "fused_add_rms_norm": (norm.fused_add_rms_norm_math, [t(rows, h), t(rows, h)], [t(h)], {"eps": 1e-6}),
        "silu_and_mul": (act.silu_and_mul_math, [t(rows, 2 * h)], [], {}),
        "gelu_and_mul": (act.gelu_and_mul_math, [t(rows, 2 * h)], [], {}),
        "gelu_tanh_and_mul": (act.gelu_tanh_and_mul_math, [t(rows, 2 * h)], [], {}),
        "quick_gelu": (act.quick_gelu_math, [t(rows, h)], [], {}),
        "softmax": (soft.softmax_math, [t(rows, 4, h)], [], {"dim": 2}),
        "scaled_softmax": (soft.scaled_softmax_math, [t(rows, h)], [], {"scale": 0.3}),
        "rotary": (rot.rotary_neox_one, [t(rows, 4, 16), t(rows, 1, 16), t(rows, 1, 16)], [], {}),
    }


def _leaves(ins, ws):
    return [x for x in (*ins, *ws) if x.requires_grad]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name",
    [
        "rms_norm",
        "gemma_rms_norm",
        "layer_norm",
        "fused_add_rms_norm",
        "silu_and_mul",
        "gelu_and_mul",
        "gelu_tanh_and_mul",
        "quick_gelu",
        "softmax",
        "scaled_softmax",
        "rotary",
    ],
)
def test_cpu_backward_kernels_match_torch_autograd(hub_pkg, name: str, dtype: torch.dtype, rows: int) -> None:
    fn, ins, ws, params = _cases(hub_pkg, dtype, rows)[name]
    out = hub.run(None, fn, ins, ws, **params)
    outs = out if isinstance(out, tuple) else (out,)
    seeds = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, _leaves(ins, ws), seeds)
    want_out = fn(*ins, *ws, **params)
    want_outs = want_out if isinstance(want_out, tuple) else (want_out,)
    want = torch.autograd.grad(want_outs, _leaves(ins, ws), seeds)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        # weight gradients sum over rows: scale the tolerance with the row count
        scale = 1.0 + (w.dim() == 1) * rows**0.5
        torch.testing.assert_close(g, w, rtol=tol["rtol"] * scale, atol=tol["atol"] * scale)


def test_empty_batch_trains(hub_pkg) -> None:
    fn, ins, ws, params = _cases(hub_pkg, torch.float32, 0)["rms_norm"]
    out = hub.run(None, fn, ins, ws, **params)
    dx, dw = torch.autograd.grad(out, _leaves(ins, ws), torch.ones_like(out))
    assert dx.shape == (0, 48)
    torch.testing.assert_close(dw, torch.zeros(48))


def test_norm_forward_saves_rstd_and_runs_generated_backward(hub_pkg) -> None:
    fn, ins, ws, params = _cases(hub_pkg, torch.float32, 7)["rms_norm"]
    owner = torch.nn.Module()
    hub.run(owner, fn, ins, ws, **params).sum().backward()
    pair = hub_autograd.training_graphs(hub.compiled_ran(owner), (0, 1))
    assert pair.n_saved == 1  # rstd, one value per row
    assert pair.forward.backend == pair.backward.backend == "cpu"
    assert len(pair.backward.kernels) >= 1 and pair.backward.plan is not None
    saved = pair.forward.graph.outputs[1]
    assert saved.shape[-1] == 1


def test_frozen_weight_gets_no_gradient_and_none_cotangents_work(hub_pkg) -> None:
    norm = hub_pkg["layer_norm"]
    x = torch.randn(5, 16, requires_grad=True)
    w = torch.randn(16)
    total = torch.randn(5, 16)
    out, res = hub.run(None, norm.fused_add_rms_norm_math, [x, total], [w], eps=1e-6)
    (dx,) = torch.autograd.grad(out.sum(), [x])  # `res` gets no cotangent: zeros go in
    xr = x.detach().requires_grad_()
    (want,) = torch.autograd.grad(norm.fused_add_rms_norm_math(xr, total, w, eps=1e-6)[0].sum(), [xr])
    torch.testing.assert_close(dx, want)
    assert res.requires_grad


def test_create_graph_gives_first_order_gradients_and_refuses_a_second_derivative(hub_pkg) -> None:
    """Generated backward kernels have no derivative: with create_graph=True the first-order gradient is
    right, and differentiating it again raises an error naming the layer (not a silent zero)."""
    norm = hub_pkg["layer_norm"]
    x = torch.randn(6, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    y = hub.run(None, norm.rms_norm_math, [x], [w], eps=1e-6)
    (gx,) = torch.autograd.grad((y * y).sum(), [x], create_graph=True)
    xr = x.detach().requires_grad_()
    (want,) = torch.autograd.grad((norm.rms_norm_math(xr, w, eps=1e-6) ** 2).sum(), [xr])
    torch.testing.assert_close(gx, want)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match=r"rms_norm_math\(.*cannot be differentiated again"):
        torch.autograd.grad(gx.square().sum(), [x])
    (plain,) = torch.autograd.grad(hub.run(None, norm.rms_norm_math, [x], [w], eps=1e-6).sum(), [x])
    assert not plain.requires_grad  # without create_graph: a plain tensor, no extra node


def test_torch_compile_traces_forward_and_backward_without_graph_break(hub_pkg) -> None:
    norm = hub_pkg["layer_norm"]
    x = torch.randn(6, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)

    def step(x, w):
        return (norm.rms_norm(x * 2.0, w) ** 2).sum()

    step(x, w).backward()  # eager call builds the kernels for this signature
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    explain = torch._dynamo.explain(step)(x, w)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(x, w).backward()
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(w.grad, want[1])


def test_kernelized_demo_model_trains_with_eager_gradients() -> None:
    import torch.nn.functional as F

    import kernelize
    from kernelize import Mode
    from kernelize.models.llama_demo import LlamaDemo, LlamaDemoConfig

    eager = LlamaDemo(LlamaDemoConfig.tiny()).train()
    model = LlamaDemo(LlamaDemoConfig.tiny()).train()
    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=Mode.TRAINING)
    ids, labels = torch.randint(0, 128, (2, 9)), torch.randint(0, 128, (2, 9))
    for m in (eager, model):
        F.cross_entropy(m(ids).flatten(0, 1), labels.flatten()).backward()
    used = [c for c in kernelize.inspect(model).values() if c.uses_kernel]
    assert len(used) >= 4
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_rotary_backward_is_one_kernel(hub_pkg) -> None:
    """rotate-half's backward (pads of a negated slice) is planned as one kernel, not a copy plus an add."""
    fn, ins, ws, params = _cases(hub_pkg, torch.float32, 7)["rotary"]
    owner = torch.nn.Module()
    out = hub.run(owner, fn, ins, ws, **params)
    ct = torch.randn_like(out)
    got = torch.autograd.grad(out, ins[:1], ct)[0]
    x = ins[0].detach().requires_grad_()
    want = torch.autograd.grad(fn(x, *ins[1:], **params), [x], ct)[0]
    torch.testing.assert_close(got, want)
    pair = hub_autograd.training_graphs(hub.compiled_ran(owner), (0,))
    assert len(pair.backward.kernels) == 1, pair.backward.plan


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["rms_norm", "silu_and_mul"])
def test_gradients_are_adopted_by_autograd_without_a_copy(hub_pkg, name: str) -> None:
    """A gradient large enough for the output pool is a fresh tensor: AccumulateGrad adopts it as `.grad`
    (a pooled one it would copy, since the pool still references it)."""
    norm, act = hub_pkg["layer_norm"], hub_pkg["activation"]
    fn, params = {
        "rms_norm": (norm.rms_norm_math, {"eps": 1e-6}),
        "silu_and_mul": (act.silu_and_mul_math, {}),
    }[name]
    x = torch.randn(512, 1024, requires_grad=True)  # 2 MiB: above the pool's threshold
    ws = [torch.randn(1024, requires_grad=True)] if name == "rms_norm" else []
    for _ in range(2):  # the second call finds the first call's buffers in the pool
        out = hub.run(None, fn, [x], ws, **params)
        with _OpLog() as log:
            out.backward(torch.ones_like(out))
        assert not [op for op in log.ops if "copy" in op or "clone" in op], log.ops
        x.grad = None


def rotary_flat(x, cos, sin):
    """NeoX rotary over a flat hidden (heads a static split of it, as a model's q projection is)."""
    t, d = x.shape[0], cos.shape[-1]
    xh = x.view(t, -1, d)
    rot = torch.cat((-xh[..., d // 2 :], xh[..., : d // 2]), dim=-1)
    return (xh * cos[:, None, :] + rot * sin[:, None, :]).view(t, -1)


@pytest.mark.parametrize("heads", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 129])
def test_rotary_cos_sin_gradients_need_no_reduction_kernel(rows: int, dtype: torch.dtype, heads: int) -> None:
    """cos / sin gradients sum over the (static) heads: unrolled into adds of slices they are computed by
    one kernel with both stores, loading dy and x once (no library sum over a strided axis, no stored
    products; in bf16 both read recomputed casts of dy and x)."""
    from kernelize.autokernel.kernels import KernelKind

    ins = [torch.randn(rows, heads * 16, dtype=dtype), torch.randn(rows, 16, dtype=dtype)]
    ins = [t.requires_grad_() for t in (*ins, torch.randn(rows, 16, dtype=dtype))]
    owner = torch.nn.Module()
    out = hub.run(owner, rotary_flat, ins)
    ct = torch.randn_like(out)
    got = torch.autograd.grad(out, ins, ct)
    xs = [t.detach().requires_grad_() for t in ins]
    want = torch.autograd.grad(rotary_flat(*xs), xs, ct)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        # a cos / sin gradient sums `heads` products: its rounding error grows with them
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * heads**0.5)
    pair = hub_autograd.training_graphs(hub.compiled_ran(owner), (0, 1, 2))
    kernels = pair.backward.plan.kernels
    assert KernelKind.LIBRARY not in [k.kind for k in kernels] and len(kernels) == 2, pair.backward.plan
    (columns,) = [k for k in kernels if len(k.writes) == 2]
    assert {str(b.arg) for b in columns.reads} == {"grad_0", "x"}, pair.backward.plan
