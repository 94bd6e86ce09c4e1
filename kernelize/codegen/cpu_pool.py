"""Max and average pooling over NHWC f32 on the CPU: one compiled function (``templates/cpu_pool.cpp``)
for every pool of every graph, sizes passed at run time, global sums and means over the image included;
in the same library, the channel gather that replayed runs use for a layout view between two convs that
reorders channels (:func:`gather_call`).

Why not torch: its channels-last max pool took 0.28 ms for ShuffleNet's stem pool (24 x 112 x 112 -> 56 x
56, 1 thread) and the reference's average pool with ``count_include_pad`` pads a copy and divides by a
second pool of ones; ShuffleNet v1's four pools took 1.4 ms of kernelize's ~8 ms against onnxruntime's
0.16 ms. The window is clipped to the input once per output pixel and each tap is one simd loop over the
pixel's contiguous channels.

Example:
    >>> y = pool(node, x_nhwc, {})  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Mapping, Sequence

import torch

from kernelize.codegen import cpu_build
from kernelize.codegen.template import fill, load_template
from kernelize.ir.graph import Node, Op
from kernelize.ir.ops import PoolArgs
from kernelize.ir.shapes import bind
from kernelize.runtime.backend import CCall

KINDS = {"max": (0, True), "avg": (1, False)}  # pool kind: (kz_pool's code, whether it may be dilated)


def source() -> str:
    """The C++ source of ``kz_pool``."""
    return fill(load_template("cpu_pool.cpp"), PRELUDE=load_template("cpu_prelude.h"))


_LIBRARY_LOCK = threading.Lock()


def library() -> ctypes.CDLL:
    """The library of ``kz_pool``, ``kz_to_nhwc`` and ``kz_channel_gather``, compiled once (disk-cached like
    every kernel; a backend starts the build beside a graph's kernels when they will call it)."""
    with _LIBRARY_LOCK:
        return _library()


@functools.cache
def _library() -> ctypes.CDLL:
    from kernelize.codegen.cpu_build import build_shared_object, load

    return load(build_shared_object(source(), "kz_pool"))


@functools.cache
def _pool_fn():
    """``kz_pool``."""
    fn = library().kz_pool
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    return fn


def supports(node: Node, x: torch.Tensor) -> bool:
    """Whether :func:`pool` runs ``node`` on ``x``: f32 on the CPU, no dilated average."""
    a: PoolArgs = node.arg
    dilated = KINDS[a.kind][1]
    return x.device.type == "cpu" and x.dtype == torch.float32 and (dilated or a.dilation == (1, 1))


def pool(node: Node, x: torch.Tensor, env: Mapping[str, int]) -> torch.Tensor:
    """The POOL ``node`` of NCHW-shaped ``x`` (any layout), as a channels-last tensor of the node's shape."""
    assert supports(node, x), f"cpu pool of {node}"
    x = x.contiguous(memory_format=torch.channels_last)
    n, c = x.shape[:2]
    oh, ow = bind(node.shape, dict(env))[2:]
    y = torch.empty((n, oh, ow, c), dtype=x.dtype).permute(0, 3, 1, 2)
    d = _dims(node, tuple(x.shape), (oh, ow))
    if _pool_fn()(x.data_ptr(), y.data_ptr(), d, cpu_build.threads()):
        raise RuntimeError(_error(node, d))
    return y


def is_global(node: Node) -> bool:
    """Whether ``node`` is a SUM or MEAN over the two image axes of an NCHW-shaped value (a global average
    pool: the layout pass leaves it to the library when the value's channels are its inner axis)."""
    return node.op in (Op.SUM, Op.MEAN) and node.src[0].rank == 4 and node.arg == (2, 3)


def global_supports(node: Node, x: torch.Tensor) -> bool:
    """Whether :func:`global_reduce` runs ``node`` on ``x``: a global reduction of f32 on the CPU."""
    return is_global(node) and x.dim() == 4 and x.device.type == "cpu" and x.dtype == torch.float32


def global_reduce(node: Node, x: torch.Tensor, env: Mapping[str, int]) -> torch.Tensor:
    """The global SUM / MEAN ``node`` of ``x`` (any layout; read NHWC) as an ``[N, C, 1, 1]`` tensor: one
    pooling window over the whole image, each pixel's channels one simd loop. As fast as torch's mean here
    (MobileNet v1's 512 x 7 x 7: 20-25 us a call either way); what it buys is the replayed run's C call
    (:func:`global_c_call`) where torch's op ended a batch."""
    assert global_supports(node, x), f"cpu global reduction of {node}"
    x = x.contiguous(memory_format=torch.channels_last)
    n, c = x.shape[:2]
    y = torch.empty((n, c, 1, 1), dtype=x.dtype)
    d = _global_dims(node.op, tuple(x.shape))
    if _pool_fn()(x.data_ptr(), y.data_ptr(), d, cpu_build.threads()):
        raise RuntimeError(f"cpu global {node.op} rejected sizes {tuple(d)}")
    return y


def global_c_call(node: Node, x: torch.Tensor, y: torch.Tensor) -> CCall | None:
    """:func:`global_reduce` from the NHWC buffer ``x`` into ``y`` (``N x C`` floats in a row, whatever
    its view), for ``kz_replay``; None where it would not run."""
    if not global_supports(node, x) or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    if not y.is_contiguous() or y.dtype != x.dtype or y.numel() != x.shape[0] * x.shape[1]:
        return None
    d = _global_dims(node.op, tuple(x.shape))
    address = ctypes.cast(_pool_fn(), ctypes.c_void_p).value
    return CCall(address, (x.data_ptr(), y.data_ptr(), ctypes.addressof(d)), f"cpu global {node.op} failed")


@functools.cache
def _global_dims(op: Op, x_shape: tuple[int, ...]) -> ctypes.Array:
    """``kz_pool``'s sizes for one window over the whole image (kind 1 averages, 2 sums)."""
    n, c, h, w = x_shape
    return (ctypes.c_int64 * 18)(n, h, w, c, 1, 1, h, w, 1, 1, 0, 0, 0, 0, 1, 1, 1 if op is Op.MEAN else 2, 0)


def c_call(node: Node, x: torch.Tensor, y: torch.Tensor) -> CCall | None:
    """The call :func:`pool` makes from the NHWC buffer ``x`` into the NHWC buffer ``y``, for ``kz_replay``
    (a graph's pools then run in its replayed C run, with no Python step and no fresh output); None when
    :func:`pool` would not run ``node`` on ``x`` or either buffer is not channels-last."""
    cl = torch.channels_last
    if not supports(node, x) or not (x.is_contiguous(memory_format=cl) and y.is_contiguous(memory_format=cl)):
        return None
    d = _dims(node, tuple(x.shape), tuple(y.shape[2:]))
    address = ctypes.cast(_pool_fn(), ctypes.c_void_p).value
    return CCall(address, (x.data_ptr(), y.data_ptr(), ctypes.addressof(d)), _error(node, d))


@functools.cache
def _fn(name: str):
    """``kz_channel_gather`` or ``kz_to_nhwc``, from the same library as ``kz_pool``."""
    fn = getattr(library(), name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    return fn


def to_nhwc_call(y: torch.Tensor, x: torch.Tensor | None = None) -> CCall | None:
    """The replayed call copying the contiguous NCHW f32 tensor ``x`` of ``y``'s shape into the NHWC f32
    ``y``; without ``x``, its pointer (the first argument) is patched per run (a graph input read by a
    conv). None for other tensors."""
    nhwc = y.is_contiguous(memory_format=torch.channels_last)
    if y.dtype != torch.float32 or y.device.type != "cpu" or not nhwc:
        return None
    if x is not None and (x.dtype != y.dtype or x.shape != y.shape or not x.is_contiguous()):
        return None
    n, c, h, w = y.shape
    d = (ctypes.c_int64 * 3)(n, c, h * w)
    address = ctypes.cast(_fn("kz_to_nhwc"), ctypes.c_void_p).value
    args = (0 if x is None else x.data_ptr(), y.data_ptr(), ctypes.addressof(d))
    return CCall(address, args, "cpu NHWC copy failed", keep=(d,) if x is None else (d, x))


def gather_call(channels: Sequence[int], x: torch.Tensor, y: torch.Tensor) -> CCall | None:
    """The replayed call writing ``y[:, c] = x[:, channels[c]]`` between NHWC f32 buffers of the same
    batch and image size (a layout view that reorders or selects channels); None for other buffers. The
    call's sizes array rides in ``CCall.keep``."""
    cl = torch.channels_last
    fits = x.dtype == y.dtype == torch.float32 and x.device.type == y.device.type == "cpu"
    if not fits or x.shape[::2] != y.shape[::2] or x.shape[3] != y.shape[3] or len(channels) != y.shape[1]:
        return None
    if not (x.is_contiguous(memory_format=cl) and y.is_contiguous(memory_format=cl)):
        return None
    n, c, h, w = x.shape
    d = (ctypes.c_int64 * (3 + len(channels)))(n * h * w, c, len(channels), *channels)
    address = ctypes.cast(_fn("kz_channel_gather"), ctypes.c_void_p).value
    error = f"cpu channel gather rejected channel indices {tuple(channels)} of {c} channels"
    return CCall(address, (x.data_ptr(), y.data_ptr(), ctypes.addressof(d)), error, keep=(d,))


@functools.cache
def _dims(node: Node, x_shape: tuple[int, ...], out: tuple[int, int]) -> ctypes.Array:
    """``kz_pool``'s sizes argument (cached: a replayed call keeps its address for the graph's life)."""
    a: PoolArgs = node.arg
    n, c, h, w = x_shape
    top, left, bottom, right = a.padding
    values = (n, h, w, c, *out, *a.kernel, *a.stride, top, left, bottom, right, *a.dilation)
    return (ctypes.c_int64 * 18)(*values, KINDS[a.kind][0], int(a.count_pad))


def _error(node: Node, d: ctypes.Array) -> str:
    return f"cpu pool kernel rejected {node.arg} at sizes {tuple(d)}"


__all__ = [
    "c_call",
    "gather_call",
    "global_c_call",
    "global_reduce",
    "global_supports",
    "is_global",
    "pool",
    "source",
    "supports",
    "to_nhwc_call",
]
