"""kernelize.ir.trace on the layer spellings people write, compared with eager torch on random inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernelize import ir
from kernelize.ir import Op, OptimizerSettings, Sym, UnsupportedOpError

aten = torch.ops.aten
CHECKED = OptimizerSettings(verify=True)


def run_both(fn, *inputs, tol=1e-5, others=(), params=None, **kw):
    """Trace ``fn``; check the traced and the optimized graph against eager on ``inputs`` and ``others``."""
    g = ir.trace(fn, *inputs, **kw)
    ir.verify(g)
    opt = ir.optimize(g, CHECKED)
    for args in (inputs, *others):
        want = torch.utils._pytree.tree_leaves(fn(*args))
        feed = list(args) + list(params or [])
        for graph in (g, opt):
            got = ir.evaluate(graph, feed)
            assert len(got) == len(want)
            for w, o in zip(want, got):
                assert o.dtype == w.dtype and o.shape == w.shape
                torch.testing.assert_close(o, w, atol=tol, rtol=tol)
    return g, opt


def counts(g) -> dict[str, int]:
    return dict(ir.op_counts(g))


# -- RMSNorm ------------------------------------------------------------------------------------------------
class ManualRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaRMSNorm(nn.Module):
    """Hugging Face's spelling: statistics in f32, weight applied after casting back."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class DivSqrtRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return self.w * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize(
    "make",
    [
        lambda: ManualRMSNorm(16),
        lambda: LlamaRMSNorm(16),
        lambda: DivSqrtRMSNorm(16),
        lambda: nn.RMSNorm(16, eps=1e-6),
        lambda: (lambda w: lambda x: F.rms_norm(x, (16,), w, 1e-6))(torch.randn(16)),
    ],
    ids=["manual", "llama", "div_sqrt", "nn.RMSNorm", "F.rms_norm"],
)
def test_rmsnorm_spellings_become_one_rmsnorm(make):
    layer = make()
    x = torch.randn(2, 5, 16)
    g, opt = run_both(layer, x, dynamic_dims={0: "batch", 1: "seq"}, others=[(torch.randn(3, 7, 16),)])
    assert counts(opt) == {"input": 1, "const": 1, "rmsnorm": 1}
    (norm,) = [n for n in opt.nodes if n.op is Op.RMSNORM]
    assert norm.arg.has_weight  # the weight was absorbed
    assert norm.shape == (Sym.of("batch"), Sym.of("seq"), 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_llama_rmsnorm_in_half_is_one_half_rmsnorm(dtype):
    layer = LlamaRMSNorm(32).to(dtype)
    x = torch.randn(4, 32).to(dtype)
    _, opt = run_both(layer, x, tol=2e-2)
    assert counts(opt) == {"input": 1, "const": 1, "rmsnorm": 1}
    assert [n.dtype for n in opt.nodes if n.op is Op.RMSNORM] == [ir.DType.from_torch(dtype)]


def test_rmsnorm_without_weight():
    _, opt = run_both(lambda x: x * torch.rsqrt(torch.mean(x**2, -1, keepdim=True) + 1e-5), torch.randn(3, 8))
    assert counts(opt) == {"input": 1, "rmsnorm": 1}


# -- LayerNorm ----------------------------------------------------------------------------------------------
def _manual_ln_var(w, b):
    def ln(x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * w + b

    return ln


def _manual_ln_pow(w, b):
    def ln(x):
        d = x - x.mean(dim=-1, keepdim=True)
        return w * (d * torch.rsqrt((d**2).mean(dim=-1, keepdim=True) + 1e-5)) + b

    return ln


@pytest.mark.parametrize(
    "make,kw",
    [
        (lambda: nn.LayerNorm(16), {}),
        (lambda: nn.LayerNorm(16), {"decompositions": [aten.native_layer_norm.default]}),
        (lambda: _manual_ln_var(torch.randn(16), torch.randn(16)), {}),
        (lambda: _manual_ln_pow(torch.randn(16), torch.randn(16)), {}),
    ],
    ids=["nn.LayerNorm", "torch_decomposition", "manual_var", "manual_pow"],
)
def test_layernorm_spellings_become_one_layernorm(make, kw):
    layer = make()
    if isinstance(layer, nn.LayerNorm):
        nn.init.normal_(layer.weight)
        nn.init.normal_(layer.bias)
    _, opt = run_both(
        layer, torch.randn(2, 5, 16), dynamic_dims={0: "b"}, others=[(torch.randn(4, 5, 16),)], **kw
    )
    assert counts(opt) == {"input": 1, "const": 2, "layernorm": 1}
    (norm,) = [n for n in opt.nodes if n.op is Op.LAYERNORM]
    assert (norm.arg.has_weight, norm.arg.has_bias) == (True, True)


def test_layernorm_over_two_trailing_dims():
    layer = nn.LayerNorm((4, 8))
    nn.init.normal_(layer.weight)
    _, opt = run_both(layer, torch.randn(3, 4, 8))
    assert counts(opt)["layernorm"] == 1


# -- activations --------------------------------------------------------------------------------------------
def _gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def _gelu_tanh_cube(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * (0.5 + 0.5 * torch.tanh(inner))


@pytest.mark.parametrize(
    "fn,kw,approx",
    [
        (nn.GELU(), {}, "none"),
        (nn.GELU("tanh"), {}, "tanh"),
        (nn.GELU(), {"decompositions": [aten.gelu.default]}, "none"),
        (nn.GELU("tanh"), {"decompositions": [aten.gelu.default]}, "tanh"),
        (_gelu_erf, {}, "none"),
        (_gelu_tanh, {}, "tanh"),
        (_gelu_tanh_cube, {}, "tanh"),
    ],
    ids=["erf", "tanh", "erf_decomposed", "tanh_decomposed", "manual_erf", "manual_tanh", "manual_tanh_cube"],
)
def test_gelu_spellings_become_one_gelu(fn, kw, approx):
    _, opt = run_both(fn, torch.randn(4, 32) * 3, **kw)
    assert counts(opt) == {"input": 1, "gelu": 1}
    assert [n.arg for n in opt.nodes if n.op is Op.GELU] == [approx]


@pytest.mark.parametrize(
    "fn", [F.silu, nn.SiLU(), lambda x: x * torch.sigmoid(x)], ids=["F.silu", "nn.SiLU", "x*sigmoid"]
)
def test_silu_stays_elementwise(fn):
    _, opt = run_both(fn, torch.randn(4, 8))
    assert counts(opt) == {"input": 1, "sigmoid": 1, "mul": 1}


def test_swiglu_and_geglu_splits():
    def swiglu(x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def geglu(x):
        a, b = x.chunk(2, dim=-1)
        return F.gelu(a) * b

    x = torch.randn(2, 3, 16)
    _, opt = run_both(swiglu, x, dynamic_dims={0: "b", 1: "s"}, others=[(torch.randn(5, 2, 16),)])
    assert counts(opt) == {"input": 1, "slice": 2, "sigmoid": 1, "mul": 2}
    _, opt = run_both(geglu, x, dynamic_dims={0: "b", 1: "s"})
    assert counts(opt) == {"input": 1, "slice": 2, "gelu": 1, "mul": 1}


def test_relu_family_becomes_clamps():
    _, opt = run_both(lambda x: F.relu6(F.relu(x) * 3), torch.randn(4, 8))
    assert counts(opt) == {"input": 1, "const": 1, "broadcast": 1, "mul": 1, "clamp": 2}


# -- softmax ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn,kw,axis",
    [
        (lambda x: torch.softmax(x, -1), {}, 2),
        (lambda x: torch.softmax(x, dim=1), {"decompositions": [aten._softmax.default]}, 1),
        (lambda x: F.softmax(x, -1), {"decompositions": [aten._softmax.default]}, 2),
        (
            lambda x: (
                (x - x.amax(-1, keepdim=True)).exp()
                / (x - x.amax(-1, keepdim=True)).exp().sum(-1, keepdim=True)
            ),
            {},
            2,
        ),
        (lambda x: torch.exp(x) / torch.exp(x).sum(dim=0, keepdim=True), {}, 0),
    ],
    ids=["torch", "decomposed_dim1", "F_decomposed", "manual_max", "manual_dim0"],
)
def test_softmax_spellings_become_one_softmax(fn, kw, axis):
    _, opt = run_both(fn, torch.randn(3, 4, 8), **kw)
    assert counts(opt) == {"input": 1, "softmax": 1}
    assert [n.arg for n in opt.nodes if n.op is Op.SOFTMAX] == [axis]


def test_softmax_of_half_through_f32_is_half_softmax():
    _, opt = run_both(
        lambda x: torch.softmax(x, -1),
        torch.randn(4, 8).half(),
        tol=1e-3,
        decompositions=[aten._softmax.default],
    )
    assert counts(opt) == {"input": 1, "softmax": 1}
    assert opt.outputs[0].dtype is ir.DType.F16


@pytest.mark.parametrize(
    "fn,kw",
    [
        (lambda x: torch.log_softmax(x, -1), {"decompositions": [aten._log_softmax.default]}),
        (lambda x: torch.log(torch.softmax(x, -1)), {}),
        (lambda x: x - torch.logsumexp(x, -1, keepdim=True), {}),
    ],
    ids=["decomposed", "log_of_softmax", "logsumexp"],
)
def test_log_softmax_spellings(fn, kw):
    _, opt = run_both(fn, torch.randn(3, 8), **kw)
    assert counts(opt) == {"input": 1, "log_softmax": 1}


# -- composite layers ---------------------------------------------------------------------------------------
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return (x * cos) + (rotate_half(x) * sin)


def test_rotary_embedding():
    x, cos, sin = torch.randn(2, 4, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    g, _ = run_both(
        apply_rotary,
        x,
        cos,
        sin,
        dynamic_dims=[{0: "batch"}, None, None],
        others=[(torch.randn(3, 4, 5, 8), cos, sin)],
    )
    assert {"neg", "concat", "slice"} <= set(counts(g))


@pytest.mark.parametrize("act,op", [(nn.ReLU(), "clamp"), (nn.GELU(), "gelu"), (nn.Tanh(), "tanh")])
def test_linear_with_bias_activation_and_eval_dropout(act, op):
    model = nn.Sequential(nn.Linear(16, 32), act, nn.Dropout(0.5), nn.Linear(32, 8)).eval()
    _, opt = run_both(
        model, torch.randn(2, 3, 16), dynamic_dims={0: "b", 1: "s"}, others=[(torch.randn(1, 9, 16),)]
    )
    c = counts(opt)
    assert c["matmul"] == 2 and c[op] == 1 and "permute" not in c  # weight transposes were folded


class LlamaMLP(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_residual_mlp_with_params_as_inputs():
    mlp = LlamaMLP()
    x = torch.randn(2, 3, 16)
    g = ir.trace(mlp, x, params="input", dynamic_dims=[{0: "b", 1: "s"}])
    assert [i.arg for i in g.inputs] == ["x", "gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert g.inputs[0].shape == (Sym.of("b"), Sym.of("s"), 16)
    other = {k: torch.randn_like(v) for k, v in mlp.state_dict().items()}  # one graph serves any weights
    want = torch.func.functional_call(mlp, other, (x,))
    got = ir.evaluate(ir.optimize(g, CHECKED), {"x": x, **other})[0]
    torch.testing.assert_close(got, want)


def test_conv_batchnorm_relu_folds_into_conv():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    nn.init.normal_(model[1].weight)
    _, opt = run_both(model, torch.randn(2, 3, 8, 8), tol=1e-4, dynamic_dims={0: "n"})
    assert counts(opt) == {"input": 1, "const": 2, "conv": 1, "broadcast": 1, "add": 1, "clamp": 1}


def test_causal_attention():
    def attn(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
        return torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v

    q, k, v = (torch.randn(2, 5, 8) for _ in range(3))
    _, opt = run_both(attn, q, k, v, dynamic_dims={0: "b"})
    assert counts(opt)["softmax"] == 1 and counts(opt)["matmul"] == 2


def test_tuple_outputs_become_graph_outputs():
    g, _ = run_both(lambda x: (x.exp(), x.chunk(2, -1)), torch.randn(3, 4))
    assert len(g.outputs) == 3


# -- dynamic dims -------------------------------------------------------------------------------------------
def test_dynamic_dims_become_named_syms_and_products():
    g = ir.trace(lambda x: x.flatten(0, 1) * 2, torch.randn(2, 3, 4), dynamic_dims={0: "batch", 1: "seq"})
    b, s = Sym.of("batch"), Sym.of("seq")
    assert g.inputs[0].shape == (b, s, 4)
    assert g.outputs[0].shape == (b * s, 4)
    out = ir.evaluate(g, [torch.ones(5, 7, 4)])[0]
    assert out.shape == (35, 4)


def test_sizes_read_in_code_stay_symbolic():
    def fn(x):
        return x.view(x.size(0), -1).sum(-1, keepdim=True) * x.shape[-1]

    g, _ = run_both(fn, torch.randn(2, 3, 4), dynamic_dims={0: "batch"}, others=[(torch.randn(6, 3, 4),)])
    assert g.outputs[0].shape == (Sym.of("batch"), 1)


def test_dynamic_dims_per_input_and_negative_axes():
    g = ir.trace(
        lambda x, y: x + y.sum(), torch.randn(2, 3), torch.randn(4, 6), dynamic_dims=[{-1: "n"}, None]
    )
    assert g.inputs[0].shape == (2, Sym.of("n"))
    assert g.inputs[1].shape == (4, 6)


def test_dims_torch_proves_equal_share_a_name(caplog):
    g = ir.trace(
        lambda x, y: x + y, torch.randn(2, 3), torch.randn(2, 3), dynamic_dims=[{0: "batch"}, {0: "rows"}]
    )
    assert g.inputs[1].shape == (Sym.of("batch"), 3)
    assert "dynamic dim 'rows' of input 'y' must equal batch" in caplog.text


@pytest.mark.parametrize(
    "fn,x,dims,match",
    [
        (lambda x: x * 2, torch.randn(1, 4), {0: "batch"}, "example size 1"),
        (lambda x: x * 2, torch.randn(3, 4), {0: "not a name"}, "identifier"),
        (lambda x: x * 2, torch.randn(3, 4), [{0: "a"}, None], "2 entries for 1 inputs"),
        (lambda x: x.view(3, 2, 2), torch.randn(3, 4), {0: "batch"}, "specialised to 3"),
    ],
)
def test_dynamic_dim_errors(fn, x, dims, match):
    with pytest.raises(ValueError, match=match):
        ir.trace(fn, x, dynamic_dims=dims)


# -- errors -------------------------------------------------------------------------------------------------
def _uses_cumsum(x):
    y = x * 2
    return torch.cumsum(y, dim=0)  # the line the error must name


def test_unsupported_op_names_op_and_source_line():
    with pytest.raises(UnsupportedOpError) as err:
        ir.trace(_uses_cumsum, torch.randn(4))
    msg = str(err.value)
    line = _uses_cumsum.__code__.co_firstlineno + 2
    assert msg.startswith("aten.cumsum.default (from ")
    assert f"test_torch_frontend.py:{line} in _uses_cumsum: return torch.cumsum(y, dim=0)" in msg
    assert "not supported by kernelize.ir.trace; supported:" in msg and "softmax" in msg


def test_unsupported_op_inside_a_module_names_forward():
    class Sorter(nn.Module):
        def forward(self, x):
            return torch.sort(x).values

    with pytest.raises(UnsupportedOpError, match=r"aten\.sort.*in forward: return torch.sort\(x\)\.values"):
        ir.trace(Sorter(), torch.randn(4))


def test_dropout_in_training_mode_is_refused():
    with pytest.raises(UnsupportedOpError, match="training mode.*eval"):
        ir.trace(nn.Dropout(0.5).train(), torch.randn(4, 4))


def test_inplace_ops():
    def fresh(x):
        y = x * 2
        y += 1
        y.mul_(3)
        return y

    run_both(fresh, torch.randn(4))

    def on_input(x):
        x.add_(1)
        return x

    with pytest.raises(UnsupportedOpError, match="mutates an input"):
        ir.trace(on_input, torch.randn(4))


def test_bad_arguments():
    with pytest.raises(ValueError, match="params must be"):
        ir.trace(nn.Linear(2, 2), torch.randn(1, 2), params="weights")
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ir.trace(lambda x, n: x * n, torch.randn(2), 3)


def test_type_promotion_matches_torch():
    def mixed(i, h, f):
        return (i / 2, i * 1.5, i // 2, (i > 1) & (h > 0), h * f, i.sum(), (h + 1).float().mean())

    i = torch.randint(-5, 5, (4, 3), dtype=torch.int32)
    run_both(mixed, i, torch.randn(4, 3).half(), torch.randn(4, 3), tol=1e-3)


def test_params_const_and_input_give_the_same_values():
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    const_g = ir.trace(lin, x)
    input_g = ir.trace(lin, x, params="input")
    assert [i.arg for i in const_g.inputs] == ["input"]
    assert [i.arg for i in input_g.inputs] == ["input", "weight", "bias"]
    a = ir.evaluate(const_g, [x])[0]
    b = ir.evaluate(input_g, [x, lin.weight.detach(), lin.bias.detach()])[0]
    torch.testing.assert_close(a, b)
