"""Memory planning (kernelize/runtime/buffers.py): concats whose pieces their convs write in place, against
the reference executor."""

from __future__ import annotations

import math

import pytest
import torch

from kernelize.ir import Graph, evaluate
from kernelize.runtime import compiled
from kernelize.runtime.compiled import compile_graph
from kernelize.runtime.replay import Batch


def _relu(g, y):
    return g.clamp(y, 0, math.inf)


def _conv(g, x, co, k=1, groups=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(co, x.shape[1] // groups, k, k, generator=gen) / math.sqrt(x.shape[1] * k * k / groups)
    b = torch.randn(co, generator=gen) * 0.1
    return g.conv(x, g.const(w), g.const(b), padding=(k // 2,) * 4, groups=groups)


def _fire_graph() -> Graph:
    """A fire / inception block with awkward channel counts: a concat of a 1x1 conv (7 channels), a 3x3 conv
    (17: a partial panel between two slices, where a store past its channels would overwrite the next
    slice) and a depthwise conv (6) read only by the concat, then a concat whose first piece another conv
    also reads (not in place)."""
    g = Graph()
    x = g.input("x", ("n", 6, 7, 9), "f32")
    s = _relu(g, _conv(g, x, 5, seed=1))
    a = _relu(g, _conv(g, s, 7, seed=2))
    b = _relu(g, _conv(g, s, 17, k=3, seed=3))
    c = _conv(g, x, 6, k=3, groups=6, seed=4)
    y = _relu(g, _conv(g, g.concat([a, b, c], 1), 8, seed=5))
    z = _relu(g, _conv(g, y, 4, seed=6))
    g.output(_conv(g, g.concat([z, y], 1), 3, seed=7))
    return g


@pytest.mark.parametrize("replay", [True, False])
def test_convs_write_a_concats_pieces_into_its_buffer(monkeypatch, replay):
    monkeypatch.setattr(compiled, "REPLAY", replay)
    g = _fire_graph()
    cg = compile_graph(g, backend="cpu", cache=False)
    pieces, skip = cg._slices
    assert len(skip) == 1 and len(pieces) == 3, "the first concat is written in place, the second is not"
    assert sorted((c0, c1) for _, c0, c1 in pieces.values()) == [(0, 7), (7, 24), (24, 30)]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 0, 2):
            x = torch.randn(n, 6, 7, 9, generator=torch.Generator().manual_seed(n))
            want = evaluate(g, [x])[0]
            for t in (1, 2):
                torch.set_num_threads(t)
                torch.testing.assert_close(cg(x)[0], want, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
    arena = next(iter(cg._arenas.values()))
    (concat,) = {c for c, _, _ in pieces.values()}
    for p, (_, c0, c1) in pieces.items():  # the pieces' views are slices of the concat's buffer
        view, whole = arena.views[p], arena.views[concat]
        assert view.data_ptr() == whole.data_ptr() + 4 * c0 and view.shape[1] == c1 - c0
    if replay:  # every conv writing a piece runs from the replayed batch, the concat nowhere
        replayed = {i for u in arena.program if isinstance(u, Batch) for i in u.steps}
        writers = {i for i, st in enumerate(cg._steps) if set(st.kernel.writes) & set(pieces)}
        alone = {u for u in arena.program if isinstance(u, int)}
        assert writers <= replayed and not skip & (replayed | alone)


def test_a_concat_runs_as_a_copy_when_the_arena_is_taken():
    """A call that finds the arena in use by another call allocates its buffers: the pieces are then
    buffers of their own and the concat step copies them."""
    g = _fire_graph()
    cg = compile_graph(g, backend="cpu", cache=False)
    x = torch.randn(2, 6, 7, 9)
    want = evaluate(g, [x])[0]
    cg(x)
    arena = next(iter(cg._arenas.values()))
    assert arena.take() is not None  # held, as by a call on another thread
    try:
        torch.testing.assert_close(cg(x)[0], want, rtol=1e-4, atol=1e-4)
    finally:
        arena.release()
