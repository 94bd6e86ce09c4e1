"""The hub's ``Embedding`` layer and ``kernelize.hub.train_embedding`` against ``torch.nn.Embedding``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernelize import get_kernel, hub
from kernelize.hub.embedding import _Embedding


@pytest.fixture(scope="module")
def layer_cls():
    return get_kernel("kernelize/linear", version=1).layers.Embedding


def _layer(layer_cls, ref: nn.Embedding) -> nn.Module:
    layer = layer_cls()
    layer.weight = ref.weight
    for name in ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"):
        setattr(layer, name, getattr(ref, name))
    return layer


@pytest.mark.parametrize("padding_idx", [None, 3, -2])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_forward_and_weight_gradient_equal_torch(layer_cls, padding_idx, ids_dtype) -> None:
    torch.manual_seed(0)
    ref = nn.Embedding(50, 24, padding_idx=padding_idx)
    layer = _layer(layer_cls, ref)
    ids = torch.tensor([[1, 3, 48, 1, 1], [0, 3, 2, 2, 48]], dtype=ids_dtype)  # repeats, the padding row
    y = layer(ids)
    assert type(y.grad_fn).__name__ == f"{_Embedding.__name__}Backward"
    seed = torch.randn_like(y)
    got = torch.autograd.grad(y, ref.weight, seed)[0]
    want = torch.autograd.grad(ref(ids), ref.weight, seed)[0]
    torch.testing.assert_close(y, ref(ids), rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if padding_idx is not None:
        assert not got[padding_idx].any()


def test_without_gradients_the_generated_gather_runs_and_checks_ids(layer_cls) -> None:
    ref = nn.Embedding(40, 8)
    layer = _layer(layer_cls, ref)
    ids = torch.randint(0, 40, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(layer(ids), ref(ids), rtol=0, atol=0)
        assert layer(torch.empty(0, dtype=torch.long)).shape == (0, 8)
        for bad in (-1, 40):  # torch's embedding raises for both (the IR's plain gather would wrap -1)
            with pytest.raises(
                IndexError, match=r"^Embedding \(embedding_math\): .*gather index is out of range"
            ):
                layer(torch.tensor([1, bad]))
    ran = hub.kernels_ran(layer)  # what ran is recorded for kernelize.inspect: generated gather kernels
    assert ran.backend == "cpu" and ran.kernels and "embedding_math(int64[n2, 7]" in ran.signature


def test_max_norm_and_sparse_keep_torch_semantics(layer_cls) -> None:
    """``max_norm`` renormalises the weight rows it reads in place; sparse gives a sparse gradient."""
    torch.manual_seed(1)
    ref = nn.Embedding(20, 6, max_norm=0.5)
    twin = nn.Embedding(20, 6, max_norm=0.5)
    twin.weight.data.copy_(ref.weight.data)
    ids = torch.tensor([2, 5, 5])
    torch.testing.assert_close(_layer(layer_cls, ref)(ids), twin(ids))
    torch.testing.assert_close(ref.weight, twin.weight)  # the same rows renormalised
    sparse = nn.Embedding(20, 6, sparse=True)
    _layer(layer_cls, sparse)(ids).sum().backward()
    assert sparse.weight.grad.is_sparse


def _resident_kib(address: int) -> int | None:
    """Rss of the mapping holding ``address`` (``/proc/self/smaps``), None when no mapping holds it."""
    inside = False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    return None


def test_the_gradient_is_lazily_zeroed_accumulates_and_is_unmapped_when_dropped() -> None:
    """The weight gradient lives on a fresh mapping: only the pages of the rows written become resident;
    a second backward adds into it; dropping it unmaps it."""
    w = torch.randn(32768, 64, requires_grad=True)  # 8 MiB
    ids = torch.randint(0, 32768, (2, 33))
    hub.train_embedding(ids, w).sum().backward()
    address = w.grad.data_ptr()
    assert _resident_kib(address) <= 66 * 4 + 8  # 66 ids: at most one 4 KiB page each, of 8192 KiB
    hub.train_embedding(ids, w).sum().backward()
    want = torch.zeros_like(w).index_add_(0, ids.reshape(-1), torch.ones(66, 64))
    torch.testing.assert_close(w.grad, 2 * want)
    w.grad = None
    assert _resident_kib(address) is None


def test_declines_where_it_does_not_apply() -> None:
    w = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        assert hub.train_embedding(ids, w) is None
    assert hub.train_embedding(ids, w.detach()) is None
    with hub.use_backend("reference"):
        assert hub.train_embedding(ids, w) is None
