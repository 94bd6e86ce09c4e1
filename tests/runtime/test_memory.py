"""The CPU output pool and the huge-page hint (``kernelize.runtime.memory``)."""

from __future__ import annotations

import torch

from kernelize.runtime.memory import HUGEPAGE_MIN, OutputPool, hint_hugepages


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


def test_zeros_on_fresh_pages_are_zeros_that_take_writes():
    import mmap

    from kernelize.runtime.memory import FRESH_ZEROS_MIN, zeros_on_fresh_pages

    for shape, dtype in [((3, 5), torch.float32), ((1,), torch.bfloat16), ((4097, 129), torch.float32)]:
        z = zeros_on_fresh_pages(shape, dtype)
        assert z.shape == shape and z.dtype == dtype and z.is_contiguous() and not z.any()
        z[-1, ...] = 2.0
        assert z.sum().item() == 2.0 * (shape[-1] if len(shape) > 1 else 1)
    big = zeros_on_fresh_pages((FRESH_ZEROS_MIN // 4 + 1,), torch.float32)  # past the threshold: own pages
    assert big.data_ptr() % mmap.PAGESIZE == 0 and not big.any()
    big[::1024] = 1.0
    assert big.sum().item() == len(range(0, big.numel(), 1024))
