"""Max and average pooling over NHWC f32 on the CPU: one compiled function (``templates/cpu_pool.cpp``)
for every pool of every graph, sizes passed at run time.

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
from collections.abc import Mapping

import torch

from kernelize.codegen.template import fill, load_template
from kernelize.ir.graph import Node
from kernelize.ir.ops import PoolArgs
from kernelize.ir.shapes import bind

KINDS = {"max": (0, True), "avg": (1, False)}  # pool kind: (kz_pool's code, whether it may be dilated)


def source() -> str:
    """The C++ source of ``kz_pool``."""
    return fill(load_template("cpu_pool.cpp"), PRELUDE=load_template("cpu_prelude.h"))


@functools.cache
def _pool_fn():
    """``kz_pool``, compiled once (disk-cached like every kernel)."""
    from kernelize.codegen.cpu_build import build_shared_object, load

    fn = load(build_shared_object(source(), "kz_pool")).kz_pool
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    return fn


def supports(node: Node, x: torch.Tensor) -> bool:
    """Whether :func:`pool` runs ``node`` on ``x``: f32 on the CPU, no dilated average."""
    a: PoolArgs = node.arg
    dilated = KINDS[a.kind][1]
    return x.device.type == "cpu" and x.dtype == torch.float32 and (dilated or a.dilation == (1, 1))


def pool(node: Node, x: torch.Tensor, env: Mapping[str, int]) -> torch.Tensor:
    """The POOL ``node`` of NCHW-shaped ``x`` (any layout), as a channels-last tensor of the node's shape."""
    a: PoolArgs = node.arg
    assert supports(node, x), f"cpu pool of {node}"
    x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    oh, ow = bind(node.shape, dict(env))[2:]
    y = torch.empty((n, oh, ow, c), dtype=x.dtype).permute(0, 3, 1, 2)
    top, left, bottom, right = a.padding
    values = (n, h, w, c, oh, ow, *a.kernel, *a.stride, top, left, bottom, right, *a.dilation)
    d = (ctypes.c_int64 * 18)(*values, KINDS[a.kind][0], int(a.count_pad))
    if _pool_fn()(x.data_ptr(), y.data_ptr(), d, torch.get_num_threads()):
        raise RuntimeError(f"cpu pool kernel rejected {node.arg} at sizes {tuple(d)}")
    return y


__all__ = ["pool", "source", "supports"]
