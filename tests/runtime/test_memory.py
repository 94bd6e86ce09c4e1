"""The CPU output pool, the intermediate arena and the huge-page hint (``kernelize.runtime.memory``)."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernelize.runtime.memory import (
    ARENA_ALIGN,
    HUGEPAGE_MIN,
    Arena,
    OutputPool,
    hint_hugepages,
    plan_offsets,
)


def test_output_pool_recycles_only_dropped_buffers():
    pool = OutputPool()
    shape = (1024, 512)
    a = pool.empty("y", shape, torch.float32)
    b = pool.empty("y", shape, torch.float32)  # `a` is still referenced: a fresh buffer
    assert b.data_ptr() != a.data_ptr()
    view = b[0]  # a view keeps `b`'s memory in use even without the name
    ptr_b = b.data_ptr()
    del b
    c = pool.empty("y", shape, torch.float32)
    assert c.data_ptr() != ptr_b and view.data_ptr() == ptr_b
    ptr_c = c.data_ptr()
    del c
    d = pool.empty("y", shape, torch.float32)  # dropped with no view: handed out again
    assert d.data_ptr() == ptr_c
    e = pool.empty("y", (1024, 256), torch.float32)  # another shape: fresh
    assert e.data_ptr() != d.data_ptr()
    small = pool.empty("s", (4,), torch.float32)
    assert small.shape == (4,) and "s" not in pool._slots  # small buffers bypass the pool
    assert a.shape == shape


def test_hint_hugepages_accepts_any_buffer():
    """Small buffers are skipped, large ones (aligned or not, off Linux or on) come back untouched."""
    small = torch.ones(16)
    hint_hugepages(small)
    big = torch.ones(HUGEPAGE_MIN // 4 + 1000)
    hint_hugepages(big[3:])
    assert small.sum() == 16 and big.sum() == big.numel()


@given(
    st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=30)
)
def test_plan_offsets_never_overlaps_live_buffers(raw):
    lifetimes = [(n, first, first + span) for n, first, span in raw]
    offsets, size = plan_offsets(lifetimes)
    for i, (n, a0, a1) in enumerate(lifetimes):
        assert offsets[i] % ARENA_ALIGN == 0 and offsets[i] + n <= size
        for j in range(i):
            m, b0, b1 = lifetimes[j]
            if a0 <= b1 and b0 <= a1:  # both alive at some step
                assert offsets[i] + n <= offsets[j] or offsets[j] + m <= offsets[i], (i, j)
    assert size <= sum(-(-n // ARENA_ALIGN) * ARENA_ALIGN for n, _, _ in lifetimes)


def test_plan_offsets_reuses_memory_of_dead_buffers():
    # a chain: each buffer read only by the next step; two slots are enough however long the chain
    offsets, size = plan_offsets([(1000, i, i + 1) for i in range(10)])
    assert size == 2 * 1024 and set(offsets) == {0, 1024}


def test_arena_views_are_laid_out_nhwc_where_asked_and_taken_by_one_caller_at_a_time():
    arena = Arena({"a": ((2, 3, 4, 5), torch.float32, 0, 1), "b": ((7,), torch.int64, 1, 2)}, {"a": True})
    a, b = arena.views["a"], arena.views["b"]
    assert a.shape == (2, 3, 4, 5) and a.is_contiguous(memory_format=torch.channels_last)
    assert b.dtype == torch.int64 and b.data_ptr() % ARENA_ALIGN == 0
    views = arena.take()
    assert views is arena.views and arena.take() is None  # in use: a second caller allocates instead
    arena.release()
    assert arena.take() is not None


def test_a_buffer_written_in_place_takes_the_block_of_one_dying_at_its_step():
    # 1 over 0 (0 dies at step 1, same size): one block; 3 over 2 refused (2 is read at step 3, after 3 is
    # written at step 2); 5 over 4 refused (another size)
    lifetimes = [(256, 0, 1), (256, 1, 2), (256, 1, 3), (256, 2, 4), (256, 3, 4), (128, 4, 5)]
    offsets, _ = plan_offsets(lifetimes, inplace={1: 0, 3: 2, 5: 4})
    assert offsets[1] == offsets[0]
    assert offsets[3] != offsets[2] and offsets[5] != offsets[4]
    # buffers alive at once never overlap, the pair written in place excepted
    for i, (n, a, b) in enumerate(lifetimes):
        for j, (m, c, d) in enumerate(lifetimes[:i]):
            if (i, j) != (1, 0) and a <= d and c <= b:
                assert offsets[i] + n <= offsets[j] or offsets[j] + m <= offsets[i], (i, j)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE is Linux's")
def test_empty_huge_asks_for_huge_pages_and_autograd_adopts_it():
    """A large ``empty_huge`` tensor's mapping carries MADV_HUGEPAGE; it is a new tensor nothing else
    references, so a backward returning it makes it the ``.grad`` without a copy, and nothing is kept."""
    from kernelize.runtime.memory import empty_huge, held_bytes, hugepages_advised

    big = empty_huge((2048, 1024), torch.float32)  # 8 MiB: its whole 2 MiB-aligned span advised
    assert hugepages_advised(big) and big._use_count() == 1
    w = torch.nn.Parameter(torch.zeros(2048, 1024))
    made = []

    class Grad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum()

        @staticmethod
        def backward(ctx, g):
            grad = empty_huge((2048, 1024), torch.float32).fill_(g.item())
            made.append(grad.data_ptr())  # the address only: a reference would make autograd copy it
            return grad

    before = held_bytes()
    Grad.apply(w).backward()
    assert w.grad.data_ptr() == made[0] and bool((w.grad == 1).all())
    w.grad = None
    assert held_bytes() == before


def test_held_bytes_counts_idle_pool_buffers_and_arena_blocks():
    """What the runtime keeps between calls that no outside tensor uses: a dropped pool buffer (not one a
    view still holds) and arena blocks; the module total covers them."""
    from kernelize.runtime.memory import held_bytes

    pool = OutputPool()
    a = pool.empty("y", (1024, 512), torch.float32)
    assert pool.held_bytes() == 0
    view = a[1]
    del a
    assert pool.held_bytes() == 0  # the view still uses the buffer
    del view
    assert pool.held_bytes() == 1024 * 512 * 4
    arena = Arena({"t": ((64, 64), torch.float32, 0, 1)}, {})
    assert arena.held_bytes() == arena.block.numel() >= 64 * 64 * 4
    assert held_bytes() >= pool.held_bytes() + arena.held_bytes()
