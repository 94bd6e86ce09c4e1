"""The gated RMSNorm layer (`norm(x) * act(gate)`) against its plain-torch math and against transformers'
own `Qwen3NextRMSNormGated`, on the CPU backend: odd hidden sizes, one and many rows, f32 and bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernelize import hub

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SHAPES = [(1, 1), (7, 33), (3, 5, 97), (2, 4097)]  # (..., hidden): odd widths, one row, a row over 4096


def _module(hidden: int, dtype: torch.dtype, act: str = "silu") -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.randn(hidden).to(dtype))
    m.variance_epsilon, m.activation = 1e-6, act
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_gated_rms_norm_matches_its_math(hub_pkg, shape, dtype: torch.dtype, act: str) -> None:
    torch.manual_seed(0)
    layers = hub_pkg["layer_norm"]
    module = _module(shape[-1], dtype, act)
    x, gate = 3 * torch.randn(shape).to(dtype) + 1, torch.randn(shape).to(dtype)
    with torch.no_grad():
        got = layers.GatedRMSNorm.forward(module, x, gate)
        want = layers.gated_rms_norm_math(x, gate, module.weight, eps=1e-6, act=act)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert hub.kernels_ran(module).backend == "cpu"
    assert len(hub.kernels_ran(module).kernels) == 1  # one row kernel: norm, weight, gate in one pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gated_rms_norm_matches_transformers_module(hub_pkg, dtype: torch.dtype) -> None:
    """The module it replaces (weight `w`, not `1 + w`; normalised in f32, cast back, weighted, gated)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    torch.manual_seed(1)
    norm = qwen3_next.Qwen3NextRMSNormGated(37, eps=1e-5).to(dtype)
    nn.init.normal_(norm.weight, 1.0, 0.3)
    x, gate = torch.randn(4, 6, 37).to(dtype), torch.randn(4, 6, 37).to(dtype)
    with torch.no_grad():
        got = hub_pkg["layer_norm"].GatedRMSNorm.forward(norm, x, gate)
        want = norm(x, gate)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_without_a_gate_it_is_rms_norm(hub_pkg) -> None:
    module = _module(19, torch.float32)
    x = torch.randn(3, 19)
    with torch.no_grad():
        got = hub_pkg["layer_norm"].GatedRMSNorm.forward(module, x)
    torch.testing.assert_close(got, hub_pkg["layer_norm"].rms_norm_math(x, module.weight, eps=1e-6))


def test_unknown_activation_or_gate_shape_is_a_clear_error(hub_pkg) -> None:
    layer = hub_pkg["layer_norm"].GatedRMSNorm
    with pytest.raises(ValueError, match="gate activation 'tanh'"):
        layer.forward(_module(8, torch.float32, "tanh"), torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(ValueError, match="the gate's shape"):
        layer.forward(_module(8, torch.float32), torch.randn(2, 8), torch.randn(1, 8))
