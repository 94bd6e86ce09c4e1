"""Same-host all-reduce through shared memory, the transport of the kernels' tensor-parallel collectives.

`all_reduce(t, group)` is `torch.distributed.all_reduce(t, group=group)` (a sum, in place) with another
transport where every rank of `group` runs on this host, as DeepSpeed's CPU inference (`shm_comm`) and
vLLM's CPU backend do: each rank copies its partial into its slot of one POSIX shared-memory segment,
publishes a sequence number, waits for the other ranks' (a short spin, then yielding the core) and sums the
slots in rank order, so every rank computes the same expression and gets the same bits (with two ranks,
the bits `dist.all_reduce` gives). The C side is `codegen/templates/cpu_shm_allreduce.cpp`, built as the
kernels are. Why: a gloo all-reduce of one 1024-float row between two processes on a 2-core machine took
0.62 ms at the median and 4.2 ms at the 90th percentile (gloo's I/O threads and condition-variable
wake-ups), and a kernelized tensor-parallel decode token makes two per layer.

The segment is made once per group, when the group first all-reduces (every rank calls at the same point,
as for any collective): the ranks exchange their hostnames, rank 0 creates the segment under a random name
and writes a random token into it, the name and token reach the others through torch.distributed, each
maps it and checks the token (the same memory, not a namesake on another host), and once all have, rank 0
unlinks the name. Nothing stays in /dev/shm, even when a process is killed later; the mapping goes when the
group object is freed, at the first all-reduce after the process group is destroyed, or at exit.

Falls back to `dist.all_reduce` (decided alike on every rank, so no rank waits on a transport the others
do not use) where:

* `KERNELIZE_SHM_ALLREDUCE=0` on any rank (read when a group first all-reduces);
* the ranks' hostnames differ, or the segment cannot be built, made or mapped (no C++ compiler, no POSIX
  shared memory), or the group has one rank or more than 32;
* the tensor is not a contiguous CPU float32 / bfloat16 tensor of at most `SLOT_BYTES` (4 MiB).

Example:
    >>> partial = all_reduce(partial, shards.group)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import secrets
import socket
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ENV", "SLOT_BYTES", "all_reduce", "enabled", "segment_name"]

logger = logging.getLogger(__name__)

ENV = "KERNELIZE_SHM_ALLREDUCE"
# per rank and slot (two slots a rank); a decode row is 4 KiB, 1k tokens x 1024 f32 4 MiB
SLOT_BYTES = 4 << 20
MAX_WORLD = 32  # the header's counter lines (64 bytes each) below the token
TOKEN_AT = 2048  # the token's offset in the 4 KiB header
TIMEOUT_S = 1800.0  # as gloo's default collective timeout
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C side's dtype codes
_SEGMENTS: weakref.WeakKeyDictionary[Any, Segment | None] = weakref.WeakKeyDictionary()
_UNSET = object()


def enabled() -> bool:
    """Whether this process allows the shared-memory transport (`KERNELIZE_SHM_ALLREDUCE`, default 1)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    """`dist.all_reduce(t, group=group)` (sum, in place; returns `t`), through shared memory where the
    group's segment serves (see the module doc), else through torch.distributed."""
    group = dist.group.WORLD if group is None else group
    seg = None if group is None else _SEGMENTS.get(group, _UNSET)  # None: no process group, torch raises
    if seg is _UNSET:
        seg = _SEGMENTS[group] = _open(group)
    if seg is not None and not dist.is_initialized():  # destroyed: unmap, torch's all-reduce decides
        seg.close()
        seg = _SEGMENTS[group] = None
    if seg is not None and seg.fits(t):
        seg.reduce(t)
    else:
        dist.all_reduce(t, group=group)
    return t


def segment_name(group: Any) -> str | None:
    """The (unlinked) name of `group`'s segment in this process, None where the group falls back or has
    not all-reduced yet: the name shows in /proc/self/maps while mapped."""
    seg = _SEGMENTS.get(group)
    return None if seg is None else seg.name


class Segment:
    """This rank's mapping of one group's segment and the group's call count."""

    def __init__(self, lib: ctypes.CDLL, base: int, size: int, name: str, rank: int, world: int) -> None:
        self.base, self.name, self.rank, self.world, self.seq = base, name, rank, world, 0
        self.call = lib.kz_shm_all_reduce
        self._unmap = weakref.finalize(self, lib.kz_shm_unmap, base, size)

    def fits(self, t: torch.Tensor) -> bool:
        return (
            t.device.type == "cpu"
            and t.dtype in _DTYPES
            and t.is_contiguous()
            and t.numel() * t.element_size() <= SLOT_BYTES
        )

    def reduce(self, t: torch.Tensor) -> None:
        self.seq += 1
        code = _DTYPES[t.dtype]
        args = (self.base, SLOT_BYTES, self.rank, self.world, self.seq, t.data_ptr(), t.numel(), code)
        late = self.call(*args, TIMEOUT_S)
        if late >= 0:
            raise RuntimeError(
                f"shared-memory all-reduce (call {self.seq}, rank {self.rank} of {self.world}): rank {late} "
                f"did not arrive within {TIMEOUT_S:g} s; a rank died or the ranks' collectives differ "
                f"(set {ENV}=0 to all-reduce through torch.distributed)"
            )

    def close(self) -> None:
        self._unmap()


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The C side, built and loaded once; the reason as a string where it cannot be."""
    from kernelize.codegen import cpu_build
    from kernelize.codegen.template import load_template

    try:
        lib = cpu_build.load(cpu_build.build_shared_object(load_template("cpu_shm_allreduce.cpp"), "shm"))
    except (RuntimeError, OSError) as e:  # no compiler (CompilerNotFoundError), a failed build or load
        return f"its C side did not build or load ({type(e).__name__}: {str(e).splitlines()[0]})"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kz_shm_map.argtypes, lib.kz_shm_map.restype = [ctypes.c_char_p, i64, ctypes.c_int], ptr
    lib.kz_shm_unlink.argtypes, lib.kz_shm_unlink.restype = [ctypes.c_char_p], ctypes.c_int
    lib.kz_shm_unmap.argtypes, lib.kz_shm_unmap.restype = [ptr, i64], ctypes.c_int
    args = [ptr, i64, ctypes.c_int, ctypes.c_int, i64, ptr, i64, ctypes.c_int, ctypes.c_double]
    lib.kz_shm_all_reduce.argtypes, lib.kz_shm_all_reduce.restype = args, ctypes.c_int
    assert lib.kz_shm_header_bytes() == 4096 and TOKEN_AT >= 64 * MAX_WORLD
    return lib


def _open(group: Any) -> Segment | None:
    """This rank's mapping of `group`'s segment, made and shared collectively; None (logged) where the
    group all-reduces through torch.distributed."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lib = _library()
    here = f"{ENV}=0" if not enabled() else lib if isinstance(lib, str) else None
    views: list[Any] = [None] * world
    dist.all_gather_object(views, (socket.gethostname(), here), group=group)
    why = _refusal(views)
    seg = None
    if why is None:
        seg, why = _attach(lib, group, rank, world)
    if why is not None:
        logger.info("tensor-parallel all-reduce over %d ranks through torch.distributed: %s", world, why)
        return None
    logger.info("tensor-parallel all-reduce over %d ranks through shared memory (%s)", world, seg.name)
    return seg


def _refusal(views: list[tuple[str, str | None]]) -> str | None:
    """Why a group whose ranks gave these (hostname, reason or None) falls back, or None."""
    if not 2 <= len(views) <= MAX_WORLD:
        return f"{len(views)} ranks (the segment serves 2 to {MAX_WORLD})"
    refused = [(r, why) for r, (_, why) in enumerate(views) if why is not None]
    if refused:
        return f"rank {refused[0][0]}: {refused[0][1]}"
    hosts = sorted({host for host, _ in views})
    return None if len(hosts) == 1 else f"the ranks run on {len(hosts)} hosts ({', '.join(hosts)})"


def _attach(lib: ctypes.CDLL, group: Any, rank: int, world: int) -> tuple[Segment | None, str | None]:
    """Rank 0 creates the segment, every rank maps it and checks rank 0's token, rank 0 unlinks the name
    once all have answered (also when a peer fails), so nothing outlives this call in /dev/shm."""
    size = 4096 + 2 * world * SLOT_BYTES
    base, msg = None, [None, secrets.token_hex(8)]
    try:
        if rank == 0:
            msg[0] = f"/kz_ar_{os.getpid()}_{msg[1]}"
            base = lib.kz_shm_map(msg[0].encode(), size, 1)
            if base:
                ctypes.memmove(base + TOKEN_AT, msg[1].encode(), 16)
            else:
                msg[0] = None
        dist.broadcast_object_list(msg, group=group, group_src=0)
        name, token = msg
        if rank != 0 and name is not None:
            base = lib.kz_shm_map(name.encode(), size, 0)
        ok: list[Any] = [None] * world
        mine = bool(base) and ctypes.string_at(base + TOKEN_AT, 16) == token.encode()
        dist.all_gather_object(ok, mine, group=group)
    finally:
        if rank == 0 and msg[0] is not None:
            lib.kz_shm_unlink(msg[0].encode())
    if all(ok):
        return Segment(lib, base, size, name, rank, world), None
    if base:
        lib.kz_shm_unmap(base, size)
    failed = [r for r, good in enumerate(ok) if not good]
    return None, f"the shared-memory segment could not be made or mapped on ranks {failed}"
