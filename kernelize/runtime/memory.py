"""CPU output memory: transparent huge pages under large buffers and a per-graph pool that recycles them.

Allocation is the runtime's business, not the code generators': a compiled graph on the cpu backend takes
its large outputs from an :class:`OutputPool`, and the cpu launcher calls :func:`hint_hugepages` on the
buffers it is handed.

Example:
    >>> pool = OutputPool()
    >>> y = pool.empty("y", (2048, 2048), torch.float32)  # 16 MiB: huge-page hinted, reused once dropped
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading

import torch

# Fresh large outputs cost more in page faults than the kernel itself (a 64 MiB torch.empty is first
# touched by the kernel: ~16k 4 KiB faults). Before launch, large outputs get MADV_HUGEPAGE on their
# 2 MiB-aligned span, so the kernel's first touch faults 2 MiB pages (measured in benchmarks/cpu_layers.py).
HUGEPAGE_MIN = 1 << 22
_MADV_HUGEPAGE = 14
_HUGE = 1 << 21


def _madvise_fn():
    if platform.system() != "Linux" or os.environ.get("KERNELIZE_CPU_HUGEPAGES", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _madvise_fn()


def hint_hugepages(t: torch.Tensor) -> None:
    """Ask for transparent huge pages under ``t``'s memory (a no-op for small tensors or off Linux)."""
    nbytes = t.numel() * t.element_size()
    if _madvise is None or nbytes < HUGEPAGE_MIN:
        return
    start = t.data_ptr()
    lo, hi = (start + _HUGE - 1) & ~(_HUGE - 1), (start + nbytes) & ~(_HUGE - 1)
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)


FRESH_ZEROS_MIN = 1 << 20


def zeros_on_fresh_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on fresh anonymous pages (its own mapping, unmapped when the tensor is freed).

    The kernel hands out zero pages when they are first touched, so memory nothing writes costs nothing:
    an embedding's weight gradient is a [vocab, hidden] zero tensor with a few rows added in, and
    ``torch.zeros`` writes (and page-faults) all of it. [32000, 512] f32 with 512 rows added, 1 thread:
    ``torch.zeros`` + ``index_add_`` 24.6 ms, the huge-page hint first 7.5 ms, fresh pages 1.4 ms. Small
    tensors (under ``FRESH_ZEROS_MIN`` bytes) come from ``torch.zeros``.

    Example:
        >>> g = zeros_on_fresh_pages((32000, 512), torch.float32)
        >>> float(g.abs().sum())
        0.0
    """
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if nbytes < FRESH_ZEROS_MIN:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds the mmap object: the mapping goes when the tensor's storage is freed
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class OutputPool:
    """Recycles large CPU buffers of one compiled graph once nothing but the pool holds them.

    A fresh 64 MiB ``torch.empty`` costs ~5-10 ms in page faults on first touch (more than an RMSNorm
    over it); a buffer the caller has dropped can be handed out again instead. A slot (one per written
    buffer of the graph) is reused only when its tensor has no other Python reference, no view and no
    C++ owner (autograd); otherwise a fresh tensor replaces it. Small buffers go straight to
    ``torch.empty`` (malloc reuses those already). Memory held: at most one set of the graph's buffers.

    Example:
        >>> pool = OutputPool()
        >>> a = pool.empty("y", (1024, 1024), torch.float32); p = a.data_ptr(); del a
        >>> pool.empty("y", (1024, 1024), torch.float32).data_ptr() == p
        True
    """

    MIN_BYTES = 1 << 20

    def __init__(self) -> None:
        self._slots: dict = {}
        self._lock = threading.Lock()

    def empty(self, key, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if nbytes < self.MIN_BYTES or _storage_use_count is None:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            t = self._slots.get(key)
            # refs: the slot, `t`, getrefcount's argument; storage: the tensor and the temporary storage
            if (
                t is not None
                and t.dtype == dtype
                and tuple(t.shape) == shape
                and sys.getrefcount(t) == 3
                and t._use_count() == 1
                and _storage_use_count(t.untyped_storage()._cdata) == 2
            ):
                return t
            t = torch.empty(shape, dtype=dtype)
            hint_hugepages(t)
            self._slots[key] = t
            return t


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


__all__ = ["FRESH_ZEROS_MIN", "HUGEPAGE_MIN", "OutputPool", "hint_hugepages", "zeros_on_fresh_pages"]
