"""Gradients of the hub layers (all claim `has_backward`): `gradcheck` in f64 on the reference backend, and
gradients on the CPU backend against autograd through the plain-torch math."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernelize import hub

H = 12


def _module(**kw) -> nn.Module:
    m = nn.Module()
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            m.register_parameter(k, nn.Parameter(v))
        else:
            setattr(m, k, v)
    return m


def _cases(dtype: torch.dtype):
    """(repo, layer, module, inputs) with every input and parameter requiring grad."""

    def t(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    mask = torch.zeros(4, 6, dtype=dtype)
    mask[:, 3:] = float("-inf")
    return {
        "RMSNorm": ("layer_norm", "RMSNorm", _module(weight=t(H), variance_epsilon=1e-6), [t(3, 4, H)]),
        "GemmaRMSNorm": ("layer_norm", "GemmaRMSNorm", _module(weight=t(H), eps=1e-6), [t(5, H)]),
        "LayerNorm": ("layer_norm", "LayerNorm", _module(weight=t(H), bias=t(H), eps=1e-5), [t(5, H)]),
        "FusedAddRMSNorm": (
            "layer_norm",
            "FusedAddRMSNorm",
            _module(weight=t(H), eps=1e-6),
            [t(5, H), t(5, H)],
        ),
        "GatedRMSNorm": (
            "layer_norm",
            "GatedRMSNorm",
            _module(weight=t(H), variance_epsilon=1e-6, activation="silu"),
            [t(5, H), t(5, H)],
        ),
        "SiluAndMul": ("activation", "SiluAndMul", nn.Module(), [t(5, 2 * H)]),
        "GeluTanhAndMul": ("activation", "GeluTanhAndMul", nn.Module(), [t(5, 2 * H)]),
        "NewGELU": ("activation", "NewGELU", nn.Module(), [t(5, H)]),
        "Rotary": (
            "rotary",
            "RotaryEmbedding",
            _module(is_neox_style=True),
            [t(2, 3, 4, 8), t(2, 3, 4, 8), t(3, 1, 8), t(3, 1, 8)],
        ),
        "ScaledMaskedSoftmax": ("softmax", "ScaledMaskedSoftmax", _module(scale=0.5), [t(2, 4, 6), mask]),
        "Linear": ("linear", "Linear", _module(weight=t(7, H), bias=t(7)), [t(5, H)]),
        "LinearReLU": ("linear", "LinearReLU", _module(weight=t(7, H), bias=t(7)), [t(5, H)]),
    }


def _params(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters())


@pytest.mark.parametrize("name", list(_cases(torch.float64)))
def test_gradcheck_reference_f64(hub_pkg, name: str) -> None:
    torch.manual_seed(1)
    repo, layer, module, inputs = _cases(torch.float64)[name]
    cls = getattr(hub_pkg[repo], layer)
    assert cls.has_backward
    names, params = zip(*module.named_parameters()) if _params(module) else ((), ())
    leaves = [x for x in inputs if x.requires_grad]

    def fn(*args):
        xs, ps = args[: len(leaves)], args[len(leaves) :]
        for k, v in zip(names, ps):  # the kernel layer reads state from the module: put the probes there
            module._parameters[k] = v
        it = iter(xs)
        call = [next(it) if x.requires_grad else x for x in inputs]
        return cls.forward(module, *call)

    with hub.use_backend("reference"):
        assert torch.autograd.gradcheck(fn, (*leaves, *params), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", list(_cases(torch.float32)))
def test_cpu_backend_gradients_match_math(hub_pkg, name: str) -> None:
    torch.manual_seed(2)
    repo, layer, module, inputs = _cases(torch.float32)[name]
    layers = hub_pkg[repo]
    cls = getattr(layers, layer)
    leaves = [x for x in inputs if x.requires_grad] + _params(module)

    out = cls.forward(module, *inputs)
    outs = out if isinstance(out, tuple) else (out,)
    seeds = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, leaves, seeds)
    if layer == "Linear":  # f32 on the CPU: oneDNN / MKL products (kernelize.hub.train_linear)
        assert type(outs[0].grad_fn).__name__ == "_LinearBackward"
    else:
        assert hub.kernels_ran(module).backend == "cpu"

    # the same layer forward with the eager math in place of the kernels (`reference`: the graph run by torch)
    with hub.use_backend("reference"):
        ref_out = cls.forward(module, *inputs)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    want = torch.autograd.grad(ref_outs, leaves, seeds)
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", ["additive", "bool", None])
def test_attention_gradients_through_torch_sdpa(hub_pkg, mask_kind) -> None:
    """The attention kernel has no backward: calls that need gradients run torch's SDPA inside the layer,
    whose gradients equal autograd through the layer's plain math (`attention_math`)."""
    layers = hub_pkg["attention"]
    module = _module(scale=0.35)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64, requires_grad=True) for n in (4, 5, 5))
    mask = {
        "additive": torch.zeros(4, 5, dtype=torch.float64).masked_fill(torch.ones(4, 5).triu(2).bool(), -1e9),
        "bool": torch.ones(4, 5).tril(1).bool(),
        None: None,
    }[mask_kind]
    assert torch.autograd.gradcheck(
        lambda *a: layers.ScaledDotProductAttention.forward(module, *a, mask), (q, k, v)
    )
    out = layers.ScaledDotProductAttention.forward(module, q, k, v, mask)
    want = layers.attention_math(q, k, v, mask, scale=0.35)
    seed = torch.randn_like(out)
    got_g, want_g = torch.autograd.grad(out, (q, k, v), seed), torch.autograd.grad(want, (q, k, v), seed)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)  # attention_math's softmax is f32
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
