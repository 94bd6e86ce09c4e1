"""ONNX converters for the network ops: MatMul/Gemm/Einsum, Conv, pooling, normalizations, softmax, Resize.

Decompositions onto the IR: 1-d Conv goes through an extra axis of size 1; pooling over 1, 3 or more
spatial axes pools one axis at a time (:func:`pool_nd`); BatchNormalization and ImageScaler become affine
elementwise maps (coefficients folded at load time when the statistics are constant);
InstanceNormalization uses reductions; LayerNormalization / RMSNormalization over several trailing axes view
them as one axis; Einsum becomes permute + view + matmul (+ sum for letters used once); Resize applies a
per-axis gather (nearest) or a weighted sum of per-axis gathers (linear, cubic) with load-time tables that
follow the ONNX reference implementation.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

import numpy as np
import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Node, Op
from kernelize.ir.onnx_context import Converter, NodeContext, to_dtype
from kernelize.ir.shapes import Sym, is_static, normalize_axis, numel


# -- matmul family -------------------------------------------------------------------------------------------
def _matmul(ctx: NodeContext) -> Node:
    return ctx.g.matmul(ctx.x(0), ctx.x(1))


def _gemm(ctx: NodeContext) -> Node:
    g, a, b = ctx.g, ctx.x(0), ctx.x(1)
    if ctx.attr("transA", 0):
        a = g.transpose(a)
    if ctx.attr("transB", 0):
        b = g.transpose(b)
    y = g.matmul(a, b)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    if alpha != 1:
        y = g.mul(y, alpha)
    if ctx.has(2) and beta != 0:
        c = ctx.x(2)
        y = g.add(y, g.mul(c, beta) if beta != 1 else c)
    return y


def _einsum(ctx: NodeContext) -> Node:
    """General Einsum without repeated letters inside one operand: sums, then pairwise matmuls."""
    g = ctx.g
    xs = [ctx.x(i) for i in range(len(ctx))]
    eq = ctx.attr("equation").replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(xs):
        raise ValueError(f"einsum equation {eq!r} has {len(terms)} operands, the node has {len(xs)}")
    free = [c for c in string.ascii_letters if c not in eq]
    ell_rank = max((x.rank - len(t.replace("...", "")) for t, x in zip(terms, xs) if "..." in t), default=0)
    ell = "".join(free[:ell_rank])
    # "..." stands for the leading dims of each operand, right-aligned like numpy broadcasting
    terms = [
        t.replace("...", ell[ell_rank - (x.rank - len(t) + 3) :]) if "..." in t else t
        for t, x in zip(terms, xs)
    ]
    if not arrow:
        counts = {c: sum(t.count(c) for t in terms) for c in set("".join(terms)) - set(ell)}
        rhs = ell + "".join(sorted(c for c, n in counts.items() if n == 1))
    rhs = rhs.replace("...", ell)
    sizes: dict[str, object] = {}
    for t, x in zip(terms, xs):
        if len(t) != x.rank:
            raise ValueError(f"einsum term {t!r} does not match operand shape {list(x.shape)}")
        if len(set(t)) != len(t):
            raise ctx.unsupported(f"einsum term {t!r} repeats a letter (diagonals are not supported)")
        for c, d in zip(t, x.shape):
            if sizes.get(c, 1) == 1:
                sizes[c] = d
    ops = list(zip(xs, terms))
    # sum out letters that appear in one operand only and not in the output
    for k, (x, t) in enumerate(ops):
        others = rhs + "".join(tt for j, (_, tt) in enumerate(ops) if j != k)
        gone = [i for i, c in enumerate(t) if c not in others]
        if gone:
            x = g.reduce(Op.SUM, x, gone)
            t = "".join(c for c in t if c in others)
        ops[k] = (x, t)
    x, t = ops[0]
    for k in range(1, len(ops)):
        y, u = ops[k]
        keep = set(rhs + "".join(tt for _, tt in ops[k + 1 :]))
        x, t = _contract(g, x, t, y, u, keep, sizes)
    gone = [i for i, c in enumerate(t) if c not in rhs]
    if gone:
        x, t = g.reduce(Op.SUM, x, gone), "".join(c for c in t if c in rhs)
    x = g.broadcast(x, [sizes[c] for c in t])
    return g.permute(x, [t.index(c) for c in rhs])


def _contract(g: Graph, x: Node, t: str, y: Node, u: str, keep: set[str], sizes: dict) -> tuple[Node, str]:
    """``x`` (letters ``t``) times ``y`` (letters ``u``) summed over the shared letters not in ``keep``."""
    batch = [c for c in t if c in u and c in keep]
    contract = [c for c in t if c in u and c not in keep]
    left = [c for c in t if c not in u]
    right = [c for c in u if c not in t]
    nb = len(batch)
    ls, ks, rs = ([sizes[c] for c in cs] for cs in (left, contract, right))
    # batch dims stay separate (matmul broadcasts them); the others are broadcast to full size and merged
    a = g.permute(x, [t.index(c) for c in batch + left + contract])
    a = g.view(g.broadcast(a, [*a.shape[:nb], *ls, *ks]), (*a.shape[:nb], numel(ls), numel(ks)))
    b = g.permute(y, [u.index(c) for c in batch + contract + right])
    b = g.view(g.broadcast(b, [*b.shape[:nb], *ks, *rs]), (*b.shape[:nb], numel(ks), numel(rs)))
    m = g.matmul(a, b)
    return g.view(m, (*m.shape[:nb], *ls, *rs)), "".join(batch + left + right)


# -- convolution and pooling ---------------------------------------------------------------------------------
def _pads(ctx: NodeContext, sizes, kernel, strides, dilations) -> list[tuple[int, int]]:
    n = len(kernel)
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto == "VALID":
        return [(0, 0)] * n
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        out = []
        for d, k, s, dl in zip(sizes, kernel, strides, dilations):
            if isinstance(d, Sym):
                raise ctx.unsupported(f"auto_pad {auto} over symbolic dimension {d}")
            total = max(0, (-(-d // s) - 1) * s + (k - 1) * dl + 1 - d)
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            out.append((lo, total - lo))
        return out
    if auto != "NOTSET":
        raise ctx.unsupported(f"auto_pad {auto!r}")
    pads = ctx.attr("pads") or [0] * (2 * n)
    return [(pads[i], pads[i + n]) for i in range(n)]


def _spatial(
    ctx: NodeContext, x: Node, kernel: list[int] | None, max_rank: int = 2
) -> tuple[int, list[int], list[int]]:
    """Spatial rank (1 to ``max_rank``), strides and dilations."""
    n = x.rank - 2
    if not 1 <= n <= max_rank:
        limit = "1-d and 2-d" if max_rank == 2 else "1-d or more"
        raise ctx.unsupported(f"{n}-d {ctx.op_type} (supported: {limit} over N, C, spatial...)")
    if kernel is not None and len(kernel) != n:
        raise ValueError(f"kernel_shape {kernel} does not fit the {n} spatial axes of {list(x.shape)}")
    return n, list(ctx.attr("strides") or [1] * n), list(ctx.attr("dilations") or [1] * n)


def _as_2d(g: Graph, x: Node) -> Node:
    return g.view(x, (*x.shape[:2], 1, x.shape[2]))


def _conv(ctx: NodeContext) -> Node:
    g, x, w = ctx.g, ctx.x(0), ctx.x(1)
    kernel = list(ctx.attr("kernel_shape") or w.shape[2:])
    n, strides, dilations = _spatial(ctx, x, kernel)
    pads = _pads(ctx, x.shape[2:], kernel, strides, dilations)
    if not x.dtype.is_float:
        raise ctx.unsupported(f"Conv of {x.dtype} (floating types only)")
    bias = ctx.x(2) if ctx.has(2) else None
    groups = ctx.attr("group", 1)
    if n == 1:
        y = g.conv(
            _as_2d(g, x),
            _as_2d(g, w),
            bias,
            stride=(1, strides[0]),
            dilation=(1, dilations[0]),
            padding=(0, pads[0][0], 0, pads[0][1]),
            groups=groups,
        )
        return g.view(y, (y.shape[0], y.shape[1], y.shape[3]))
    return g.conv(
        x,
        w,
        bias,
        stride=strides,
        dilation=dilations,
        groups=groups,
        padding=(pads[0][0], pads[1][0], pads[0][1], pads[1][1]),
    )


def _conv_transpose(ctx: NodeContext) -> Node:
    """Transposed conv = zero-stuffed input, padded by ``d*(k-1) - pad``, conv with the flipped kernel."""
    g, x, w = ctx.g, ctx.x(0), ctx.x(1)
    kernel = list(ctx.attr("kernel_shape") or w.shape[2:])
    n, strides, dilations = _spatial(ctx, x, kernel)
    if not x.dtype.is_float or not is_static(x.shape[1:]):
        raise ctx.unsupported("ConvTranspose needs a floating input with static channel and spatial sizes")
    groups = ctx.attr("group", 1)
    out_pad = list(ctx.attr("output_padding") or [0] * n)
    sizes = list(x.shape[2:])
    if ctx.attr("output_shape") is not None:
        want = list(ctx.attr("output_shape"))[-n:]
        pads = []
        for i in range(n):
            total = strides[i] * (sizes[i] - 1) + out_pad[i] + ((kernel[i] - 1) * dilations[i] + 1) - want[i]
            # the spec puts the larger half first except for SAME_UPPER
            lo = total // 2 if ctx.attr("auto_pad", "NOTSET") == "SAME_UPPER" else total - total // 2
            pads.append((lo, total - lo))
    elif ctx.attr("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for i in range(n):
            total = max(
                0,
                strides[i] * (sizes[i] - 1)
                + out_pad[i]
                + ((kernel[i] - 1) * dilations[i] + 1)
                - sizes[i] * strides[i],
            )
            lo = total // 2 if ctx.attr("auto_pad") == "SAME_UPPER" else total - total // 2
            pads.append((lo, total - lo))
    else:
        pads = _pads(ctx, sizes, kernel, strides, dilations)
    if n == 1:
        x, w = _as_2d(g, x), _as_2d(g, w)
        strides, dilations, kernel = [1, *strides], [1, *dilations], [1, *kernel]
        pads, out_pad = [(0, 0), *pads], [0, *out_pad]
    cin, cout_g = w.shape[0], w.shape[1]
    # zero-stuff: [N, C, H, W] -> [N, C, H, s, W, s] padded with zeros -> [N, C, H*s, W*s], drop the tail
    nb, c, h, wd = x.shape
    sh, sw = strides
    if sh > 1 or sw > 1:
        z = g.pad(g.view(x, (nb, c, h, 1, wd, 1)), [(0, 0)] * 3 + [(0, sh - 1), (0, 0), (0, sw - 1)])
        z = g.view(z, (nb, c, h * sh, wd * sw))
        x = g.slice(g.slice(z, 2, 0, (h - 1) * sh + 1), 3, 0, (wd - 1) * sw + 1)
    # weight [Cin, Cout/g, kh, kw] -> [Cout, Cin/g, kh, kw], spatially flipped
    kh, kw = w.shape[2:]
    wt = g.view(w, (groups, cin // groups, cout_g, kh, kw))
    wt = g.view(g.permute(wt, (0, 2, 1, 3, 4)), (groups * cout_g, cin // groups, kh, kw))
    wt = g.flip(wt, [2, 3])
    full = [dilations[i] * (kernel[i] - 1) for i in range(2)]
    lo = [full[i] - pads[i][0] for i in range(2)]
    hi = [full[i] - pads[i][1] + out_pad[i] for i in range(2)]
    x = g.pad(x, [(0, 0), (0, 0), (max(lo[0], 0), max(hi[0], 0)), (max(lo[1], 0), max(hi[1], 0))])
    for a in range(2):  # negative amounts crop
        if lo[a] < 0 or hi[a] < 0:
            x = g.slice(x, 2 + a, max(-lo[a], 0), x.shape[2 + a] - max(-hi[a], 0))
    bias = ctx.x(2) if ctx.has(2) else None
    y = g.conv(x, wt, bias, dilation=dilations, groups=groups)
    return g.view(y, (y.shape[0], y.shape[1], y.shape[3])) if ctx.rank(0) == 3 else y


def _pool(kind: str) -> Converter:
    def run(ctx: NodeContext) -> Node:
        g, x = ctx.g, ctx.x(0)
        if ctx.wants_output(1):
            raise ctx.unsupported("the Indices output of MaxPool")
        if not x.dtype.is_float:
            raise ctx.unsupported(f"pooling of {x.dtype} (floating types only)")
        kernel = list(ctx.attr("kernel_shape"))
        _, strides, dilations = _spatial(ctx, x, kernel, max_rank=x.rank)
        pads = _pads(ctx, x.shape[2:], kernel, strides, dilations)
        ceil_mode = bool(ctx.attr("ceil_mode", 0))
        if kind != "max" and any(d != 1 for d in dilations):
            raise ctx.unsupported("average/Lp pooling with dilations")
        p = ctx.attr("p", 2) if kind == "lp" else None
        if kind == "lp":
            if ceil_mode:
                raise ctx.unsupported("LpPool with ceil_mode")
            x = g.pow(g.abs(x), float(p))
        count_pad = bool(ctx.attr("count_include_pad", 0)) or kind == "lp"
        window = PoolWindow(tuple(kernel), tuple(strides), tuple(pads), tuple(dilations), ceil_mode)
        y = pool_nd(g, x, "max" if kind == "max" else "avg", window, count_pad)
        if kind == "lp":
            y = g.pow(g.mul(y, float(math.prod(kernel))), 1.0 / p)
        return y

    return run


@dataclass(frozen=True)
class PoolWindow:
    """Per spatial axis: window size, stride, (begin, end) padding, dilation; and ONNX's ``ceil_mode``."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]
    dilations: tuple[int, ...]
    ceil_mode: bool = False


def pool_nd(g: Graph, x: Node, kind: str, w: PoolWindow, count_include_pad: bool) -> Node:
    """Max or average pooling of ``x`` [N, C, D1, ..., Dn] over its ``n`` spatial axes.

    2-d is the IR's pool; 1-d, 3-d and more pool one axis at a time, each as a 2-d pool of the view
    [N, C*D1*...*D(a-1), Da, D(a+1)*...*Dn] with a (k, 1) window. That is exact because every window is
    a box: its maximum is the maximum of per-axis maxima, its sum the iterated per-axis sums, and the
    divisor (the box's size, clipped to the input with ``count_include_pad=0`` or to the padded input
    with ``ceil_mode``) is the product of the per-axis ones.
    Axes with window 1, stride 1 and no padding are left alone (torch exports LRN as a 3-d average pool
    with a window over the channels only).

    Example:
        >>> w = PoolWindow((5, 1, 1), (1, 1, 1), ((0, 0),) * 3, (1, 1, 1))  # doctest: +SKIP
        >>> y = pool_nd(g, x, "avg", w, count_include_pad=True)  # doctest: +SKIP
    """
    n = x.rank - 2
    if n == 2:
        (top, bottom), (left, right) = w.pads
        padding = (top, left, bottom, right)
        return g.pool(x, kind, w.kernel, w.strides, padding, w.dilations, w.ceil_mode, count_include_pad)
    for a in range(n):
        k, s, (lo, hi), d = w.kernel[a], w.strides[a], w.pads[a], w.dilations[a]
        if k == s == 1 and lo == hi == 0:
            continue
        axis = 2 + a
        shape = x.shape
        if s == d == 1 and k <= SLICED_WINDOW and isinstance(shape[axis], int):
            if kind == "max" or count_include_pad or lo == hi == 0:  # (else the divisor varies at the edges)
                x = _sliced_window(g, x, kind, axis, k, lo, hi)
                continue
        v = g.view(x, (shape[0], numel(shape[1:axis]), shape[axis], numel(shape[axis + 1 :])))
        y = g.pool(v, kind, (k, 1), (s, 1), (lo, 0, hi, 0), (d, 1), w.ceil_mode, count_include_pad)
        x = g.view(y, (*shape[:axis], y.shape[2], *shape[axis + 1 :]))
    return x


SLICED_WINDOW = 16  # a stride-1 window along one axis up to this size is sums of shifted slices


def _sliced_window(g: Graph, x: Node, kind: str, axis: int, k: int, lo: int, hi: int) -> Node:
    """A stride-1 pooling window of ``k`` along ``axis`` (after padding it by ``lo`` / ``hi``) as the max or
    the sum (over ``k``) of ``k`` shifted slices: one pointwise kernel's strided loads, where the pool of a
    ``[N, C*D1, Da, ...]`` view (torch's LRN export pools the channels so) ran as torch's 2-d pool of a
    one-channel image, 4 ms for AlexNet's first LRN."""
    if kind == "max":
        return _shifted(g, x, g.max, axis, k, lo, hi, float("-inf"))
    return g.div(_shifted(g, x, g.add, axis, k, lo, hi, 0), float(k))


def _shifted(g: Graph, x: Node, combine, axis: int, k: int, lo: int, hi: int, fill: float) -> Node:
    """``combine`` (max or add) of the ``k`` shifted slices along ``axis`` of ``x`` padded by ``lo`` / ``hi``
    with ``fill``: a stride-1 window of ``k``, as layout ops the planner turns into one kernel's loads."""
    pads = [(0, 0)] * x.rank
    pads[axis] = (lo, hi)
    xp = g.pad(x, pads, fill)
    out = x.shape[axis] + lo + hi - k + 1
    y = g.slice(xp, axis, 0, out)
    for j in range(1, k):
        y = combine(y, g.slice(xp, axis, j, j + out))
    return y


def _global_pool(op: Op) -> Converter:
    def run(ctx: NodeContext) -> Node:
        x = ctx.x(0)
        return ctx.g.reduce(op, x, range(2, x.rank), keepdim=True)

    return run


# -- normalization -------------------------------------------------------------------------------------------
def _per_channel(g: Graph, p: Node, rank: int, dtype: DType) -> Node:
    """A ``[C]`` parameter shaped to broadcast over ``[N, C, ...]``."""
    return g.view(g.cast(p, dtype), (p.shape[0], *([1] * (rank - 2))))


def _batch_norm(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    training = ctx.attr("training_mode", 0) if ctx.opset >= 14 else ctx.n_outputs > 1
    if training or ctx.n_outputs > 1:
        raise ctx.unsupported("BatchNormalization in training mode; export the model in eval mode")
    eps = ctx.attr("epsilon", 1e-5)
    consts = [ctx.const(i) for i in range(1, 5)]
    if all(c is not None for c in consts):
        scale, bias, mean, var = (c.double() for c in consts)
        s = scale / torch.sqrt(var + eps)
        s, b, m = (g.const(t.to(x.dtype.torch)) for t in (s, bias, mean))
    else:
        scale, bias, mean, var = (g.cast(ctx.x(i), x.dtype) for i in range(1, 5))
        s, b, m = g.mul(scale, g.rsqrt(g.add(var, eps))), bias, mean
    # parameters are [C] (or [C, D1, ...] with BatchNormalization-7's spatial=0), x is [N, C, D1, ...]
    s, b, m = (_per_channel(g, t, x.rank, x.dtype) if t.rank == 1 and x.rank > 2 else t for t in (s, b, m))
    return g.add(g.mul(g.sub(x, m), s), b)


def _image_scaler(ctx: NodeContext) -> Node:
    """ImageScaler (experimental, opsets 1-9): ``x * scale + bias[c]`` over [N, C, H, W]."""
    g, x = ctx.g, ctx.x(0)
    y = g.mul(x, float(ctx.attr("scale", 1.0)))
    bias = ctx.attr("bias")
    if not bias:
        return y
    return g.add(y, _per_channel(g, g.const(torch.tensor(bias, dtype=x.dtype.torch)), x.rank, x.dtype))


def _lrn(ctx: NodeContext) -> Node:
    """LRN: ``x / (bias + alpha / size * sum of x**2 over a window of channels) ** beta``.

    The window sum is ``size`` shifted slices of the zero-padded squares, layout ops that the planner
    turns into strided loads of one pointwise kernel.
    """
    g, x = ctx.g, ctx.x(0)
    size = ctx.attr("size")
    if size is None or size < 1:
        raise ctx.unsupported("LRN without a positive `size` attribute")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    c = x.shape[1]
    if isinstance(c, Sym):
        raise ctx.unsupported(f"LRN over a symbolic channel dimension {c}")
    xf = g.cast(x, DType.F32) if x.dtype in (DType.F16, DType.BF16) else x
    lo, hi = (size - 1) // 2, size // 2  # the window is [c - floor((size-1)/2), c + ceil((size-1)/2)]
    total = _shifted(g, g.mul(xf, xf), g.add, 1, size, lo, hi, 0)
    den = g.pow(g.add(g.mul(total, alpha / size), float(bias)), float(beta))
    return g.cast(g.div(xf, den), x.dtype)


def _instance_norm(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    eps = ctx.attr("epsilon", 1e-5)
    xf = g.cast(x, DType.F32) if x.dtype in (DType.F16, DType.BF16) else x
    axes = list(range(2, x.rank))
    mean = g.reduce(Op.MEAN, xf, axes, True)
    d = g.sub(xf, mean)
    inv = g.rsqrt(g.add(g.reduce(Op.MEAN, g.mul(d, d), axes, True), eps))
    y = g.add(
        g.mul(g.mul(d, inv), _per_channel(g, ctx.x(1), x.rank, xf.dtype)),
        _per_channel(g, ctx.x(2), x.rank, xf.dtype),
    )
    return g.cast(y, x.dtype)


def _trailing_norm(ctx: NodeContext, rms: bool):
    """LayerNormalization / RMSNormalization over ``axis..-1``, with the optional statistics outputs."""
    g, x = ctx.g, ctx.x(0)
    axis = normalize_axis(ctx.attr("axis", -1), x.rank)
    eps = ctx.attr("epsilon", 1e-5)
    scale = ctx.x(1)
    bias = ctx.x(2) if ctx.has(2) and not rms else None
    norm_shape = x.shape[axis:]
    if not (ctx.wants_output(1) or ctx.wants_output(2)):
        k = numel(norm_shape)
        v = g.view(x, (*x.shape[:axis], k))
        direct = all(p is None or (p.shape == norm_shape and p.dtype == x.dtype) for p in (scale, bias))
        w = g.view(scale, (k,)) if direct else None
        if rms:
            y = g.rmsnorm(v, w, eps)
        else:
            y = g.layernorm(v, w, g.view(bias, (k,)) if direct and bias is not None else None, eps)
        y = g.view(y, x.shape)
        if not direct:
            y = g.mul(y, g.cast(scale, x.dtype))
            if bias is not None:
                y = g.add(y, g.cast(bias, x.dtype))
        return y
    stash = to_dtype(ctx.attr("stash_type", 1), "stash_type")
    xs = g.cast(x, stash)
    axes = list(range(axis, x.rank))
    if rms:
        mean, d = None, xs
    else:
        mean = g.reduce(Op.MEAN, xs, axes, True)
        d = g.sub(xs, mean)
    inv = g.rsqrt(g.add(g.reduce(Op.MEAN, g.mul(d, d), axes, True), eps))
    y = g.mul(g.cast(g.mul(d, inv), x.dtype), scale)
    if bias is not None:
        y = g.add(y, bias)
    return (y, inv) if rms else (y, mean, inv)


def _group_norm(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    groups = ctx.attr("num_groups")
    eps = ctx.attr("epsilon", 1e-5)
    n, c = x.shape[:2]
    xs = g.cast(x, DType.F32) if x.dtype in (DType.F16, DType.BF16) else x
    y = g.view(g.layernorm(g.view(xs, (n, groups, -1)), eps=eps), x.shape)
    scale, bias = g.cast(ctx.x(1), xs.dtype), g.cast(ctx.x(2), xs.dtype)
    if ctx.opset < 21 and scale.shape == (groups,) and groups != c:  # opset 18: one scale per group
        v = g.view(y, (n, groups, -1))
        v = g.add(g.mul(v, g.view(scale, (groups, 1))), g.view(bias, (groups, 1)))
        return g.cast(g.view(v, x.shape), x.dtype)
    y = g.add(g.mul(y, _per_channel(g, scale, x.rank, xs.dtype)), _per_channel(g, bias, x.rank, xs.dtype))
    return g.cast(y, x.dtype)


def _lp_norm(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    axis, p = ctx.attr("axis", -1), ctx.attr("p", 2)
    if p == 1:
        norm = g.reduce(Op.SUM, g.abs(x), axis, True)
    elif p == 2:
        norm = g.sqrt(g.reduce(Op.SUM, g.mul(x, x), axis, True))
    else:
        raise ctx.unsupported(f"LpNormalization with p={p} (supported: 1, 2)")
    return g.where(g.eq(norm, 0), 0, g.div(x, norm))


def _mvn(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    axes = ctx.attr("axes", [0, 2, 3])
    mean = g.reduce(Op.MEAN, x, axes, True)
    var = g.sub(g.reduce(Op.MEAN, g.mul(x, x), axes, True), g.mul(mean, mean))
    return g.div(g.sub(x, mean), g.add(g.sqrt(var), 1e-9))


def _softmax(op: Op) -> Converter:
    def run(ctx: NodeContext) -> Node:
        g, x = ctx.g, ctx.x(0)
        if ctx.opset >= 13:
            axis = normalize_axis(ctx.attr("axis", -1), x.rank)
            return _row_op(g, op, x, axis)
        axis = normalize_axis(ctx.attr("axis", 1), x.rank)  # old opsets: softmax of the 2-d flattening
        v = g.view(x, (numel(x.shape[:axis]), numel(x.shape[axis:])))
        return g.view(_row_op(g, op, v, 1), x.shape)

    return run


def _row_op(g: Graph, op: Op, x: Node, axis: int) -> Node:
    if op is Op.SOFTMAX:
        return g.softmax(x, axis)
    if op is Op.LOG_SOFTMAX:
        return g.log_softmax(x, axis)
    # hardmax: one-hot of the first maximum
    idx = g.reduce(Op.ARGMAX, x, axis, keepdim=True)
    d = x.shape[axis]
    ar = torch.arange(d).reshape([d if a == axis else 1 for a in range(x.rank)])
    return g.cast(g.eq(idx, g.const(ar)), x.dtype)


# -- resize --------------------------------------------------------------------------------------------------
def _coeffs(mode: str, ratio: np.ndarray, a: float, nearest_mode: str) -> np.ndarray:
    """Per output position, the interpolation weights of its neighbours (ONNX reference formulas)."""
    r = ratio[:, None]
    if mode == "nearest":
        if nearest_mode == "round_prefer_floor":
            hi = ratio > 0.5
        elif nearest_mode == "round_prefer_ceil":
            hi = ratio >= 0.5
        elif nearest_mode == "floor":
            hi = np.zeros_like(ratio, dtype=bool)
        elif nearest_mode == "ceil":
            hi = np.ones_like(ratio, dtype=bool)
        else:
            raise ValueError(f"unknown nearest_mode {nearest_mode!r}")
        hi = np.where(ratio == 1.0, True, hi)  # an exact source position picks itself
        return np.stack([~hi, hi], 1).astype(np.float64)
    if mode == "linear":
        return np.concatenate([1 - r, r], 1)
    s = 1 - r
    return np.concatenate(
        [
            ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
            ((a + 2) * r - (a + 3)) * r * r + 1,
            ((a + 2) * s - (a + 3)) * s * s + 1,
            ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a,
        ],
        1,
    )


def _source_coords(ctm: str, y: np.ndarray, scale: float, d: int, out: int, roi) -> np.ndarray:
    width = scale * d
    if ctm == "align_corners":
        return np.zeros(out) if width == 1 else y * (d - 1) / (width - 1)
    if ctm == "asymmetric":
        return y / scale
    if ctm == "tf_crop_and_resize":
        x = (
            np.full(out, (roi[1] - roi[0]) * (d - 1) / 2)
            if width == 1
            else y * (roi[1] - roi[0]) * (d - 1) / (width - 1)
        )
        return x + roi[0] * (d - 1)
    if ctm == "pytorch_half_pixel":
        return np.full(out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
    if ctm == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        adjustment = out / width
        return d / 2 * (1 - adjustment) + (y + 0.5) / scale - 0.5
    raise ValueError(f"unknown coordinate_transformation_mode {ctm!r}")


def _resize_axis(
    g: Graph,
    x: Node,
    axis: int,
    scale: float,
    out: int,
    mode: str,
    ctm: str,
    roi,
    cubic_a: float,
    exclude_outside: bool,
    extrapolation: float,
    nearest_mode: str,
) -> Node:
    d = x.shape[axis]
    if out == 0:
        return g.slice(x, axis, 0, 0)
    y = np.arange(out, dtype=np.float64)
    src = _source_coords(ctm, y, scale, d, out, roi)
    base = np.floor(src).astype(np.int64)
    ratio = np.where(src == base, 1.0, src - base)
    coeffs = _coeffs(mode, ratio, cubic_a, nearest_mode)
    n = coeffs.shape[1]
    pad = -(-n // 2)
    xp = src + pad
    pp = np.floor(xp).astype(np.int64)
    frac = xp - pp
    offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    idx = (pp + offset)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        coeffs = np.where((idx < 0) | (idx >= d), 0.0, coeffs)
        total = coeffs.sum(1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    idx = np.clip(idx, 0, d - 1)
    shape = [out if a == axis else 1 for a in range(x.rank)]
    if np.all((coeffs == 0) | (coeffs == 1)) and np.all(coeffs.sum(1) == 1):
        pick = idx[np.arange(out), coeffs.argmax(1)]
        res = g.gather(x, g.const(torch.as_tensor(pick)), axis)
    else:
        res = None
        for t in range(n):
            if not coeffs[:, t].any():
                continue
            term = g.mul(
                g.gather(x, g.const(torch.as_tensor(idx[:, t])), axis),
                g.const(torch.as_tensor(coeffs[:, t].reshape(shape)).to(x.dtype.torch)),
            )
            res = term if res is None else g.add(res, term)
    if ctm == "tf_crop_and_resize":
        outside = (src < 0) | (src > d - 1)
        if outside.any():
            res = g.where(g.const(torch.as_tensor(outside.reshape(shape))), extrapolation, res)
    return res


def _resize(ctx: NodeContext) -> Node:
    x = ctx.x(0)
    mode = ctx.attr("mode", "nearest")
    mode = "linear" if mode in ("bilinear", "trilinear") else mode
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.unsupported(f"Resize mode {mode!r}")
    if ctx.attr("antialias", 0) and mode != "nearest":
        raise ctx.unsupported("Resize with antialias")
    roi, scales, sizes, ctm, nearest_mode = _resize_inputs(ctx)
    if not x.dtype.is_float and mode != "nearest":
        raise ctx.unsupported(f"{mode} Resize of {x.dtype}")
    axes, full_scales, full_sizes, full_roi = _resize_targets(ctx, x, roi, scales, sizes)
    r = x.rank
    for a in axes:
        roi_a = None if full_roi is None else (full_roi[a], full_roi[a + r])
        if (
            math.isclose(full_scales[a], 1.0)
            and full_sizes[a] == x.shape[a]
            and (roi_a is None or (math.isclose(roi_a[0], 0.0) and math.isclose(roi_a[1], 1.0)))
        ):
            continue
        x = _resize_axis(
            ctx.g,
            x,
            a,
            full_scales[a],
            full_sizes[a],
            mode,
            ctm,
            roi_a,
            ctx.attr("cubic_coeff_a", -0.75),
            bool(ctx.attr("exclude_outside", 0)),
            ctx.attr("extrapolation_value", 0.0),
            nearest_mode,
        )
    return x


def _resize_inputs(
    ctx: NodeContext,
) -> tuple[np.ndarray | None, list[float] | None, list[int] | None, str, str]:
    """``(roi, scales, sizes, coordinate_transformation_mode, nearest_mode)`` of a Resize / Upsample node,
    across the opsets' spellings."""
    if ctx.op_type == "Upsample" or ctx.opset < 11:
        if ctx.opset < 9:
            scales = ctx.attr("scales")
        else:
            given = ctx.const(1)
            scales = None if given is None else [float(v) for v in given.reshape(-1).tolist()]
        if scales is None:
            raise ctx.unsupported("Resize/Upsample with scales known only at run time")
        return None, scales, None, "asymmetric", "floor"
    ctm = ctx.attr("coordinate_transformation_mode", "half_pixel")
    nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    roi = ctx.const(1).double().numpy() if ctx.has(1) and ctx.const(1) is not None else None
    if ctx.has(2) and ctx.const(2) is not None and ctx.const(2).numel():
        return roi, [float(v) for v in ctx.const(2).reshape(-1).tolist()], None, ctm, nearest_mode
    if ctx.has(3):
        return roi, None, ctx.ints(3, "sizes"), ctm, nearest_mode
    raise ctx.unsupported("Resize with scales known only at run time")


def _resize_targets(
    ctx: NodeContext, x: Node, roi: np.ndarray | None, scales: list[float] | None, sizes: list[int] | None
) -> tuple[list[int], list[float], list, list[float] | None]:
    """``(axes, scale per axis, size per axis, full roi)`` over all of ``x``'s axes; symbolic axes must
    keep their size and are dropped from ``axes``."""
    r = x.rank
    axes = [normalize_axis(a, r) for a in (ctx.attr("axes") or range(r))]
    full_scales = [1.0] * r
    full_sizes = list(x.shape)
    for i, a in enumerate(axes):
        if scales is not None:
            full_scales[a] = scales[i]
        if sizes is not None:
            full_sizes[a] = sizes[i]
    full_roi = None
    if roi is not None and roi.size:
        full_roi = [0.0] * r + [1.0] * r
        for i, a in enumerate(axes):
            full_roi[a], full_roi[r + a] = roi[i], roi[len(axes) + i]
    for a in [a for a in axes if isinstance(x.shape[a], Sym)]:  # a symbolic dim may only keep its size
        trivial_roi = full_roi is None or (full_roi[a], full_roi[a + r]) == (0.0, 1.0)
        if sizes is not None or full_scales[a] != 1.0 or not trivial_roi:
            raise ctx.unsupported(f"resizing symbolic dimension {x.shape[a]}")
        axes.remove(a)
    if sizes is None:
        full_sizes = [int(full_scales[a] * x.shape[a]) if a in axes else x.shape[a] for a in range(r)]
        return axes, full_scales, full_sizes, full_roi
    full_scales = [full_sizes[a] / x.shape[a] for a in range(r)]
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        pick = min if policy == "not_larger" else max
        s = pick(full_scales[a] for a in axes)
        full_scales = [s if a in axes else 1.0 for a in range(r)]
        full_sizes = [int(s * x.shape[a] + 0.5) if a in axes else x.shape[a] for a in range(r)]
    return axes, full_scales, full_sizes, full_roi


NN_OPS: dict[str, Converter] = {
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Einsum": _einsum,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "MaxPool": _pool("max"),
    "AveragePool": _pool("avg"),
    "LpPool": _pool("lp"),
    "GlobalMaxPool": _global_pool(Op.REDUCE_MAX),
    "GlobalAveragePool": _global_pool(Op.MEAN),
    "BatchNormalization": _batch_norm,
    "InstanceNormalization": _instance_norm,
    "LRN": _lrn,
    "ImageScaler": _image_scaler,
    "LayerNormalization": lambda ctx: _trailing_norm(ctx, rms=False),
    "RMSNormalization": lambda ctx: _trailing_norm(ctx, rms=True),
    "GroupNormalization": _group_norm,
    "LpNormalization": _lp_norm,
    "MeanVarianceNormalization": _mvn,
    "Softmax": _softmax(Op.SOFTMAX),
    "LogSoftmax": _softmax(Op.LOG_SOFTMAX),
    "Hardmax": _softmax(Op.ARGMAX),
    "Resize": _resize,
    "Upsample": _resize,
}

__all__ = ["NN_OPS", "PoolWindow", "pool_nd"]
