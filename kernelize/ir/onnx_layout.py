"""ONNX converters for shapes, layout and data movement: Reshape, Slice, Gather, Pad, Shape, Constant, ...

Opset differences are handled inside each converter (Slice/Pad/Split/Squeeze/Unsqueeze take attributes in
old opsets and inputs in new ones). Negative-step slices become ``flip`` + ``slice``; reflect/edge/wrap
padding becomes a ``gather`` with a load-time index table; ``GatherElements`` gathers from the flattened
data with a flat index computed at run time.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Node
from kernelize.ir.onnx_context import (
    Converter,
    NodeContext,
    sym_or_const,
    to_dtype,
)
from kernelize.ir.shapes import Dim, Sym, broadcast_shapes, is_static, normalize_axis, numel

_TO_END = 2**31 - 1  # exporters write INT32_MAX or INT64_MAX for "to the end"


def _static(ctx: NodeContext, shape, what: str) -> tuple[int, ...]:
    if not is_static(shape):
        raise ctx.unsupported(f"{what} needs static sizes, got {[str(d) for d in shape]}")
    return tuple(shape)


# -- reshaping -----------------------------------------------------------------------------------------------
def _reshape(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    shape = ctx.dims(1) if ctx.opset >= 5 else list(ctx.attr("shape"))
    if not ctx.attr("allowzero", 0):
        shape = [x.shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(shape)]
    return ctx.g.view(x, shape)


def _flatten(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    axis = ctx.attr("axis", 1)
    axis = axis + x.rank if axis < 0 else axis
    return ctx.g.view(x, (numel(x.shape[:axis]), numel(x.shape[axis:])))


def _transpose(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    return ctx.g.permute(x, ctx.attr("perm") or list(reversed(range(x.rank))))


def _squeeze_axes(ctx: NodeContext) -> list[int] | None:
    return ctx.ints(1, "axes") if ctx.opset >= 13 else ctx.attr("axes")


def _squeeze(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    axes = _squeeze_axes(ctx)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = {normalize_axis(a, x.rank) for a in axes}
    if any(x.shape[a] != 1 for a in axes):
        raise ValueError(f"cannot squeeze axes {sorted(axes)} of shape {list(x.shape)}: not all of size 1")
    return ctx.g.view(x, [d for i, d in enumerate(x.shape) if i not in axes])


def _unsqueeze(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    axes = _squeeze_axes(ctx)
    rank = x.rank + len(axes)
    axes = {normalize_axis(a, rank) for a in axes}
    dims = iter(x.shape)
    return ctx.g.view(x, [1 if i in axes else next(dims) for i in range(rank)])


def _expand(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    return ctx.g.broadcast(x, broadcast_shapes(x.shape, ctx.dims(1)))


# -- slicing -------------------------------------------------------------------------------------------------
def slice_axis(ctx: NodeContext, x: Node, axis: int, start: int, end: int, step: int) -> Node:
    """ONNX/numpy ``x[start:end:step]`` along ``axis``, any step sign."""
    g, d = ctx.g, x.shape[axis]
    if step == 0:
        raise ValueError("slice step must not be 0")
    if isinstance(d, Sym):
        if step == 1 and start == 0 and end >= _TO_END:
            return x
        raise ctx.unsupported(f"slicing symbolic dimension {d} (only whole-axis slices are supported)")
    idx = range(*slice(start, end, step).indices(d))
    if step > 0:
        return g.slice(x, axis, idx.start, idx.start + len(idx) * step if len(idx) else idx.start, step)
    first = d - 1 - idx.start if len(idx) else 0
    return g.slice(g.flip(x, [axis]), axis, first, first + len(idx) * -step if len(idx) else first, -step)


def _slice(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    if ctx.opset < 10:
        starts, ends, axes, steps = ctx.attr("starts"), ctx.attr("ends"), ctx.attr("axes"), None
    else:
        starts, ends = ctx.ints(1, "starts"), ctx.ints(2, "ends")
        axes, steps = ctx.ints(3, "axes"), ctx.ints(4, "steps")
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(f"starts {starts}, ends {ends}, axes {axes}, steps {steps} differ in length")
    for s, e, a, st in zip(starts, ends, axes, steps):
        x = slice_axis(ctx, x, normalize_axis(a, x.rank), s, e, st)
    return x


def _split_sizes(ctx: NodeContext, d: Dim) -> list[int]:
    split = ctx.ints(1, "split") if ctx.opset >= 13 else ctx.attr("split")
    if isinstance(d, Sym):
        raise ctx.unsupported(f"splitting symbolic dimension {d}")
    if split:
        return list(split)
    n = ctx.attr("num_outputs") or len(ctx.node.output)
    size = -(-d // n)
    return [size] * (d // size) + ([d % size] if d % size else [])


def _split(ctx: NodeContext) -> tuple[Node, ...]:
    x = ctx.x(0)
    axis = normalize_axis(ctx.attr("axis", 0), x.rank)
    sizes = _split_sizes(ctx, x.shape[axis])
    if sum(sizes) != x.shape[axis]:
        raise ValueError(f"split sizes {sizes} do not add up to dimension {x.shape[axis]} of {list(x.shape)}")
    outs, start = [], 0
    for s in sizes:
        outs.append(ctx.g.slice(x, axis, start, start + s))
        start += s
    return tuple(outs)


def _concat(ctx: NodeContext) -> Node:
    xs = [ctx.x(i) for i in range(len(ctx)) if ctx.has(i)]
    return ctx.g.concat(xs, ctx.attr("axis", 1 if ctx.opset < 4 else None))  # optional, default 1 in Concat-1


# -- gathers -------------------------------------------------------------------------------------------------
def _gather(ctx: NodeContext) -> Node:
    return ctx.g.gather(ctx.x(0), ctx.x(1), ctx.attr("axis", 0))


def _flat_offsets(shape: tuple[int, ...], out_shape: tuple[int, ...], skip: int) -> torch.Tensor:
    """For every position of ``out_shape``: its flat offset in ``shape`` with axis ``skip`` contributing 0."""
    strides = np.cumprod((shape[1:] + (1,))[::-1])[::-1]
    grids = np.indices(out_shape, dtype=np.int64) if out_shape else np.zeros((0,), np.int64)
    base = sum(grids[a] * strides[a] for a in range(len(shape)) if a != skip) if len(shape) > 1 else 0
    return torch.as_tensor(np.asarray(base, dtype=np.int64) + np.zeros(out_shape, np.int64))


def _gather_elements(ctx: NodeContext) -> Node:
    g, x, idx = ctx.g, ctx.x(0), ctx.x(1)
    shape = _static(ctx, x.shape, "GatherElements data")
    ishape = _static(ctx, idx.shape, "GatherElements indices")
    axis = normalize_axis(ctx.attr("axis", 0), x.rank)
    d, stride = shape[axis], int(np.prod(shape[axis + 1 :], dtype=np.int64))
    idx = g.cast(idx, DType.I64)
    idx = g.where(g.lt(idx, 0), g.add(idx, d), idx)
    flat = g.add(g.mul(idx, stride), g.const(_flat_offsets(shape, ishape, axis)))
    # an out-of-range index must not read a neighbour: send it out of range of the flat data too
    flat = g.where(g.or_(g.lt(idx, 0), g.ge(idx, d)), int(np.prod(shape)), flat)
    return g.gather(g.view(x, (-1,)), flat, 0)


def _gather_nd(ctx: NodeContext) -> Node:
    g, x, idx = ctx.g, ctx.x(0), ctx.x(1)
    shape = _static(ctx, x.shape, "GatherND data")
    ishape = _static(ctx, idx.shape, "GatherND indices")
    b = ctx.attr("batch_dims", 0)
    k = ishape[-1]
    inner = shape[b : b + k]
    rest = shape[b + k :]
    idx = g.cast(idx, DType.I64)
    flat = bad = None
    for j, size in enumerate(inner):
        ij = g.view(g.slice(idx, -1, j, j + 1), ishape[:-1])
        ij = g.where(g.lt(ij, 0), g.add(ij, size), ij)
        out_of_range = g.or_(g.lt(ij, 0), g.ge(ij, size))
        bad = out_of_range if bad is None else g.or_(bad, out_of_range)
        term = g.mul(ij, int(np.prod(inner[j + 1 :], dtype=np.int64)))
        flat = term if flat is None else g.add(flat, term)
    if flat is None:
        flat = g.const(torch.zeros(ishape[:-1], dtype=torch.int64))
    nb = int(np.prod(shape[:b], dtype=np.int64))
    ninner = int(np.prod(inner, dtype=np.int64))
    if b:
        batch = torch.arange(nb).reshape(shape[:b] + (1,) * (len(ishape) - 1 - b)) * ninner
        flat = g.add(flat, g.const(batch))
    if bad is not None:  # an out-of-range index must fail in the gather, not read a neighbour
        flat = g.where(bad, nb * ninner, flat)
    data = g.view(x, (nb * ninner, *rest))
    return g.gather(data, flat, 0)


# -- padding -------------------------------------------------------------------------------------------------
def _pad_index(mode: str, d: int, lo: int, hi: int) -> torch.Tensor:
    i = np.arange(-lo, d + hi)
    if mode == "edge":
        i = np.clip(i, 0, d - 1)
    elif mode == "wrap":
        i = np.mod(i, d)
    else:  # reflect: mirror without repeating the edge
        period = 2 * (d - 1) if d > 1 else 1
        i = np.mod(i, period)
        i = np.where(i >= d, period - i, i)
    return torch.as_tensor(i, dtype=torch.int64)


def _pad(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    mode = ctx.attr("mode", "constant")
    if ctx.opset < 11:
        pads, value = ctx.attr("pads") or ctx.attr("paddings"), ctx.attr("value", 0.0)
        axes = None
    else:
        pads = ctx.ints(1, "pads")
        value = ctx.scalar(2, 0, "constant_value") if ctx.has(2) and ctx.const(2) is not None else 0
        axes = ctx.ints(3, "axes")
    axes = list(range(x.rank)) if axes is None else [normalize_axis(a, x.rank) for a in axes]
    if len(pads) != 2 * len(axes):
        raise ValueError(f"pads {pads} must hold a begin and an end for each of the {len(axes)} axes")
    pairs = [(0, 0)] * x.rank
    for i, a in enumerate(axes):
        pairs[a] = (pads[i], pads[i + len(axes)])
    if mode == "constant":
        if not x.dtype.is_float and value != int(value):
            raise ValueError(f"pad value {value} does not fit dtype {x.dtype}")
        if ctx.opset >= 11 and ctx.has(2) and ctx.const(2) is None:  # run-time value: pad, then select
            inside = g.pad(g.const(torch.ones(_static(ctx, x.shape, "Pad"), dtype=torch.bool)), pairs, 0)
            return g.where(inside, g.pad(x, pairs, 0), g.view(ctx.x(2), ()))
        return g.pad(x, pairs, value)
    if mode not in ("edge", "reflect", "wrap"):
        raise ctx.unsupported(f"pad mode {mode!r} (supported: constant, edge, reflect, wrap)")
    for a, (lo, hi) in enumerate(pairs):
        if lo or hi:
            d = x.shape[a]
            if isinstance(d, Sym):
                raise ctx.unsupported(f"{mode} padding of symbolic dimension {d}")
            if d == 0 or (mode == "reflect" and d == 1 and (lo > 0 or hi > 0)):
                raise ValueError(f"{mode} padding of an axis of size {d}")
            x = g.gather(x, g.const(_pad_index(mode, d, lo, hi)), a)
    return x


def _tile(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    reps = ctx.ints(1, "repeats")
    if len(reps) != x.rank:
        raise ValueError(f"Tile repeats {reps} must have one entry per axis of {list(x.shape)}")
    for a, r in enumerate(reps):
        if r != 1:
            v = g.view(x, (*x.shape[:a], 1, *x.shape[a:]))
            v = g.broadcast(v, (*x.shape[:a], r, *x.shape[a:]))
            x = g.view(v, (*x.shape[:a], r * x.shape[a], *x.shape[a + 1 :]))
    return x


def _depth_to_space(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    if ctx.attr("mode", "DCR") == "DCR":
        v = g.permute(g.view(x, (n, b, b, c // (b * b), h, w)), (0, 3, 4, 1, 5, 2))
    else:
        v = g.permute(g.view(x, (n, c // (b * b), b, b, h, w)), (0, 1, 4, 2, 5, 3))
    return g.view(v, (n, c // (b * b), h * b, w * b))


def _space_to_depth(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    perm = (0, 3, 5, 1, 2, 4) if ctx.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    v = g.permute(g.view(x, (n, c, h // b, b, w // b, b)), perm)
    return g.view(v, (n, c * b * b, h // b, w // b))


# -- shapes and constants ------------------------------------------------------------------------------------
def _shape(ctx: NodeContext):
    dims = list(ctx.shape(0))
    start, end = ctx.attr("start", 0), ctx.attr("end", None)
    return sym_or_const(dims[slice(start, end)])


def _size(ctx: NodeContext):
    return sym_or_const([numel(ctx.shape(0))], scalar=True)


def _constant(ctx: NodeContext):
    for key in ("value_string", "value_strings", "sparse_value"):
        if key in ctx.attrs:
            raise ctx.unsupported(f"Constant with {key} (kernelize has no string or sparse tensors)")
    if "value" in ctx.attrs:
        return ctx.attr("value")
    for key, dtype in (
        ("value_float", torch.float32),
        ("value_floats", torch.float32),
        ("value_int", torch.int64),
        ("value_ints", torch.int64),
    ):
        if key in ctx.attrs:
            return torch.tensor(ctx.attr(key), dtype=dtype)
    raise ValueError("Constant has no value attribute")


def _constant_of_shape(ctx: NodeContext):
    value = ctx.attr("value", torch.zeros(1, dtype=torch.float32)).reshape(())
    dims = ctx.dims(0)
    if is_static(dims) and ctx.fits(dims, DType.from_torch(value.dtype)):
        return torch.full(dims, value.item(), dtype=value.dtype)
    return ctx.g.broadcast(ctx.g.const(value), dims)  # over the folding cap: a run-time broadcast


def _range(ctx: NodeContext):
    vals = [ctx.const(i) for i in range(3)]
    if any(v is None for v in vals):
        raise ctx.unsupported("Range with inputs known only at run time")
    start, limit, delta = (v.item() for v in vals)
    dtype = vals[0].dtype
    if delta == 0:
        raise ValueError("Range with delta 0")
    count = max(0, math.ceil((limit - start) / delta))
    if not ctx.fits((count,), DType.from_torch(dtype)):  # the IR has no run-time Range
        raise ctx.too_large(f"Range({start}, {limit}, {delta})", (count,), DType.from_torch(dtype))
    stash = ctx.attr("stash_type")
    if stash is not None and dtype in (torch.float16, torch.bfloat16):  # count in f32/f64, then round
        compute = to_dtype(stash, "Range stash_type").torch
        first = torch.tensor(start, dtype=compute).item()
        return torch.as_tensor(np.arange(first, float(limit), float(delta))).to(compute).to(dtype)
    return torch.as_tensor(np.arange(start, limit, delta)).to(dtype)  # as the reference: numpy, then cast


def _eye_like(ctx: NodeContext):
    shape = _static(ctx, ctx.shape(0), "EyeLike")
    dtype = to_dtype(ctx.attr("dtype"), "EyeLike dtype") if "dtype" in ctx.attrs else ctx.dtype(0)
    if not ctx.fits(shape, DType.F64):  # numpy builds it in f64 first
        raise ctx.too_large("EyeLike", shape, dtype)
    eye = np.eye(shape[0], shape[1], k=ctx.attr("k", 0))
    return torch.as_tensor(eye).to(dtype.torch)


def _trilu(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    n, m = _static(ctx, x.shape[-2:], "Trilu")
    k = ctx.scalar(1, 0, "k")
    ones = torch.ones(n, m, dtype=torch.bool)
    mask = torch.triu(ones, k) if ctx.attr("upper", 1) else torch.tril(ones, k)
    return g.where(g.const(mask), x, g.scalar(0, x.dtype))


def _one_hot(ctx: NodeContext) -> Node:
    g, idx = ctx.g, ctx.x(0)
    depth = int(ctx.scalar(1, what="depth"))
    values = ctx.x(2)
    axis = normalize_axis(ctx.attr("axis", -1), idx.rank + 1)
    idx = g.cast(idx, DType.I64)
    idx = g.where(g.lt(idx, 0), g.add(idx, depth), idx)
    idx = g.view(idx, (*idx.shape[:axis], 1, *idx.shape[axis:]))
    ar = torch.arange(depth).reshape([depth if a == axis else 1 for a in range(idx.rank)])
    hot = g.eq(idx, g.const(ar))
    off, on = g.view(g.slice(values, 0, 0, 1), ()), g.view(g.slice(values, 0, 1, 2), ())
    return g.where(hot, on, off)


def _compress(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    cond = ctx.const(1)
    if cond is None:
        raise ctx.unsupported("Compress with a condition known only at run time")
    axis = ctx.attr("axis")
    if axis is None:
        x, axis = g.view(x, (-1,)), 0
    keep = torch.nonzero(cond.reshape(-1)).reshape(-1)
    return g.gather(x, g.const(keep), axis)


def _scatter_rows(
    ctx: NodeContext, data: Node, shape: tuple[int, ...], k: int, flat: torch.Tensor, upd: Node
) -> Node:
    """``data`` (static ``shape``) with its rows over the first ``k`` axes at the load-time flat row numbers
    ``flat`` (one per row of ``upd``, viewed ``[len(flat), *shape[k:]]``) replaced by those rows: a gather
    of the updates where a row is written and the data elsewhere (``where``), so the graph keeps one SSA
    value per tensor. Two updates of one row: the later one wins (ONNX leaves it undefined)."""
    if len(flat) == 0:
        return data
    g = ctx.g
    rows, rest = int(np.prod(shape[:k], dtype=np.int64)), shape[k:]
    source = torch.full((rows,), -1, dtype=torch.int64)  # the update each row takes (the latest), or -1
    source.scatter_reduce_(0, flat, torch.arange(len(flat)), reduce="amax")
    hit = g.const((source >= 0).reshape(rows, *(1,) * len(rest)))
    picked = g.gather(g.view(upd, (len(flat), *rest)), g.const(source.clamp(min=0)), 0)
    return g.view(g.where(hit, picked, g.view(data, (rows, *rest))), shape)


def _scatter_index(ctx: NodeContext, op: str) -> torch.Tensor:
    idx = ctx.const(1)
    if idx is None:
        raise ctx.unsupported(f"{op} with indices known only at run time")
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", b"none"):
        raise ctx.unsupported(f"{op} with reduction={reduction!r} (only 'none')")
    return idx.long()


def _scatter_nd(ctx: NodeContext) -> Node:
    idx = _scatter_index(ctx, "ScatterND")
    shape = _static(ctx, ctx.x(0).shape, "ScatterND data")
    k = idx.shape[-1]
    inner = torch.tensor(shape[:k], dtype=torch.int64)
    idx = idx.reshape(-1, k)
    idx = torch.where(idx < 0, idx + inner, idx)
    if ((idx < 0) | (idx >= inner)).any():
        raise ValueError(f"{ctx.describe()}: an index lies outside the data's shape {list(shape)}")
    strides = torch.tensor([int(np.prod(shape[j + 1 : k], dtype=np.int64)) for j in range(k)])
    return _scatter_rows(ctx, ctx.x(0), shape, k, (idx * strides).sum(-1), ctx.x(2))


def _scatter_elements(ctx: NodeContext) -> Node:
    idx = _scatter_index(ctx, "ScatterElements")
    shape = _static(ctx, ctx.x(0).shape, "ScatterElements data")
    axis = normalize_axis(ctx.attr("axis", 0), len(shape))
    idx = torch.where(idx < 0, idx + shape[axis], idx)
    if ((idx < 0) | (idx >= shape[axis])).any():
        raise ValueError(f"{ctx.describe()}: an index lies outside axis {axis} of size {shape[axis]}")
    stride = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    flat = idx * stride + _flat_offsets(shape, tuple(idx.shape), axis)
    size = int(np.prod(shape, dtype=np.int64))
    data = ctx.g.view(ctx.x(0), (size,))
    return ctx.g.view(_scatter_rows(ctx, data, (size,), 1, flat.reshape(-1), ctx.x(2)), shape)


def _nonzero(ctx: NodeContext):
    t = ctx.const(0)
    if t is None:
        raise ctx.unsupported("NonZero of a run-time tensor (its output shape depends on the data)")
    return torch.nonzero(t).T.contiguous() if t.dim() else torch.zeros((0, int(bool(t))), dtype=torch.int64)


LAYOUT_OPS: dict[str, Converter] = {
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Expand": _expand,
    "Slice": _slice,
    "Split": _split,
    "Concat": _concat,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "GatherND": _gather_nd,
    "ScatterND": _scatter_nd,
    "ScatterElements": _scatter_elements,
    "Scatter": _scatter_elements,  # (opset 9-10's name)
    "Pad": _pad,
    "Tile": _tile,
    "DepthToSpace": _depth_to_space,
    "SpaceToDepth": _space_to_depth,
    "Shape": _shape,
    "Size": _size,
    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "Range": _range,
    "EyeLike": _eye_like,
    "Trilu": _trilu,
    "OneHot": _one_hot,
    "Compress": _compress,
    "NonZero": _nonzero,
}

__all__ = ["LAYOUT_OPS", "slice_axis"]
