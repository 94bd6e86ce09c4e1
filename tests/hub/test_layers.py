"""Every bundled hub layer against its own plain-torch math (and the eager layer it replaces), on the CPU
backend: awkward row counts (1, 7 and 3x7), f32 and bf16, several outputs, masks of both kinds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from kernelize import hub

H = 48  # hidden size: not a power of two


def _attrs(**kw: Any) -> nn.Module:
    """A replaced module holding only the state the kernel layer reads."""
    m = nn.Module()
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            m.register_parameter(k, nn.Parameter(v))
        else:
            setattr(m, k, v)
    return m


@dataclass
class Case:
    repo: str
    layer: str
    module: Callable[[torch.dtype], nn.Module]
    inputs: Callable[[tuple[int, ...], torch.dtype], list[torch.Tensor]]
    math: str  # the math function in the repo's layers module
    params: Callable[[nn.Module], dict] = field(default=lambda m: {})
    weights: Callable[[nn.Module], list[torch.Tensor]] = field(default=lambda m: [])


def _w(dtype: torch.dtype, n: int = H) -> torch.Tensor:
    return torch.randn(n).to(dtype)


def _x(lead: tuple[int, ...], dtype: torch.dtype, n: int = H) -> list[torch.Tensor]:
    return [torch.randn(*lead, n).to(dtype)]


def _rot(lead: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    d = 16
    q, k = torch.randn(*lead, 4, d).to(dtype), torch.randn(*lead, 2, d).to(dtype)  # GQA: 4 q heads, 2 k heads
    ang = torch.randn(*lead, 1, d // 2)
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    return [q, k, cos, sin]


def _rot_pairs(lead: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    q, k, cos, sin = _rot(lead, dtype)
    half = cos.shape[-1] // 2
    return [q, k, cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)]


def _scores(lead: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    s = torch.randn(*lead, 3, 24).to(dtype) * 4
    mask = torch.zeros(3, 24).masked_fill(torch.rand(3, 24) < 0.3, float("-inf"))
    mask[:, 0] = 0.0  # no fully masked row
    return [s, mask]


def _scores_bool(lead: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    s, mask = _scores(lead, dtype)
    return [s, mask == 0]


CASES = {
    "RMSNorm": Case(
        "layer_norm",
        "RMSNorm",
        lambda dt: _attrs(weight=_w(dt), variance_epsilon=1e-6),
        _x,
        "rms_norm_math",
        lambda m: {"eps": 1e-6},
        lambda m: [m.weight],
    ),
    "GemmaRMSNorm": Case(
        "layer_norm",
        "GemmaRMSNorm",
        lambda dt: _attrs(weight=_w(dt), eps=1e-5),
        _x,
        "gemma_rms_norm_math",
        lambda m: {"eps": 1e-5},
        lambda m: [m.weight],
    ),
    "LayerNorm": Case(
        "layer_norm",
        "LayerNorm",
        lambda dt: _attrs(weight=_w(dt), bias=_w(dt), eps=1e-5),
        _x,
        "layer_norm_math",
        lambda m: {"eps": 1e-5},
        lambda m: [m.weight, m.bias],
    ),
    "FusedAddRMSNorm": Case(
        "layer_norm",
        "FusedAddRMSNorm",
        lambda dt: _attrs(weight=_w(dt), eps=1e-6),
        lambda lead, dt: _x(lead, dt) + _x(lead, dt),
        "fused_add_rms_norm_math",
        lambda m: {"eps": 1e-6},
        lambda m: [m.weight],
    ),
    "GatedRMSNorm": Case(
        "layer_norm",
        "GatedRMSNorm",
        lambda dt: _attrs(weight=_w(dt), variance_epsilon=1e-6, activation="silu"),
        lambda lead, dt: _x(lead, dt) + _x(lead, dt),
        "gated_rms_norm_math",
        lambda m: {"eps": 1e-6, "act": "silu"},
        lambda m: [m.weight],
    ),
    "SiluAndMul": Case("activation", "SiluAndMul", lambda dt: nn.Module(), _x, "silu_and_mul_math"),
    "GeluAndMul": Case("activation", "GeluAndMul", lambda dt: nn.Module(), _x, "gelu_and_mul_math"),
    "GeluTanhAndMul": Case(
        "activation", "GeluTanhAndMul", lambda dt: nn.Module(), _x, "gelu_tanh_and_mul_math"
    ),
    "FastGELU": Case("activation", "FastGELU", lambda dt: nn.Module(), _x, "fast_gelu_math"),
    "QuickGELU": Case("activation", "QuickGELU", lambda dt: nn.Module(), _x, "quick_gelu_math"),
    "NewGELU": Case("activation", "NewGELU", lambda dt: nn.Module(), _x, "new_gelu_math"),
    "RotaryNeox": Case(
        "rotary", "RotaryEmbedding", lambda dt: _attrs(is_neox_style=True), _rot, "rotary_neox_math"
    ),
    "RotaryInterleaved": Case(
        "rotary",
        "RotaryEmbedding",
        lambda dt: _attrs(is_neox_style=False),
        _rot_pairs,
        "rotary_interleaved_math",
    ),
    "Softmax": Case(
        "softmax",
        "Softmax",
        lambda dt: nn.Softmax(dim=-1),
        lambda lead, dt: _x(lead, dt, 40),
        "softmax_math",
        lambda m: {"dim": -1},
    ),
    "ScaledMaskedSoftmax": Case(
        "softmax",
        "ScaledMaskedSoftmax",
        lambda dt: _attrs(scale=0.125),
        _scores,
        "scaled_masked_softmax_math",
        lambda m: {"scale": 0.125},
    ),
    "ScaledBoolMaskedSoftmax": Case(
        "softmax",
        "ScaledMaskedSoftmax",
        lambda dt: _attrs(scale=0.125),
        _scores_bool,
        "scaled_bool_masked_softmax_math",
        lambda m: {"scale": 0.125},
    ),
    "Linear": Case(
        "linear",
        "Linear",
        lambda dt: nn.Linear(H, 40).to(dt),
        _x,
        "linear_math",
        weights=lambda m: [m.weight, m.bias],
    ),
    "LinearReLU": Case(
        "linear",
        "LinearReLU",
        lambda dt: nn.Linear(H, 40).to(dt),
        _x,
        "linear_relu_math",
        weights=lambda m: [m.weight, m.bias],
    ),
}
# (leading dims, dtype): one row, 7 rows, a 3x7 batch; bf16 on the batch
SHAPES = [((1,), torch.float32), ((7,), torch.float32), ((3, 7), torch.float32), ((3, 7), torch.bfloat16)]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


@pytest.mark.parametrize(
    "lead,dtype", SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v)[6:]
)
@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_its_math(hub_pkg, name: str, lead: tuple[int, ...], dtype: torch.dtype) -> None:
    case = CASES[name]
    torch.manual_seed(hash(name) % 1000)
    layers = hub_pkg[case.repo]
    module = case.module(dtype)
    inputs = case.inputs(lead, dtype)
    math_fn = getattr(layers, case.math)
    with torch.no_grad():
        got = _as_tuple(getattr(layers, case.layer).forward(module, *inputs))
        want = _as_tuple(math_fn(*inputs, *case.weights(module), **case.params(module)))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), **TOL[dtype])
    record = hub.kernels_ran(module)
    assert record is not None and record.backend == "cpu" and record.kernels, record


def test_non_contiguous_input(hub_pkg) -> None:
    m = _attrs(weight=torch.randn(H), variance_epsilon=1e-6)
    x = torch.randn(H, 10).t()  # (10, H), column-major
    with torch.no_grad():
        got = hub_pkg["layer_norm"].RMSNorm.forward(m, x)
    torch.testing.assert_close(got, hub_pkg["layer_norm"].rms_norm_math(x, m.weight, eps=1e-6))


def test_edge_values_softmax(hub_pkg) -> None:
    x = torch.tensor([[0.0, -0.0, 1e4, -1e4], [1.0, 2.0, float("-inf"), 3.0]])
    with torch.no_grad():
        got = hub_pkg["softmax"].Softmax.forward(nn.Softmax(-1), x)
    torch.testing.assert_close(got, torch.softmax(x, -1))


def test_matches_the_eager_layers_they_replace(hub_pkg) -> None:
    """The kernel layers against the modules they stand in for (not just against their own math)."""
    from kernelize.models import llama_demo as demo

    torch.manual_seed(0)
    x = torch.randn(3, 5, H)
    norm = demo.RMSNorm(H, 1e-6)
    nn.init.normal_(norm.weight)
    ln = nn.LayerNorm(H)
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    sm = demo.ScaledMaskedSoftmax(0.3)
    mask = torch.full((5, 5), float("-inf")).triu(1)
    scores = torch.randn(3, 2, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(hub_pkg["layer_norm"].RMSNorm.forward(norm, x), norm(x))
        torch.testing.assert_close(
            hub_pkg["layer_norm"].LayerNorm.forward(ln, x), ln(x), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            hub_pkg["softmax"].ScaledMaskedSoftmax.forward(sm, scores, mask), sm(scores, mask)
        )
        a, b = hub_pkg["layer_norm"].FusedAddRMSNorm.forward(demo.ResidualRMSNorm(H), x, x * 2)
        ea, eb = demo.ResidualRMSNorm(H)(x, x * 2)
        torch.testing.assert_close((a, b), (ea, eb))
        gu = torch.randn(7, 2 * H)
        torch.testing.assert_close(
            hub_pkg["activation"].SiluAndMul.forward(demo.SiluAndMul(), gu), demo.SiluAndMul()(gu)
        )


def test_one_kernel_serves_every_length(hub_pkg) -> None:
    """Leading dims are symbolic: new batch/sequence lengths reuse the compiled graph."""
    m = _attrs(weight=torch.randn(H), variance_epsilon=1e-6)
    with torch.no_grad():
        hub_pkg["layer_norm"].RMSNorm.forward(m, torch.randn(2, 3, H))
        before = hub.compiled_count()
        for b, s in [(2, 9), (5, 3), (4, 17)]:
            x = torch.randn(b, s, H)
            torch.testing.assert_close(
                hub_pkg["layer_norm"].RMSNorm.forward(m, x),
                hub_pkg["layer_norm"].rms_norm_math(x, m.weight, eps=1e-6),
            )
    assert hub.compiled_count() == before


def test_gated_mlp_matches_llama_mlp(hub_pkg) -> None:
    """GatedMLP (for transformers' LlamaMLP and relatives) keeps the projections and fuses act * up."""

    class Cfg:
        hidden_act = "silu"

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = Cfg()
            self.gate_proj, self.up_proj = nn.Linear(H, 64, bias=False), nn.Linear(H, 64, bias=False)
            self.down_proj = nn.Linear(64, H, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    mlp = MLP()
    x = torch.randn(2, 7, H)
    with torch.no_grad():
        torch.testing.assert_close(
            hub_pkg["activation"].GatedMLP.forward(mlp, x), mlp(x), atol=1e-5, rtol=1e-5
        )
    assert hub.kernels_ran(mlp) is not None
    mlp.config.hidden_act = "relu"  # no gated kernel for it: the module's own act_fn runs
    mlp.act_fn = nn.ReLU()
    with torch.no_grad():
        torch.testing.assert_close(hub_pkg["activation"].GatedMLP.forward(mlp, x), mlp(x))


def test_scaled_softmax_without_mask(hub_pkg) -> None:
    m = _attrs(scale=1 / math.sqrt(8))
    s = torch.randn(2, 3, 5, 9)
    with torch.no_grad():
        got = hub_pkg["softmax"].ScaledMaskedSoftmax.forward(m, s)
    torch.testing.assert_close(got, torch.softmax(s * m.scale, -1))
