"""The bundled `kernelize/attention` repo: its layer runs the fused kernel, records it, and falls back."""

from __future__ import annotations

import torch
from torch import nn

from kernelize import hub


def _layer(hub_pkg, scale=0.25):
    cls = hub_pkg["attention"].ScaledDotProductAttention
    module = nn.Module()
    module.scale = scale
    return cls, module


def test_layer_matches_its_math_and_records_the_kernel(hub_pkg) -> None:
    cls, module = _layer(hub_pkg)
    math = hub_pkg["attention"].attention_math
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g).transpose(1, 2).transpose(1, 2) for _ in range(3))
    for mask in (None, torch.full((9, 9), float("-inf")).triu(1), torch.rand(9, 9, generator=g) > 0.2):
        if mask is not None and mask.dtype == torch.bool:
            mask[:, 0] = True
        got = cls.forward(module, q, k, v, mask)
        torch.testing.assert_close(got, math(q, k, v, mask, scale=0.25), atol=1e-5, rtol=1e-5)
    record = hub.kernels_ran(module)
    assert record.backend == "cpu" and record.kernels and "attention(" in record.signature


def test_layer_falls_back_to_the_math_for_gradients(hub_pkg) -> None:
    cls, module = _layer(hub_pkg)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    out = cls.forward(module, q, q, q)
    out.sum().backward()  # the math ran: autograd works
    assert q.grad is not None and hub.kernels_ran(module) is None


def test_16_bit_activations_with_an_f32_mask(hub_pkg) -> None:
    cls, module = _layer(hub_pkg)
    q = torch.randn(1, 2, 7, 32).bfloat16()
    mask = torch.full((7, 7), float("-inf")).triu(1)
    got = cls.forward(module, q, q, q, mask)
    want = hub_pkg["attention"].attention_math(q.float(), q.float(), q.float(), mask, scale=0.25)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
