"""The fused linear + cross-entropy against ``F.cross_entropy(h @ W.T + b)``: loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernelize import get_kernel


@pytest.fixture(scope="module")
def loss_pkg():
    return get_kernel("kernelize/loss", version=1)


def _reference(h, w, b, y, **kw):
    leaves = [t.detach().requires_grad_() for t in (h, w, b) if t is not None]
    hh, ww, *bb = leaves
    loss = F.cross_entropy(F.linear(hh.float(), ww.float(), bb[0].float() if bb else None), y, **kw)
    return loss, leaves


@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_cross_entropy_of_the_logits(loss_pkg, tokens, smoothing, bias, reduction) -> None:
    h, w = torch.randn(tokens, 24), torch.randn(101, 24) * 0.3
    b = torch.randn(101) if bias else None
    y = torch.randint(0, 101, (tokens,))
    y[::3] = -100  # ignored rows (all of them when tokens == 1)
    kw = {"label_smoothing": smoothing, "reduction": reduction}
    want, leaves = _reference(h, w, b, y, **kw)
    seed = torch.tensor(1.7)
    want_g = torch.autograd.grad(want * seed, leaves)
    mine = [t.clone().requires_grad_() for t in leaves]
    got = loss_pkg.fused_linear_cross_entropy(mine[0], mine[1], y, *mine[2:], chunk_size=8, **kw)
    got_g = torch.autograd.grad(got * seed, mine)
    if tokens == 1 and reduction == "mean":  # every row ignored: torch gives nan, ours 0 with zero grads
        assert got.item() == 0.0 and all(bool((g == 0).all()) for g in got_g)
        return
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, wg in zip(got_g, want_g):
        torch.testing.assert_close(g, wg, rtol=1e-5, atol=1e-5)


def test_leading_dims_default_chunks_and_bf16(loss_pkg) -> None:
    h = torch.randn(600, 32, dtype=torch.bfloat16)
    w = torch.randn(64, 32, dtype=torch.bfloat16) * 0.2
    y = torch.randint(0, 64, (2, 300))
    want, leaves = _reference(h, w, None, y.reshape(-1))
    want_g = torch.autograd.grad(want, leaves)  # f32 logits: the oracle for the bf16 kernel
    mine = [t.clone().requires_grad_() for t in leaves]
    got = loss_pkg.fused_linear_cross_entropy(mine[0].reshape(2, 300, 32), mine[1], y)
    got_g = torch.autograd.grad(got, mine)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    for g, wg in zip(got_g, want_g):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), wg.float(), rtol=3e-2, atol=3e-3)


def test_chunks_never_hold_all_logits(loss_pkg) -> None:
    rows = loss_pkg.layers.chunk_rows(tokens=8192, vocab=32000, hidden=1024)
    assert 256 <= rows < 8192
    assert loss_pkg.layers.chunk_rows(tokens=5, vocab=32000, hidden=64) == 8


def test_module_reads_its_weight(loss_pkg) -> None:
    m = loss_pkg.LinearCrossEntropy()
    m.weight = torch.nn.Parameter(torch.randn(11, 8))
    h, y = torch.randn(4, 8), torch.randint(0, 11, (4,))
    torch.testing.assert_close(m(h, y), F.cross_entropy(h @ m.weight.detach().T, y))


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"reduction": "none"}, ValueError, "reduction='none'"),
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    ],
)
def test_user_mistakes_raise_with_a_remedy(loss_pkg, kw, err, match) -> None:
    with pytest.raises(err, match=match):
        loss_pkg.fused_linear_cross_entropy(
            torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), **kw
        )
    with pytest.raises(TypeError, match="integer"):
        loss_pkg.fused_linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="do not fit"):
        loss_pkg.fused_linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 6), torch.tensor([0, 1, 2]))


def test_gradients_are_new_huge_page_tensors_and_nothing_is_kept(loss_pkg) -> None:
    """The gradients are new tensors (autograd adopts them as ``.grad``) that ask for huge pages; after
    they are dropped the loss keeps no memory of theirs, and a second call gives the same values."""
    from kernelize.runtime.memory import held_bytes, hugepages_advised

    h, w = torch.randn(64, 256, requires_grad=True), (torch.randn(8192, 256) * 0.1).requires_grad_()
    y = torch.randint(0, 8192, (64,))
    want_g = torch.autograd.grad(F.cross_entropy(h @ w.T, y), [h, w])
    loss_pkg.fused_linear_cross_entropy(h, w, y).backward()
    assert hugepages_advised(w.grad)  # 8 MiB: faults in 2 MiB pages
    first = w.grad
    w.grad, h.grad = None, None
    before = held_bytes()
    loss_pkg.fused_linear_cross_entropy(h, w, y).backward()
    torch.testing.assert_close(first, w.grad, rtol=0, atol=0)
    del first
    w.grad, h.grad = None, None
    assert held_bytes() <= before
    loss_pkg.fused_linear_cross_entropy(h, w, y).backward()
    torch.testing.assert_close(w.grad, want_g[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, want_g[0], rtol=1e-5, atol=1e-6)
