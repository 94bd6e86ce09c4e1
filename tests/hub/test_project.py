"""``kernelize.hub.project``: an ``nn.Linear`` while training on the CPU, with oneDNN products."""

from __future__ import annotations

import pytest
import torch

from kernelize import hub
from kernelize.hub.project import _Linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(37,), (3, 11)])
def test_matches_the_module_forward_and_gradients(bias, lead) -> None:
    torch.manual_seed(0)
    proj = torch.nn.Linear(200, 72, bias=bias)
    x = torch.randn(*lead, 200, requires_grad=True)
    y = hub.project(proj, x)
    assert type(y.grad_fn).__name__ == f"{_Linear.__name__}Backward"  # the oneDNN path ran
    seed = torch.randn(*lead, 72).transpose(0, -1).contiguous().transpose(0, -1)  # a strided upstream
    got = torch.autograd.grad(y, [x, *proj.parameters()], seed)
    want = torch.autograd.grad(proj(x), [x, *proj.parameters()], seed)
    torch.testing.assert_close(y, proj(x), rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_falls_back_to_the_module_call(monkeypatch) -> None:
    """bf16, no gradients, a hooked module or `KERNELIZE_CPU_GEMM=torch`: the module's own call."""
    proj = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    assert hub.project(proj.bfloat16(), x.bfloat16()).grad_fn.name() != "_LinearBackward"
    proj.float()
    with torch.no_grad():
        assert hub.project(proj, x).grad_fn is None
    calls = []
    handle = proj.register_forward_hook(lambda *a: calls.append(1))
    hub.project(proj, x)
    assert calls == [1]
    handle.remove()
    monkeypatch.setenv("KERNELIZE_CPU_GEMM", "torch")
    assert type(hub.project(proj, x).grad_fn).__name__ == "AddmmBackward0"


def test_the_hub_linear_layer_trains_through_it() -> None:
    from kernelize import get_kernel

    layer = get_kernel("kernelize/linear", version=1).layers.Linear()
    ref = torch.nn.Linear(48, 20)
    layer.weight, layer.bias = ref.weight, ref.bias
    x = torch.randn(5, 48, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == f"{_Linear.__name__}Backward"
    got = torch.autograd.grad(y.sum(), [x, ref.weight, ref.bias])
    want = torch.autograd.grad(ref(x).sum(), [x, ref.weight, ref.bias])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert hub.train_linear(x.detach(), ref.weight.detach()) is None  # nothing needs a gradient
    assert hub.train_linear(x.bfloat16(), ref.weight.bfloat16()) is None


def test_double_backward_and_autocast_match_the_module() -> None:
    """create_graph=True differentiates the backward (torch products there); under autocast the module's
    own call runs (autocast picks the matmul dtype)."""
    torch.manual_seed(1)
    proj = torch.nn.Linear(24, 10)
    x = torch.randn(6, 24, requires_grad=True)
    grads = []
    for y in (hub.project(proj, x), proj(x)):
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        grads.append(torch.autograd.grad(gx.pow(2).sum(), [x, proj.weight]))
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hub.project(proj, x).dtype == torch.bfloat16


def test_weight_gradients_are_huge_page_tensors() -> None:
    """The weight gradient is a new tensor asking for huge pages (no 4 KiB fault per page of a fresh
    gradient); under create_graph it is torch's differentiable product."""
    from kernelize.runtime.memory import hugepages_advised

    proj = torch.nn.Linear(1024, 2048, bias=False)  # an 8 MiB gradient
    x = torch.randn(16, 1024, requires_grad=True)
    hub.project(proj, x).sum().backward()
    assert hugepages_advised(proj.weight.grad)
    torch.testing.assert_close(proj.weight.grad, torch.ones(2048, 16) @ x.detach())
    (dw,) = torch.autograd.grad(hub.project(proj, x).square().sum(), [proj.weight], create_graph=True)
    assert dw.requires_grad
