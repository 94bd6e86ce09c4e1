"""CPU output memory: transparent huge pages under large buffers and a per-graph pool that recycles them.

Allocation is the runtime's business, not the code generators': a compiled graph on the cpu backend takes
its large outputs from an :class:`OutputPool` (or, for gradients autograd adopts, :func:`empty_huge`) and
its intermediates from an :class:`Arena`, each advised with :func:`hint_hugepages` once, when allocated.
(The launcher advised every large buffer on every call until a madvise of a reused 8 MiB output was
measured at ~26 us per call with cold caches, a training step's case.)

Example:
    >>> pool = OutputPool()
    >>> y = pool.empty("y", (2048, 2048), torch.float32)  # 16 MiB: huge-page hinted, reused once dropped
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

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


def trim_heap() -> bool:
    """Hand the C heap's free memory back to the system (glibc's `malloc_trim(0)`); False where there is none.

    After a large free (the old gate / up weights a merge replaced), glibc raises its mmap threshold and
    keeps later freed blocks in its heap: the process would hold them as resident memory (about 18 MB a
    layer of a 0.5 B model). Called once at the end of `kernelize_model`.
    """
    if platform.system() != "Linux":
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return False


def hint_hugepages(t: torch.Tensor) -> None:
    """Ask for transparent huge pages under ``t``'s memory (a no-op for small tensors or off Linux)."""
    nbytes = t.numel() * t.element_size()
    if _madvise is None or nbytes < HUGEPAGE_MIN:
        return
    start = t.data_ptr()
    lo, hi = (start + _HUGE - 1) & ~(_HUGE - 1), (start + nbytes) & ~(_HUGE - 1)
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)


def hugepages_advised(t: torch.Tensor) -> bool:
    """Whether the mapping at ``t``'s first 2 MiB boundary has ``MADV_HUGEPAGE`` (``hg`` in
    ``/proc/self/smaps``: :func:`hint_hugepages` advises the aligned span), i.e. its pages fault in 2 MiB at
    a time where the kernel has them. False off Linux.

    Example:
        >>> hugepages_advised(empty_huge((4096, 1024), torch.float32))  # doctest: +SKIP
        True
    """
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return False
    addr, inside = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1), False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's address range starts its block
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


def empty_huge(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty`` with transparent huge pages asked for before the first touch (CPU tensors).

    For large tensors made anew every step, such as weight gradients: a fresh 32000 x 512 f32 gradient
    page-faults 16,000 4 KiB pages when first written (``torch.zeros``: 28-32 ms here); in 2 MiB pages it
    took 8-12 ms, as long as zeroing memory kept from the previous step, without keeping any: the tensor goes
    back to the OS when it is dropped (kept gradient memory counts against a training step's peak, which
    eager torch lowers by freeing the old gradients at ``zero_grad()``).

    Example:
        >>> g = empty_huge((32000, 512), torch.float32)  # a new tensor: autograd adopts it as .grad
    """
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if t.device.type == "cpu":
        hint_hugepages(t)
    return t


def zeros_lazy(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on a fresh anonymous mapping: the OS zeroes a page when it is first touched
    (unmapped when the tensor is freed), so a large tensor written sparsely costs the pages it writes.

    For the dense gradient of a token embedding (32000 x 512 f32, 512 tokens a step): torch's
    ``zeros`` + ``index_add_`` writes all 65 MB; measured with other allocations between steps, 28 ms for
    ``empty_huge`` + ``zero_`` + ``index_add_`` against 4.8 ms here, and reading it all afterwards (as an
    optimizer does; untouched pages map the shared zero page) took 6.8 ms against 2.1 ms. Small tensors
    (under :data:`HUGEPAGE_MIN` bytes) and non-Linux hosts get ``torch.zeros``.

    Example:
        >>> g = zeros_lazy((32000, 512), torch.float32)
        >>> float(g.abs().sum())
        0.0
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGEPAGE_MIN or platform.system() != "Linux":
        return torch.zeros(tuple(shape), dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(tuple(shape))  # the tensor keeps the mapping alive


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
        _HOLDERS.add(self)

    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps that no tensor outside it uses (memory a caller would
        otherwise have had back between calls)."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._slots.values() if _slot_idle(t))

    def empty(self, key, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if math.prod(shape) * dtype.itemsize < self.MIN_BYTES or _storage_use_count is None:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            t = self._slots.get(key)
            if t is not None and t.dtype == dtype and tuple(t.shape) == shape and _slot_idle(t):
                return t
            t = torch.empty(shape, dtype=dtype)
            hint_hugepages(t)
            self._slots[key] = t
            return t


def _slot_idle(t: torch.Tensor) -> bool:
    """Nothing outside the pool uses slot tensor ``t``. Refs: the slot, the caller's name, this parameter and
    getrefcount's argument; no C++ owner (autograd); its storage's: ``t`` and the temporary object."""
    return (
        sys.getrefcount(t) == 4
        and t._use_count() == 1
        and _storage_use_count(t.untyped_storage()._cdata) == 2
    )


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
_HOLDERS: weakref.WeakSet = weakref.WeakSet()  # every live OutputPool and Arena


def held_bytes() -> int:
    """Bytes the CPU runtime keeps between calls that no tensor outside it uses: idle pool buffers and
    arena blocks (what a memory measure taken between training steps would otherwise not see).

    Example:
        >>> n = held_bytes()  # e.g. added to the resident size before a step (benchmarks/train.py)
    """
    return sum(h.held_bytes() for h in list(_HOLDERS))


_POOLS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def pool_of(owner: torch.Tensor) -> OutputPool:
    """The :class:`OutputPool` of buffers made for ``owner`` (e.g. an LM head's logits chunk, call after
    call), dropped with it.

    Example:
        >>> w = torch.zeros(1024, 512)
        >>> z = pool_of(w).empty("logits", (256, 1024), torch.float32); p = z.data_ptr(); del z
        >>> pool_of(w).empty("logits", (256, 1024), torch.float32).data_ptr() == p
        True
    """
    pool = _POOLS.get(owner)
    if pool is None:
        pool = _POOLS[owner] = OutputPool()
    return pool


ARENA_ALIGN = 64  # bytes: a cache line, and what vector loads want


def plan_offsets(
    lifetimes: Sequence[tuple[int, int, int]], inplace: Mapping[int, int] | None = None
) -> tuple[list[int], int]:
    """Byte offsets in one arena for buffers given as ``(nbytes, first_step, last_step)``, and its size.

    A buffer occupies its bytes from the step that writes it through the last step that reads it. The
    steps go in order: each step's buffers take the smallest free block that fits (else the end of the
    arena grows), then the buffers whose last reader was this step free their blocks (merged with free
    neighbours). A step's outputs therefore never share memory with its inputs, and a buffer usually
    lands where a buffer of similar size just died, whose lines are still in cache. The exception is
    ``inplace``: buffer ``i`` may take over the block of buffer ``inplace[i]`` of the same size when that
    one's last reader is the step writing ``i`` (a conv adding its residual element by element).

    Example:
        >>> plan_offsets([(100, 0, 1), (100, 1, 2), (100, 2, 3)])
        ([0, 128, 0], 256)
        >>> plan_offsets([(100, 0, 1), (100, 1, 2)], inplace={1: 0})
        ([0, 0], 128)
    """
    inplace = inplace or {}
    order = sorted(range(len(lifetimes)), key=lambda i: (lifetimes[i][1], i))
    ends: dict[int, list[int]] = {}
    taken: set[int] = set()  # buffers whose block went to the buffer written in place over them
    for i, (_, _, last) in enumerate(lifetimes):
        ends.setdefault(last, []).append(i)
    free: list[list[int]] = []  # [offset, size], sorted by offset
    offsets, top, pos = [0] * len(lifetimes), 0, 0
    for step in sorted({life[1] for life in lifetimes} | set(ends)):
        while pos < len(order) and lifetimes[order[pos]][1] == step:
            i = order[pos]
            pos += 1
            size = -(-lifetimes[i][0] // ARENA_ALIGN) * ARENA_ALIGN
            j = inplace.get(i)
            if (
                j is not None
                and j not in taken
                and lifetimes[j][2] == step
                and lifetimes[j][0] == lifetimes[i][0]
            ):
                offsets[i] = offsets[j]
                taken.add(j)
                continue
            fits = [b for b in free if b[1] >= size]
            if fits:
                block = min(fits, key=lambda b: b[1])
                offsets[i] = block[0]
                block[0] += size
                block[1] -= size
                free = [b for b in free if b[1] > 0]
            else:
                offsets[i], top = top, top + size
        for i in ends.get(step, ()):
            if i not in taken:
                size = -(-lifetimes[i][0] // ARENA_ALIGN) * ARENA_ALIGN
                free = _freed(free, offsets[i], size)
    return offsets, top


def _freed(free: list[list[int]], offset: int, size: int) -> list[list[int]]:
    """``free`` with ``[offset, offset + size)`` added and merged with the blocks it touches."""
    blocks = sorted([*free, [offset, size]])
    merged: list[list[int]] = []
    for b in blocks:
        if merged and merged[-1][0] + merged[-1][1] == b[0]:
            merged[-1][1] += b[1]
        else:
            merged.append(list(b))
    return merged


class Arena:
    """A compiled graph's intermediate buffers for one input signature, as views of one block of memory.

    The runtime used to give every large intermediate its own pooled buffer: no page faults, but the
    activations of a whole CNN then spanned tens of MB, so each kernel wrote into lines long evicted. One
    arena laid out by :func:`plan_offsets` holds only what is alive at once and reuses warm memory: on
    MobileNetV2 (batch 1, 1 thread) the generated 1x1 convs ran 1.6x faster in the model with the arena
    than with per-buffer pool slots. The views are made once; a call that finds the arena in use by
    another thread allocates instead (:meth:`take`).
    """

    def __init__(
        self, buffers: dict, layouts: dict, inplace: Mapping | None = None, slices: Mapping | None = None
    ) -> None:
        """``buffers``: key -> (shape, dtype, first step, last step); ``layouts``: key -> True for an NHWC
        buffer (stored ``(n, h, w, c)`` and viewed as NCHW); ``inplace``: key -> the key of a buffer of the
        same shape and layout it may overwrite (see :func:`plan_offsets`); ``slices``: key -> (the key of an
        NHWC buffer, first channel, end channel): a view of those channels of it, no memory of its own."""
        keys = list(buffers)
        index = {k: i for i, k in enumerate(keys)}
        lifetimes = []
        for k in keys:
            shape, dtype, first, last = buffers[k]
            lifetimes.append((math.prod(shape) * dtype.itemsize, first, last))
        pairs = {
            index[k]: index[r]
            for k, r in (inplace or {}).items()
            if k in index
            and r in index
            and buffers[k][:2] == buffers[r][:2]
            and layouts.get(k) == layouts.get(r)
        }
        offsets, size = plan_offsets(lifetimes, pairs)
        self.block = torch.empty(max(size, 1), dtype=torch.uint8)
        _HOLDERS.add(self)
        hint_hugepages(self.block)
        self.views: dict = {}
        for k, off, (nbytes, _, _) in zip(keys, offsets, lifetimes, strict=True):
            shape, dtype = buffers[k][:2]
            stored = (shape[0], shape[2], shape[3], shape[1]) if layouts.get(k) else shape
            t = self.block[off : off + nbytes].view(dtype).view(stored)
            self.views[k] = t.permute(0, 3, 1, 2) if layouts.get(k) else t
        for k, (base, c0, c1) in (slices or {}).items():
            self.views[k] = self.views[base][:, c0:c1]
        self._lock = threading.Lock()
        self.program: list | None = None  # the replay program for this signature (schedule.program)

    def held_bytes(self) -> int:
        """The block's bytes: an arena keeps them between calls."""
        return self.block.numel()

    def take(self) -> dict | None:
        """The views, reserved for this call (release with :meth:`release`), or None while another call holds
        them."""
        return self.views if self._lock.acquire(blocking=False) else None

    def release(self) -> None:
        self._lock.release()


__all__ = [
    "ARENA_ALIGN",
    "HUGEPAGE_MIN",
    "Arena",
    "OutputPool",
    "empty_huge",
    "held_bytes",
    "hugepages_advised",
    "hint_hugepages",
    "plan_offsets",
    "pool_of",
    "trim_heap",
]
