"""The absorb rule: an intermediate stays in registers only if its users are in the group or it is cheap."""

from __future__ import annotations

from kernelize.autokernel.legality import can_absorb, nbytes, read_bytes, recompute_cost
from kernelize.ir import Graph, Op


def _graph():
    g = Graph()
    x, y, z = (g.input(n, (8, 64), "f32") for n in "xyz")
    b = g.input("b", (64,), "f32")
    return g, x, y, z, b


def test_all_users_in_the_group_absorbs_even_expensive_values():
    g, x, y, z, b = _graph()
    s = g.add(g.add(x, y), z)
    e = g.exp(s)
    assert can_absorb(s, {s, e}, {s: [e]})


def test_outputs_are_never_absorbed():
    g, x, *_ = _graph()
    e = g.exp(x)
    assert not can_absorb(e, {e}, {e: []}, outputs={e})


def test_cheap_value_is_recomputed_by_an_outside_reader():
    g, x, y, z, b = _graph()
    t = g.mul(x, 2.0)  # reads x (+ a scalar): no more bytes than writing t and reading it back
    r1 = g.exp(t)
    assert can_absorb(t, {t}, {t: [r1]})
    biased = g.add(x, b)  # a broadcast bias counts once
    assert can_absorb(biased, {biased}, {biased: [r1]})


def test_value_reading_more_than_a_round_trip_is_stored():
    g, x, y, z, b = _graph()
    s = g.add(g.add(x, y), z)  # three full reads per recompute
    u1, u2 = g.exp(s), g.tanh(s)
    assert not can_absorb(s, {s}, {s: [u1]}, is_buffer=lambda n: False)
    two = g.add(x, y)  # two reads: fine for one reader (2 <= 1 + 1), not for two (4 > 3)
    assert can_absorb(two, {two}, {two: [u1]})
    assert not can_absorb(two, {two}, {two: [u1, u2]})


def test_reductions_and_matmuls_are_never_recomputed():
    g, x, *_ = _graph()
    m = g.reduce(Op.SUM, x, 1, keepdim=True)
    e = g.exp(m)
    assert recompute_cost(e, lambda n: False) is None  # the tree would contain the reduction
    assert not can_absorb(e, {e}, {e: [g.tanh(e)]})
    assert recompute_cost(e, lambda n: n is m) == (1, nbytes(m))  # from the stored reduction it is cheap


def test_tree_size_is_capped():
    g, x, *_ = _graph()
    v = x
    for _ in range(10):
        v = g.tanh(v)
    assert recompute_cost(v, lambda n: False, max_ops=8) is None
    assert recompute_cost(v, lambda n: False, max_ops=10) == (10, nbytes(x))
    assert not can_absorb(v, {v}, {v: [g.exp(v)]}, max_ops=8)


def test_read_bytes_follow_slices_and_broadcasts():
    g, x, y, z, b = _graph()
    half = g.slice(x, 1, 0, 32)
    wide = g.broadcast(g.view(b, (1, 64)), (8, 64))
    assert read_bytes(half) == 8 * 32 * 4
    assert read_bytes(wide) == 64 * 4


def test_readers_of_slices_recompute_only_their_part():
    """Four readers of a quarter each cost one full recompute, not four: a two-input product read by four
    slices is recomputed (2 reads <= 1 write + 1 read), read whole by four it is stored."""
    g = Graph()
    x, y = g.input("x", (8, 4, 64), "f32"), g.input("y", (8, 4, 64), "f32")
    t = g.mul(x, y)
    quarters = [g.exp(g.slice(t, 1, i, i + 1)) for i in range(4)]
    assert can_absorb(t, {t}, {t: quarters})
    wholes = [g.exp(t), g.tanh(t), g.neg(t), g.sin(t)]
    assert not can_absorb(t, {t}, {t: wholes})
