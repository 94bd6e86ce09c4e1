"""Affine index maps through layout ops, checked against torch's own views of a real buffer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelize.autokernel.indexing import Affine, NotAffine, contiguous_strides, dadd, divides
from kernelize.ir import Graph, Sym
from kernelize.ir.graph import LAYOUT
from kernelize.ir.reference import EVAL


def gather_through(v, buf: torch.Tensor) -> torch.Tensor:
    """Read layout value ``v`` from ``buf`` (its base's data) with the map's strides and offset."""
    m = Affine.identity(v.shape)
    node = v
    while node.op in LAYOUT:
        m = m.through(node)
        node = node.src[0]
    strides, offset = m.flat(node.shape, node)
    idx = torch.full(tuple(v.shape), offset, dtype=torch.long)
    for d, s in enumerate(strides):
        shape = [1] * len(v.shape)
        shape[d] = v.shape[d]
        idx = idx + torch.arange(v.shape[d]).reshape(shape) * s
    return buf.reshape(-1)[idx]


def torch_value(v, buf: torch.Tensor) -> torch.Tensor:
    chain = []
    while v.op in LAYOUT:
        chain.append(v)
        v = v.src[0]
    t = buf
    for n in reversed(chain):
        t = EVAL[n.op](n, [t], {})
    return t


@st.composite
def layout_chains(draw):
    g = Graph()
    shape = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3))))
    v = x = g.input("x", shape, "f32")
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["permute", "slice", "flip", "broadcast", "merge", "split", "unsqueeze"]))
        r = v.rank
        if kind == "permute":
            v = g.permute(v, draw(st.permutations(range(r))))
        elif kind == "slice":
            a = draw(st.integers(0, r - 1))
            v = g.slice(v, a, draw(st.integers(0, v.shape[a] - 1)), None, draw(st.integers(1, 2)))
        elif kind == "flip":
            v = g.flip(v, [draw(st.integers(0, r - 1))])
        elif kind == "broadcast":
            ones = [a for a, d in enumerate(v.shape) if d == 1]
            if ones:
                v = g.broadcast(v, tuple(3 if a == ones[0] else d for a, d in enumerate(v.shape)))
        elif kind == "merge" and r >= 2:
            a = draw(st.integers(0, r - 2))
            v = g.view(v, (*v.shape[:a], v.shape[a] * v.shape[a + 1], *v.shape[a + 2 :]))
        elif kind == "split" and any(d % 2 == 0 for d in v.shape):
            a = next(a for a, d in enumerate(v.shape) if d % 2 == 0)
            v = g.view(v, (*v.shape[:a], 2, v.shape[a] // 2, *v.shape[a + 1 :]))
        elif kind == "unsqueeze":
            v = g.view(v, (1, *v.shape))
    return x, v


@settings(max_examples=300, deadline=None)
@given(layout_chains())
def test_maps_read_what_torch_views_read(case):
    x, v = case
    buf = torch.randn(x.shape)
    try:
        got = gather_through(v, buf)
    except NotAffine as e:  # only a split index the strides cannot follow may fail
        assert "split" in str(e)
        return
    assert torch.equal(got, torch_value(v, buf))


def test_transposed_batch_merge_stays_strided():
    g = Graph()
    k = g.input("k", (2, 3, 5, 8), "f32")
    v = g.view(g.permute(k, (0, 1, 3, 2)), (6, 8, 5))  # merge of (2, 3) in a permuted tensor
    buf = torch.randn(2, 3, 5, 8)
    assert torch.equal(gather_through(v, buf), torch_value(v, buf))


def test_split_that_strides_cannot_follow_names_the_view():
    g = Graph()
    x = g.input("x", (4, 6), "f32")
    v = g.view(g.permute(x, (1, 0)), (24,))
    with pytest.raises(NotAffine) as e:
        gather_through(v, torch.randn(4, 6))
    assert e.value.node is v


def test_symbolic_strides_and_offsets():
    g = Graph()
    x = g.input("x", ("n", 8), "f32")
    v = g.slice(g.permute(x, (1, 0)), 0, 4)
    m = Affine.identity(v.shape).through(v).through(v.src[0])
    assert m.flat(x.shape) == ((1, 8), 4)
    n = Sym.of("n")
    assert contiguous_strides((2, n, 8)) == (n * 8, 8, 1)
    assert dadd(n * 2, n * 3) == n * 5 and dadd(n, 1) is None
    assert divides(4, n * 8) and not divides(n, 8) and divides(n, n * 2)
