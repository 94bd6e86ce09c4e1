"""The second half of the torch front end's aten table: layout, reductions, norms, matmul, conv and pool.

Handlers register into :data:`kernelize.ir.aten_table.ATEN` (see that module for the handler contract).

Example:
    >>> ATEN[torch.ops.aten.permute.default]  # doctest: +SKIP
    <function _permute ...>
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernelize.ir.aten_table import ATEN, Handler, Lazy, handles
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Node, Op
from kernelize.ir.shapes import Sym, normalize_axis, numel

aten = torch.ops.aten


# -- layout -------------------------------------------------------------------------------------------------
@handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(t, x, shape):
    return t.g.view(x, tuple(shape))


@handles(aten.expand.default)
def _expand(t, x, shape, *, implicit=False):
    shape = list(shape)
    off = len(shape) - x.rank
    shape = [x.shape[i - off] if (d == -1 and i >= off) else d for i, d in enumerate(shape)]
    return t.g.broadcast(x, shape)


@handles(aten.permute.default)
def _permute(t, x, dims):
    return t.g.permute(x, dims)


@handles(aten.t.default)
def _t(t, x):
    return t.g.transpose(x, 0, 1) if x.rank == 2 else x


@handles(aten.transpose.int)
def _transpose(t, x, a, b):
    return t.g.transpose(x, a, b) if x.rank else x


@handles(aten.mT.default, aten.mH.default, aten.adjoint.default)
def _mT(t, x):
    return t.g.transpose(x, -2, -1)


@handles(aten.movedim.int)
def _movedim(t, x, src, dst):
    perm = list(range(x.rank))
    perm.insert(normalize_axis(dst, x.rank), perm.pop(normalize_axis(src, x.rank)))
    return t.g.permute(x, perm)


@handles(aten.unsqueeze.default)
def _unsqueeze(t, x, dim):
    dim = normalize_axis(dim, x.rank + 1)
    return t.g.view(x, x.shape[:dim] + (1,) + x.shape[dim:])


@handles(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(t, x, dims=None):
    dims = range(x.rank) if dims is None else [dims] if isinstance(dims, int) else dims
    drop = {normalize_axis(d, x.rank) for d in dims} if x.rank else set()
    return t.g.view(x, tuple(d for i, d in enumerate(x.shape) if not (i in drop and d == 1)))


@handles(aten.flatten.using_ints)
def _flatten(t, x, start=0, end=-1):
    if x.rank == 0:
        return t.g.view(x, (1,))
    start, end = normalize_axis(start, x.rank), normalize_axis(end, x.rank)
    return t.g.view(x, x.shape[:start] + (numel(x.shape[start : end + 1]),) + x.shape[end + 1 :])


@handles(aten.unflatten.int)
def _unflatten(t, x, dim, sizes):
    dim = normalize_axis(dim, x.rank)
    return t.g.view(x, x.shape[:dim] + tuple(sizes) + x.shape[dim + 1 :])


def _bound(t, x: Node, axis: int, v: Any) -> int | None:
    """A slice bound as an int (None for 'to the end'); symbolic bounds only when they equal the size."""
    if v is None or v == x.shape[axis] or (isinstance(v, int) and v >= 1 << 62):  # 1 << 63 - 1: "to the end"
        return None
    if isinstance(v, Sym):
        raise t.fail(f"slice bound {v} of symbolic size {x.shape[axis]} is not supported")
    return int(v)


@handles(aten.slice.Tensor)
def _slice(t, x, dim=0, start=None, end=None, step=1):
    dim = normalize_axis(dim, x.rank)
    return t.g.slice(x, dim, _bound(t, x, dim, start) or 0, _bound(t, x, dim, end), step)


@handles(aten.narrow.default)
def _narrow(t, x, dim, start, length):
    return t.g.slice(x, dim, start, start + length)


@handles(aten.select.int)
def _select(t, x, dim, index):
    dim = normalize_axis(dim, x.rank)
    if isinstance(x.shape[dim], Sym):
        raise t.fail(f"select on symbolic dimension {x.shape[dim]} is not supported")
    index = index % x.shape[dim]
    s = t.g.slice(x, dim, index, index + 1)
    return t.g.view(s, x.shape[:dim] + x.shape[dim + 1 :])


def _pieces(t, x: Node, sizes: Sequence[int], dim: int) -> tuple[Lazy, ...]:
    """Slices of ``sizes`` along ``dim``, built only when read (unused pieces never enter the graph)."""
    dim = normalize_axis(dim, x.rank)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(Lazy(lambda a=a, n=n: t.g.slice(x, dim, a, a + n)) for a, n in zip(starts, sizes))


def _static(t, x: Node, dim: int) -> int:
    d = x.shape[normalize_axis(dim, x.rank)]
    if isinstance(d, Sym):
        raise t.fail(f"splitting symbolic dimension {d} is not supported")
    return d


@handles(aten.split.Tensor)
def _split(t, x, size, dim=0):
    n = _static(t, x, dim)
    return _pieces(t, x, [min(size, n - i) for i in range(0, n, size)] or [0], dim)


@handles(aten.split_with_sizes.default)
def _split_sizes(t, x, sizes, dim=0):
    return _pieces(t, x, sizes, dim)


@handles(aten.tensor_split.sections)
def _tensor_split(t, x, sections, dim=0):
    n = _static(t, x, dim)
    return _pieces(t, x, [n // sections + (i < n % sections) for i in range(sections)], dim)


@handles(aten.tensor_split.indices)
def _tensor_split_at(t, x, indices, dim=0):
    n = _static(t, x, dim)
    bounds = [min(max(i % n if i < 0 else i, 0), n) for i in indices]
    edges = [0, *bounds, n]
    return _pieces(t, x, [max(b - a, 0) for a, b in zip(edges, edges[1:])], dim)


@handles(aten.chunk.default)
def _chunk(t, x, chunks, dim=0):
    n = _static(t, x, dim)
    size = -(-n // chunks)
    return _split(t, x, max(size, 1), dim)


@handles(aten.unbind.int)
def _unbind(t, x, dim=0):
    return tuple(Lazy(lambda i=i: _select(t, x, dim, i)) for i in range(_static(t, x, dim)))


@handles(aten.cat.default)
def _cat(t, xs, dim=0):
    dtype = t.out_dtype()
    xs = [t.cast(x, dtype) for x in xs if not (x.rank == 1 and x.shape[0] == 0)]  # torch skips legacy empties
    return t.g.concat(xs, dim)


@handles(aten.stack.default)
def _stack(t, xs, dim=0):
    return _cat(t, [_unsqueeze(t, x, normalize_axis(dim, x.rank + 1)) for x in xs], dim)


@handles(aten.flip.default)
def _flip(t, x, dims):
    return t.g.flip(x, dims)


@handles(aten.constant_pad_nd.default)
def _pad(t, x, pad, value=0):
    pads = [(0, 0)] * x.rank
    for i in range(len(pad) // 2):
        pads[x.rank - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return t.g.pad(x, pads, value)


@handles(aten.repeat.default)
def _repeat(t, x, repeats):
    x = t.g.view(x, (1,) * (len(repeats) - x.rank) + x.shape)
    inter = tuple(v for d in x.shape for v in (1, d))
    big = tuple(v for r, d in zip(repeats, x.shape) for v in (r, d))
    y = t.g.broadcast(t.g.view(x, inter), big)
    return t.g.view(y, tuple(d * r for r, d in zip(repeats, x.shape)))


def _no_wrap(t, index: Node) -> Node:
    """``index`` for a gather that must not wrap negatives. torch's embedding and index_select raise on a
    negative index, where the graph's gather (``numpy.take``) counts it from the end: a negative becomes the
    dtype's lowest value, still out of range after the gather adds the axis size, so the CPU kernel and the
    reference raise an IndexError (the GPU kernels set their error flag, as for any index out of range)."""
    lowest = -(1 << (8 * index.dtype.itemsize - 1))
    return t.g.where(t.g.binary(Op.LT, index, 0), lowest, index)


@handles(aten.index_select.default)
def _index_select(t, x, dim, index):
    return t.g.gather(x, _no_wrap(t, index), dim)


@handles(aten.embedding.default)
def _embedding(t, weight, index, *args):
    return t.g.gather(weight, _no_wrap(t, index), 0)


@handles(aten.index.Tensor)
def _index(t, x, indices):
    used = [i for i, v in enumerate(indices) if v is not None]
    if len(used) != 1 or indices[used[0]].dtype is DType.BOOL:
        raise t.fail("only indexing with one integer index tensor is supported (x[:, idx])")
    return t.g.gather(x, indices[used[0]], used[0])


# -- reductions ---------------------------------------------------------------------------------------------
def _axes(dims: Any) -> Any:
    return None if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0) else dims


def _reduce(op: Op) -> Handler:
    def handler(t, x, dims=None, keepdim=False, *, dtype=None):
        return t.g.reduce(op, t.cast(x, t.out_dtype()), _axes(dims), keepdim)

    return handler


for _op, _ir in (
    (aten.sum.default, Op.SUM),
    (aten.sum.dim_IntList, Op.SUM),
    (aten.mean.default, Op.MEAN),
    (aten.mean.dim, Op.MEAN),
    (aten.amax.default, Op.REDUCE_MAX),
    (aten.amin.default, Op.REDUCE_MIN),
    (aten.max.default, Op.REDUCE_MAX),
    (aten.min.default, Op.REDUCE_MIN),
):
    ATEN[_op] = _reduce(_ir)


@handles(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def _any_all(t, x, dims=None, keepdim=False):
    is_any = t.node.target in (aten.any.default, aten.any.dim, aten.any.dims)
    flags = t.g.cast(x if x.dtype is DType.BOOL else t.g.ne(x, 0), DType.I32)
    return t.g.gt(t.g.reduce(Op.REDUCE_MAX if is_any else Op.REDUCE_MIN, flags, _axes(dims), keepdim), 0)


@handles(aten.prod.default, aten.prod.dim_int)
def _prod(t, x, dim=None, keepdim=False, *, dtype=None):
    return t.g.reduce(Op.PROD, t.cast(x, t.out_dtype()), dim, keepdim)


@handles(aten.max.dim, aten.min.dim)
def _max_dim(t, x, dim, keepdim=False):
    is_max = t.node.target is aten.max.dim
    values = t.g.reduce(Op.REDUCE_MAX if is_max else Op.REDUCE_MIN, x, dim, keepdim)
    return values, Lazy(lambda: t.g.reduce(Op.ARGMAX if is_max else Op.ARGMIN, x, dim, keepdim))


@handles(aten.argmax.default, aten.argmin.default)
def _argmax(t, x, dim=None, keepdim=False):
    op = Op.ARGMAX if t.node.target is aten.argmax.default else Op.ARGMIN
    if dim is None:
        out = t.g.reduce(op, t.g.view(x, (numel(x.shape),)), 0, False)
        return t.g.view(out, (1,) * x.rank) if keepdim else out
    return t.g.reduce(op, x, dim, keepdim)


@handles(aten.topk.default)
def _topk(t, x, k, dim=-1, largest=True, sorted=True):
    """The IR's topk runs along the last axis, largest first (sorted): another axis is moved there and back;
    the smallest are the largest of -x."""
    axis = normalize_axis(dim, x.rank)
    last = axis == x.rank - 1
    perm = [a for a in range(x.rank) if a != axis] + [axis]
    src = x if last else t.g.permute(x, perm)
    if not largest:
        if not x.dtype.is_float:
            raise t.fail("topk(largest=False) of an integer tensor is not supported")
        src = t.g.neg(src)
    values, index = t.g.topk(src, k)
    if not largest:
        values = t.g.neg(values)
    if not last:
        back = [perm.index(a) for a in range(x.rank)]
        values, index = t.g.permute(values, back), t.g.permute(index, back)
    return values, index


def _variance(t, x: Node, dims: Any, correction: Any, keepdim: bool) -> tuple[Node, Node]:
    """(var, mean) as mean((x - mean)^2) * n / (n - correction)."""
    mean = t.g.reduce(Op.MEAN, x, _axes(dims), True)
    d = t.g.sub(x, mean)
    var = t.g.reduce(Op.MEAN, t.g.mul(d, d), _axes(dims), keepdim)
    c = 1 if correction is None else correction
    if c:
        axes = range(x.rank) if _axes(dims) is None else [normalize_axis(a, x.rank) for a in dims]
        n = numel([x.shape[a] for a in axes])
        if isinstance(n, Sym):
            raise t.fail(f"variance with correction {c} over symbolic size {n} is not supported")
        var = t.g.mul(var, n / (n - c)) if n > c else t.g.div(var, 0.0)
    return var, mean if keepdim else t.g.reduce(Op.MEAN, x, _axes(dims), False)


@handles(aten.var.correction, aten.var.dim, aten.var.default)
def _var(t, x, dims=None, unbiased=None, keepdim=False, *, correction=None):
    return _variance(t, x, dims, _correction(unbiased, correction), keepdim)[0]


@handles(aten.std.correction, aten.std.dim, aten.std.default)
def _std(t, x, dims=None, unbiased=None, keepdim=False, *, correction=None):
    return t.g.sqrt(_variance(t, x, dims, _correction(unbiased, correction), keepdim)[0])


@handles(aten.var_mean.correction, aten.var_mean.dim)
def _var_mean(t, x, dims=None, unbiased=None, keepdim=False, *, correction=None):
    return _variance(t, x, dims, _correction(unbiased, correction), keepdim)


@handles(aten.std_mean.correction, aten.std_mean.dim)
def _std_mean(t, x, dims=None, unbiased=None, keepdim=False, *, correction=None):
    var, mean = _variance(t, x, dims, _correction(unbiased, correction), keepdim)
    return t.g.sqrt(var), mean


def _correction(unbiased: Any, correction: Any) -> Any:
    if isinstance(unbiased, bool):
        return int(unbiased)
    return correction


# -- row ops ------------------------------------------------------------------------------------------------
@handles(aten._softmax.default, aten._log_softmax.default)
def _softmax(t, x, dim, half_to_float=False):
    x = t.cast(x, t.out_dtype())
    return (t.g.softmax if t.node.target is aten._softmax.default else t.g.log_softmax)(x, dim)


@handles(aten.softmax.int, aten.log_softmax.int)
def _softmax_int(t, x, dim, dtype=None):
    x = t.cast(x, t.out_dtype())
    return (t.g.softmax if t.node.target is aten.softmax.int else t.g.log_softmax)(x, dim)


def _last_dims(t, x: Node, params: Sequence[Node | None], k: int, build: Callable) -> Node:
    """Run a last-axis row op over the last ``k`` axes by viewing them as one."""
    params = [None if p is None else t.cast(p, x.dtype) for p in params]
    if k == 1:
        return build(x, *params)
    flat = t.g.view(x, x.shape[:-k] + (numel(x.shape[-k:]),))
    params = [None if p is None else t.g.view(p, (numel(p.shape),)) for p in params]
    return t.g.view(build(flat, *params), x.shape)


@handles(aten.native_layer_norm.default)
def _native_layer_norm(t, x, shape, weight, bias, eps):
    k = len(shape)
    y = _last_dims(t, x, [weight, bias], k, lambda v, w, b: t.g.layernorm(v, w, b, eps))
    axes = list(range(x.rank - k, x.rank))

    def stats(which: int) -> Node:
        xf = t.cast(x, DType.F32) if x.dtype.is_float else x
        var, mean = _variance(t, xf, axes, 0, True)
        return mean if which == 0 else t.g.rsqrt(t.g.add(var, eps))

    return y, Lazy(lambda: stats(0)), Lazy(lambda: stats(1))


@handles(aten.layer_norm.default)
def _layer_norm(t, x, shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return _last_dims(t, x, [weight, bias], len(shape), lambda v, w, b: t.g.layernorm(v, w, b, eps))


@handles(aten.rms_norm.default)
def _rms_norm(t, x, shape, weight=None, eps=None):
    eps = torch.finfo(x.dtype.torch).eps if eps is None else eps
    return _last_dims(t, x, [weight], len(shape), lambda v, w: t.g.rmsnorm(v, w, eps))


@handles(
    aten.batch_norm.default,
    aten._native_batch_norm_legit_no_training.default,
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
)
def _batch_norm(t, x, weight, bias, mean, var, *args):
    target = t.node.target
    if target is aten._native_batch_norm_legit_no_training.default:
        training, eps = False, args[1]
    else:
        training, eps = args[0], args[2]
    if training or mean is None:
        raise t.fail("batch norm in training mode: call module.eval() before kernelize.ir.trace")
    cshape = (x.shape[1],) + (1,) * (x.rank - 2)

    def ch(v: Node) -> Node:
        return t.g.view(t.cast(v, x.dtype), cshape)

    y = t.g.mul(t.g.sub(x, ch(mean)), t.g.rsqrt(t.g.add(ch(var), eps)))
    if weight is not None:
        y = t.g.mul(y, ch(weight))
    if bias is not None:
        y = t.g.add(y, ch(bias))
    if target is aten.batch_norm.default:
        return y
    empty = Lazy(lambda: (_ for _ in ()).throw(t.fail("batch norm statistics outputs are not supported")))
    return y, empty, empty


# -- heavy ops ----------------------------------------------------------------------------------------------
@handles(aten.mm.default, aten.bmm.default, aten.matmul.default, aten.dot.default, aten.mv.default)
def _matmul(t, a, b):
    return t.g.matmul(a, b)


@handles(aten.addmm.default, aten.baddbmm.default)
def _addmm(t, bias, a, b, *, beta=1, alpha=1):
    out = t.g.matmul(a, b)
    if alpha != 1:
        out = t.g.mul(out, alpha)
    if beta == 0:
        return out
    return t.g.add(out, bias if beta == 1 else t.g.mul(bias, beta))


@handles(aten.linear.default)
def _linear(t, x, w, b=None):
    out = t.g.matmul(x, t.g.transpose(w, -2, -1) if w.rank == 2 else w)
    return out if b is None else t.g.add(out, b)


def _pair(v: Any) -> tuple[int, int]:
    v = [v] if isinstance(v, int) else list(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


@handles(aten.convolution.default)
def _convolution(t, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise t.fail("transposed convolution is not supported")
    return _conv(t, x, w, bias, stride, padding, dilation, groups)


@handles(aten.conv2d.default, aten.conv1d.default)
def _conv_nd(t, x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    if isinstance(padding, str):
        raise t.fail(f"string padding {padding!r} is not supported")
    return _conv(t, x, w, bias, stride, padding, dilation, groups)


def _conv(t, x, w, bias, stride, padding, dilation, groups):
    if x.rank == 3 and w.rank == 3:  # conv1d as conv2d over a height of 1
        n, c, length = x.shape
        x4 = t.g.view(x, (n, c, 1, length))
        w4 = t.g.view(w, (w.shape[0], w.shape[1], 1, w.shape[2]))
        (s,), (p,), (d,) = list(stride), list(padding), list(dilation)
        out = t.g.conv(x4, w4, bias, stride=(1, s), padding=(0, p, 0, p), dilation=(1, d), groups=groups)
        return t.g.view(out, (out.shape[0], out.shape[1], out.shape[3]))
    if x.rank != 4:
        raise t.fail(f"only 1-d and 2-d convolutions are supported, got input rank {x.rank}")
    ph, pw = _pair(padding)
    return t.g.conv(
        x, w, bias, stride=_pair(stride), padding=(ph, pw, ph, pw), dilation=_pair(dilation), groups=groups
    )


@handles(aten.max_pool2d_with_indices.default, aten.max_pool2d.default)
def _max_pool(t, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    ph, pw = _pair(padding)
    out = t.g.pool(
        x,
        "max",
        _pair(kernel),
        _pair(stride) if stride else None,
        (ph, pw, ph, pw),
        _pair(dilation),
        ceil_mode,
    )
    if t.node.target is aten.max_pool2d.default:
        return out
    return out, Lazy(lambda: (_ for _ in ()).throw(t.fail("max pool indices are not supported")))


@handles(aten.avg_pool2d.default)
def _avg_pool(
    t, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    if divisor_override is not None:
        raise t.fail("avg_pool2d divisor_override is not supported")
    ph, pw = _pair(padding)
    return t.g.pool(
        x,
        "avg",
        _pair(kernel),
        _pair(stride) if stride else None,
        (ph, pw, ph, pw),
        (1, 1),
        ceil_mode,
        count_include_pad,
    )


@handles(aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool(t, x, size):
    oh, ow = _pair(size)
    h, w = x.shape[-2:]
    if (oh, ow) == (1, 1):
        return t.g.reduce(Op.MEAN, x, (-2, -1), True)
    if isinstance(h, Sym) or isinstance(w, Sym) or h % oh or w % ow:
        raise t.fail(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow} (not a whole multiple) is not supported")
    return t.g.pool(x, "avg", (h // oh, w // ow))


__all__ = ["ATEN"]
