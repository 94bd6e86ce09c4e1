"""Bundled hub layers under torch's own layer classes and inputs torch rejects: the kernelized forward gives
eager torch's result or raises eager torch's kind of error."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import kernelize
from kernelize import Mode, hub


class TorchRMSNorm(nn.RMSNorm):
    """torch's RMSNorm (a subclass, so marking it does not touch torch.nn for other tests)."""


class TorchLayerNorm(nn.LayerNorm):
    pass


class TorchSoftmax(nn.Softmax):
    pass


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return nn.functional.silu(x[..., :d]) * x[..., d:]


kernelize.replace_kernel_forward_from_hub(TorchRMSNorm, "RMSNorm")
kernelize.replace_kernel_forward_from_hub(TorchLayerNorm, "LayerNorm")
kernelize.replace_kernel_forward_from_hub(TorchSoftmax, "Softmax")
kernelize.replace_kernel_forward_from_hub(SiluAndMul, "SiluAndMul")


def _kernelized(*layers: nn.Module) -> nn.Sequential:
    model = nn.Sequential(*layers)
    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=Mode.INFERENCE)
    return model


def _hub_ran(model: nn.Module) -> None:
    for path, choice in kernelize.inspect(model).items():
        assert choice.fallback is None, (path, choice)
    assert all(hub.kernels_ran(m) is not None for m in model)


# -- torch's RMSNorm and LayerNorm -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(16,), (4, 8)])
def test_torch_rms_norm_with_default_eps(dtype, affine, shape) -> None:
    torch.manual_seed(0)
    layer = TorchRMSNorm(shape, eps=None, elementwise_affine=affine).to(dtype)
    if affine:
        nn.init.normal_(layer.weight)
    x = (torch.randn(3, 5, *shape) * 1e-3).to(dtype)  # tiny values: a wrong eps shows
    want = layer(x)
    model = _kernelized(layer)
    got = model(x)
    _hub_ran(model)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False), ("bias only", True)])
def test_torch_layer_norm_over_two_trailing_dims(dtype, affine, bias) -> None:
    torch.manual_seed(0)
    layer = TorchLayerNorm((4, 6), elementwise_affine=bool(affine), bias=bias).to(dtype)
    if affine:
        nn.init.normal_(layer.weight)
        if bias:
            nn.init.normal_(layer.bias)
    if affine == "bias only":  # F.layer_norm(x, shape, None, bias): the bias still applies
        layer.weight = None
    x = (torch.randn(2, 7, 4, 6) * 3 + 1).to(dtype)
    want = layer(x)
    model = _kernelized(layer)
    got = model(x)
    _hub_ran(model)
    tol = 1e-5 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        model(torch.randn(2, 6, 4).to(dtype))


# -- softmax with dim=None -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (2, 7), (3, 4, 5), (2, 3, 4, 5)])
def test_softmax_without_dim_follows_torchs_legacy_rule(shape) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = TorchSoftmax()(x)
        model = _kernelized(TorchSoftmax())
        got = model(x)
    _hub_ran(model)
    torch.testing.assert_close(got, want)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        model(x)


def test_softmax_of_a_scalar() -> None:
    model = _kernelized(TorchSoftmax(dim=0))
    assert model(torch.tensor(3.0)).item() == 1.0


# -- integer inputs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layer, x",
    [
        (SiluAndMul(), torch.tensor([[1, 2, 3, 4]])),
        (TorchSoftmax(dim=-1), torch.tensor([[1, 2, 3]])),
        (TorchRMSNorm(3), torch.tensor([[1, 2, 3]])),
        (TorchLayerNorm(3), torch.tensor([[1, 2, 3]], dtype=torch.int32)),
        (SiluAndMul(), torch.tensor([[True, False]])),
    ],
)
def test_integer_inputs_raise_like_torch(layer, x) -> None:
    with pytest.raises(RuntimeError):  # eager torch: NotImplementedError (a RuntimeError) or a dtype mismatch
        layer(x)
    model = _kernelized(layer)
    name = type(layer).__name__
    with pytest.raises(NotImplementedError, match=f'"{name}" not implemented for .*{x.dtype}'):
        model(x)


def test_functional_api_rejects_integers(hub_pkg) -> None:
    x = torch.tensor([[1, 2, 3, 4]])
    for fn in (hub_pkg["activation"].silu_and_mul, hub_pkg["softmax"].softmax):
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
            fn(x)
