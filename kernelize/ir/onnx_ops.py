"""ONNX converters for elementwise math, casts, reductions and symbolic shape arithmetic.

Every converter maps one ONNX op type onto the IR's builder ops, decomposing where the IR has no direct op
(``Elu`` -> ``where``/``exp``, ``ReduceL2`` -> ``sqrt(sum(x*x))``, float ``Mod`` with ``fmod=0`` -> floor-mod
from ``fmod``, ...). Semantics follow the ONNX spec and its reference implementation: integer ``Div``
truncates toward zero, integer ``Mod(fmod=0)`` is Python's floor-mod, reductions over an empty set give
the op's identity.
"""

from __future__ import annotations

import math

import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Node, Op
from kernelize.ir.onnx_context import Converter, NodeContext, SymInts, sym_or_const, to_dtype
from kernelize.ir.shapes import Dim, ShapeError, Sym, normalize_axis


def clamp(g: Graph, x: Node, lo: float = -math.inf, hi: float = math.inf) -> Node:
    """``min(max(x, lo), hi)``; exact for integers too (no detour through floats)."""
    if x.dtype.is_float:
        return g.clamp(x, lo, hi)
    if lo != -math.inf:
        x = g.max(x, int(lo))
    return g.min(x, int(hi)) if hi != math.inf else x


def _float_input(ctx: NodeContext, i: int = 0) -> Node:
    x = ctx.x(i)
    if not x.dtype.is_float:
        raise ctx.unsupported(f"input {i} has dtype {x.dtype}; this converter handles floating types only")
    return x


# -- unary ---------------------------------------------------------------------------------------------------
def _unary(op: Op) -> Converter:
    return lambda ctx: ctx.g.unary(op, ctx.x(0))


def _relu(ctx: NodeContext) -> Node:
    return clamp(ctx.g, ctx.x(0), 0)


def _leaky_relu(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    return g.where(g.lt(x, 0), g.mul(x, ctx.attr("alpha", 0.01)), x)


def _prelu(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    return g.where(g.lt(x, 0), g.mul(x, ctx.x(1)), x)


def _elu(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    return g.where(g.lt(x, 0), g.mul(g.sub(g.exp(x), 1), ctx.attr("alpha", 1.0)), x)


def _selu(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    alpha, gamma = ctx.attr("alpha", 1.67326319217681884765625), ctx.attr("gamma", 1.05070102214813232421875)
    neg = g.sub(g.mul(g.exp(x), alpha), alpha)
    return g.mul(g.where(g.le(x, 0), neg, x), gamma)


def _celu(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    alpha = ctx.attr("alpha", 1.0)
    neg = g.mul(g.sub(g.exp(g.div(x, alpha)), 1), alpha)
    return g.add(g.max(x, 0), g.min(neg, 0))


def _thresholded_relu(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    return g.where(g.gt(x, ctx.attr("alpha", 1.0)), x, 0)


def _hard_sigmoid(ctx: NodeContext, alpha: float | None = None, beta: float | None = None) -> Node:
    g, x = ctx.g, _float_input(ctx)
    alpha = ctx.attr("alpha", 0.2) if alpha is None else alpha
    beta = ctx.attr("beta", 0.5) if beta is None else beta
    return g.clamp(g.add(g.mul(x, alpha), beta), 0.0, 1.0)


def _hard_swish(ctx: NodeContext) -> Node:
    return ctx.g.mul(ctx.x(0), _hard_sigmoid(ctx, 1 / 6, 0.5))


def _softsign(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    return g.div(x, g.add(g.abs(x), 1))


def _shrink(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    bias, lambd = ctx.attr("bias", 0.0), ctx.attr("lambd", 0.5)
    return g.where(g.lt(x, -lambd), g.add(x, bias), g.where(g.gt(x, lambd), g.sub(x, bias), 0))


def _mish(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    return g.mul(x, g.tanh(g.softplus(x)))


def _swish(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    return g.mul(x, g.sigmoid(g.mul(x, ctx.attr("alpha", 1.0))))


def _gelu(ctx: NodeContext) -> Node:
    return ctx.g.gelu(_float_input(ctx), ctx.attr("approximate", "none"))


def _sinh_cosh(sign: int) -> Converter:
    def run(ctx: NodeContext) -> Node:
        g, x = ctx.g, _float_input(ctx)
        e, ei = g.exp(x), g.exp(g.neg(x))
        return g.mul(g.sub(e, ei) if sign < 0 else g.add(e, ei), 0.5)

    return run


def _tan(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    return g.div(g.sin(x), g.cos(x))


def _isnan(ctx: NodeContext) -> Node:
    x = _float_input(ctx)
    return ctx.g.ne(x, x)


def _isinf(ctx: NodeContext) -> Node:
    g, x = ctx.g, _float_input(ctx)
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    out = g.const(torch.zeros(x.shape, dtype=torch.bool)) if not (pos or neg) else None
    if pos:
        out = g.eq(x, math.inf)
    if neg:
        out = g.or_(out, g.eq(x, -math.inf)) if out is not None else g.eq(x, -math.inf)
    return out


def _identity(ctx: NodeContext):
    v = ctx.value(0)
    return v


def _dropout(ctx: NodeContext):
    if ctx.opset >= 12:
        training = bool(ctx.scalar(2, False, "training_mode"))
    else:  # Dropout-1..6 run in training mode unless is_test is set
        training = ctx.opset < 7 and not ctx.attr("is_test", 0)
    if training and (ctx.scalar(1, 0.5, "ratio") if ctx.opset >= 12 else ctx.attr("ratio", 0.5)):
        raise ctx.unsupported("dropout in training mode is random; export the model in eval mode")
    v = ctx.value(0)
    if not ctx.wants_output(1):
        return v
    return v, ctx.g.broadcast(ctx.g.const(True), ctx.shape(0))


# -- binary --------------------------------------------------------------------------------------------------
def second_operand(ctx: NodeContext) -> Node:
    """Input 1 of a binary op, lined up with input 0 as opsets 1-6 spell it.

    Before opset 7, ``broadcast=1`` with an ``axis`` aligns the second operand's dims with the first's
    from ``axis`` on (Add-6 with A [N, C, H, W], B [C] and axis=1 adds B per channel); numpy's trailing
    alignment applies only without ``axis``. So B gets trailing 1s: [C] -> [C, 1, 1].
    """
    b = ctx.x(1)
    axis = ctx.attr("axis") if ctx.opset < 7 and ctx.attr("broadcast", 0) else None
    if axis is None:
        return b
    rank = ctx.rank(0)
    trailing = rank - normalize_axis(axis, rank) - b.rank
    if trailing < 0:
        raise ValueError(f"broadcast axis {axis} leaves no room for operand 1 of shape {list(b.shape)}")
    return ctx.g.view(b, (*b.shape, *[1] * trailing))


def _binary(op: Op) -> Converter:
    return lambda ctx: ctx.g.binary(op, ctx.x(0), second_operand(ctx))


def _variadic(op: Op, mean: bool = False) -> Converter:
    def run(ctx: NodeContext) -> Node:
        out = ctx.x(0)
        for i in range(1, len(ctx)):
            out = ctx.g.binary(op, out, ctx.x(i))
        return ctx.g.div(out, len(ctx)) if mean else out

    return run


def _pow(ctx: NodeContext) -> Node:
    g, x, y = ctx.g, ctx.x(0), second_operand(ctx)
    if x.dtype == y.dtype:
        return g.pow(x, y)
    if x.dtype.is_float:
        return g.pow(x, g.cast(y, x.dtype))
    # integer base, float exponent: compute in f64 (as numpy does), then back to the base's type
    return g.cast(g.pow(g.cast(x, DType.F64), g.cast(y, DType.F64)), x.dtype)


def _mod(ctx: NodeContext) -> Node:
    g, a, b = ctx.g, ctx.x(0), ctx.x(1)
    fmod = ctx.attr("fmod", 0)
    if a.dtype.is_float == bool(fmod):  # float fmod=1 (C fmod) and int fmod=0 (floor mod) are the IR's MOD
        return g.mod(a, b)
    if not a.dtype.is_float:  # integer C fmod: a - trunc(a / b) * b
        return g.sub(a, g.mul(g.div(a, b), b))
    # float floor-mod (numpy.mod) from fmod: shift by b when the signs differ; zero takes b's sign
    r = g.mod(a, b)
    shift = g.and_(g.ne(r, 0), g.ne(g.lt(r, 0), g.lt(b, 0)))
    r = g.where(shift, g.add(r, b), r)
    return g.where(g.eq(r, 0), g.mul(g.abs(r), g.sign(b)), r)


def _xor(ctx: NodeContext) -> Node:
    return ctx.g.ne(ctx.x(0), second_operand(ctx))


def _bitshift(ctx: NodeContext) -> Node:
    """Shifts as multiplication / floor division by ``2**y`` in int64, wrapped back to the input type."""
    g, x, y = ctx.g, ctx.x(0), ctx.x(1)
    if not x.dtype.is_int:
        raise ctx.unsupported(f"BitShift of {x.dtype}")
    bits = x.dtype.itemsize * 8
    xl, yl = g.cast(x, DType.I64), g.cast(y, DType.I64)
    two = g.scalar(2, DType.I64)
    p = g.pow(g.broadcast(two, yl.shape), clamp(g, yl, 0, 62))
    if ctx.attr("direction") == "LEFT":
        out = g.mul(g.mul(xl, p), g.where(g.eq(yl, 63), two, g.scalar(1, DType.I64)))
        out = g.where(g.or_(g.lt(yl, 0), g.ge(yl, bits)), g.scalar(0, DType.I64), out)
    else:  # arithmetic shift: floor(x / 2**y) = (x - floormod(x, 2**y)) / 2**y
        out = g.div(g.sub(xl, g.mod(xl, p)), p)
        fill = g.where(g.lt(xl, 0), g.scalar(-1, DType.I64), g.scalar(0, DType.I64))
        out = g.where(g.or_(g.lt(yl, 0), g.ge(yl, min(bits, 63))), fill, out)
    return g.cast(out, x.dtype)


def _where(ctx: NodeContext) -> Node:
    return ctx.g.where(ctx.x(0), ctx.x(1), ctx.x(2))


def _clip(ctx: NodeContext) -> Node:
    g, x = ctx.g, ctx.x(0)
    if ctx.opset < 11:
        return clamp(g, x, ctx.attr("min", -math.inf), ctx.attr("max", math.inf))
    lo, hi = (ctx.const(i) if ctx.has(i) else None for i in (1, 2))
    if (lo is not None or not ctx.has(1)) and (hi is not None or not ctx.has(2)):
        lo_v = -math.inf if lo is None else lo.item()
        hi_v = math.inf if hi is None else hi.item()
        return clamp(g, x, lo_v, hi_v)
    if ctx.has(1):
        x = g.max(x, ctx.x(1))
    return g.min(x, ctx.x(2)) if ctx.has(2) else x


# -- casts ---------------------------------------------------------------------------------------------------
def _cast(ctx: NodeContext):
    dtype = to_dtype(ctx.attr("to"), f"the target type of {ctx.describe()}")
    return _cast_to(ctx, dtype)


def _cast_like(ctx: NodeContext):
    return _cast_to(ctx, ctx.dtype(1))


def _cast_to(ctx: NodeContext, dtype: DType):
    v = ctx.value(0)
    if isinstance(v, SymInts):
        if dtype not in (DType.I32, DType.I64):
            raise ctx.unsupported(f"cast of a symbolic shape to {dtype}")
        return SymInts(v.dims, v.scalar, dtype)
    if isinstance(v, torch.Tensor):  # CastLike(constant, runtime): only the dtype of the second is needed
        return v.to(dtype.torch)
    return ctx.g.cast(ctx.x(0), dtype)


# -- reductions ----------------------------------------------------------------------------------------------
def _reduce_axes(ctx: NodeContext, input_since: int) -> tuple[int, ...]:
    """Axes to reduce (normalized); ``()`` means none (noop_with_empty_axes)."""
    rank = ctx.rank(0)
    axes = ctx.ints(1, "axes") if ctx.opset >= input_since else ctx.attr("axes")
    if not axes:
        return () if ctx.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted({normalize_axis(a, rank) for a in axes}))


def _finish(ctx: NodeContext, x: Node, axes: tuple[int, ...], keep: bool) -> Node:
    if keep or not axes:
        return x
    return ctx.g.view(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


def _empty_reduce(ctx: NodeContext, x: Node, axes: tuple[int, ...], value: float) -> Node | None:
    """Reducing an empty tensor gives the op's identity (ONNX reference semantics)."""
    if 0 not in x.shape:
        return None
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    out = ctx.g.broadcast(ctx.g.scalar(value, x.dtype), shape)
    return _finish(ctx, out, axes, ctx.attr("keepdims", 1))


def _limit(dtype: DType, high: bool) -> float:
    if dtype.is_float:
        return math.inf if high else -math.inf
    if dtype is DType.BOOL:
        return high
    info = torch.iinfo(dtype.torch)
    return info.max if high else info.min


def _reduce(kind: str, input_since: int = 18) -> Converter:
    """ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare: elementwise pre, reduce, post."""

    def run(ctx: NodeContext) -> Node:
        g, x = ctx.g, ctx.x(0)
        axes = _reduce_axes(ctx, input_since)
        keep = bool(ctx.attr("keepdims", 1))
        if kind in ("max", "min"):
            empty = _empty_reduce(ctx, x, axes, _limit(x.dtype, kind == "min"))
            if empty is not None:
                return empty
            if not axes:
                return x
            op = Op.REDUCE_MAX if kind == "max" else Op.REDUCE_MIN
            return g.reduce(op, x, axes, keep)
        if kind in ("l2", "log_sum", "log_sum_exp") and not x.dtype.is_float:
            raise ctx.unsupported(f"Reduce{kind} of {x.dtype} input")

        def total(v: Node, op: Op = Op.SUM) -> Node:
            return g.reduce(op, v, axes, True) if axes else v

        if kind == "sum":
            out = total(x)
        elif kind == "mean":
            out = total(x, Op.MEAN) if x.dtype.is_float else g.div(total(x), _count(x, axes))
        elif kind == "prod":
            out = total(x, Op.PROD)
        elif kind == "l1":
            out = total(g.abs(x))
        elif kind == "l2":
            out = g.sqrt(total(g.mul(x, x)))
        elif kind == "sum_square":
            out = total(g.mul(x, x))
        elif kind == "log_sum":
            out = g.log(total(x))
        else:  # log_sum_exp, stabilised by the max of the finite entries (as the ONNX reference)
            if 0 in x.shape:
                return _empty_reduce(ctx, x, axes, -math.inf)
            finite = g.where(g.eq(g.abs(x), math.inf), -math.inf, x)
            mx = g.reduce(Op.REDUCE_MAX, finite, axes, True) if axes else finite
            out = g.add(g.log(total(g.exp(g.sub(x, mx)))), mx)
        return _finish(ctx, out, axes, keep)

    return run


def _count(x: Node, axes: tuple[int, ...]) -> int:
    n = 1
    for a in axes:
        n = n * x.shape[a]
    return n


def _arg(op: Op) -> Converter:
    def run(ctx: NodeContext) -> Node:
        g, x = ctx.g, ctx.x(0)
        axis = normalize_axis(ctx.attr("axis", 0), x.rank)
        if ctx.attr("select_last_index", 0):
            d = x.shape[axis]
            out = (
                g.sub(g.scalar(d - 1, DType.I64), g.reduce(op, g.flip(x, [axis]), axis, True))
                if d != 1
                else g.reduce(op, x, axis, True)
            )
        else:
            out = g.reduce(op, x, axis, True)
        return _finish(ctx, out, (axis,), ctx.attr("keepdims", 1))

    return run


def _cumsum(ctx: NodeContext) -> Node:
    """Running sum along ``axis`` as a masked sum over a broadcast ``[..., n, n]`` (inf/nan-exact)."""
    g, x = ctx.g, ctx.x(0)
    axis = normalize_axis(ctx.scalar(1, what="axis"), x.rank)
    n = x.shape[axis]
    if isinstance(n, Sym):
        raise ctx.unsupported(f"CumSum along symbolic dimension {n}")
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    exclusive, reverse = ctx.attr("exclusive", 0), ctx.attr("reverse", 0)
    mask = (i > j if exclusive else i >= j) if reverse else (i < j if exclusive else i <= j)
    # x moved so that `axis` is last, then [..., n(i), 1] broadcast to [..., n(i), n(j)]
    perm = [a for a in range(x.rank) if a != axis] + [axis]
    xt = g.permute(x, perm)
    xb = g.broadcast(g.view(xt, (*xt.shape, 1)), (*xt.shape, n))
    out = g.reduce(Op.SUM, g.where(g.const(mask), xb, 0), -2)
    inv = [perm.index(a) for a in range(x.rank)]
    return g.permute(out, inv)


# -- symbolic shape arithmetic ------------------------------------------------------------------------------
def _sym_dims(ctx: NodeContext, i: int) -> tuple[list[Dim], bool]:
    v = ctx.value(i)
    if isinstance(v, SymInts):
        return list(v.dims), v.scalar
    if isinstance(v, Node):
        raise ctx.unsupported("mixes a symbolic shape with a run-time tensor")
    if v.dim() > 1:
        raise ctx.unsupported("symbolic shape arithmetic on a tensor of rank > 1")
    return [int(a) for a in v.reshape(-1).tolist()], v.dim() == 0


def _sym_gather(ctx: NodeContext):
    dims, _ = _sym_dims(ctx, 0)
    idx = ctx.const(1)
    if idx is None or isinstance(ctx.value(1), SymInts):
        raise ctx.unsupported("gathers from a symbolic shape with run-time indices")
    picked = [dims[int(k)] for k in idx.reshape(-1).tolist()]
    if idx.dim() > 1:
        raise ctx.unsupported("gathers from a symbolic shape with indices of rank > 1")
    return sym_or_const(picked, scalar=idx.dim() == 0)


def _sym_concat(ctx: NodeContext):
    out: list[Dim] = []
    for i in range(len(ctx)):
        out += _sym_dims(ctx, i)[0]
    return sym_or_const(out)


def _sym_unsqueeze(ctx: NodeContext):
    dims, scalar = _sym_dims(ctx, 0)
    if not scalar:
        raise ctx.unsupported("unsqueeze of a 1-d symbolic shape to rank 2")
    return SymInts(tuple(dims))


def _sym_squeeze(ctx: NodeContext):
    dims, scalar = _sym_dims(ctx, 0)
    if scalar or len(dims) != 1:
        raise ctx.unsupported("squeeze of a symbolic shape with more than one element")
    return SymInts(tuple(dims), scalar=True)


def _sym_slice(ctx: NodeContext):
    dims, _ = _sym_dims(ctx, 0)
    if ctx.opset < 10:
        starts, ends, steps = ctx.attr("starts"), ctx.attr("ends"), [1]
    else:
        starts, ends = ctx.ints(1, "starts"), ctx.ints(2, "ends")
        steps = ctx.ints(4, "steps") or [1]
    return sym_or_const(dims[slice(starts[0], ends[0], steps[0])])


def _sym_arith(op: str) -> Converter:
    def run(ctx: NodeContext):
        (a, sa), (b, sb) = _sym_dims(ctx, 0), _sym_dims(ctx, 1)
        if len(a) == 1 and len(b) > 1:
            a = a * len(b)
        if len(b) == 1 and len(a) > 1:
            b = b * len(a)
        if len(a) != len(b):
            raise ctx.unsupported(f"symbolic shapes of lengths {len(a)} and {len(b)} do not broadcast")
        out = []
        for p, q in zip(a, b):
            if op == "mul":
                out.append(q * p if isinstance(q, Sym) else p * q)
            elif isinstance(p, int) and isinstance(q, int):
                out.append(abs(p) // abs(q) * (1 if (p < 0) == (q < 0) else -1))  # ONNX Div truncates
            else:
                try:
                    out.append(p // q)  # exact for Sym, ShapeError otherwise
                except (ShapeError, TypeError, AttributeError):
                    raise ctx.unsupported(f"{p} / {q} is not a whole size") from None
        return sym_or_const(out, scalar=sa and sb, dtype=ctx.dtype(0))

    return run


def _sym_prod(ctx: NodeContext):
    dims, scalar = _sym_dims(ctx, 0)
    axes = ctx.ints(1, "axes") if ctx.opset >= 18 else ctx.attr("axes")
    if scalar or axes not in (None, [], [0], [-1]):
        raise ctx.unsupported("ReduceProd of a symbolic shape other than over its only axis")
    out: Dim = 1
    for d in dims:
        out = d * out
    return sym_or_const([out], scalar=not ctx.attr("keepdims", 1))


MATH_OPS: dict[str, Converter] = {
    "Abs": _unary(Op.ABS),
    "Neg": _unary(Op.NEG),
    "Exp": _unary(Op.EXP),
    "Log": _unary(Op.LOG),
    "Sqrt": _unary(Op.SQRT),
    "Reciprocal": _unary(Op.RECIPROCAL),
    "Sin": _unary(Op.SIN),
    "Cos": _unary(Op.COS),
    "Tanh": _unary(Op.TANH),
    "Sigmoid": _unary(Op.SIGMOID),
    "Erf": _unary(Op.ERF),
    "Softplus": _unary(Op.SOFTPLUS),
    "Floor": _unary(Op.FLOOR),
    "Ceil": _unary(Op.CEIL),
    "Round": _unary(Op.ROUND),
    "Sign": _unary(Op.SIGN),
    "Not": _unary(Op.NOT),
    "Relu": _relu,
    "LeakyRelu": _leaky_relu,
    "PRelu": _prelu,
    "Elu": _elu,
    "Selu": _selu,
    "Celu": _celu,
    "ThresholdedRelu": _thresholded_relu,
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish,
    "Softsign": _softsign,
    "Shrink": _shrink,
    "Mish": _mish,
    "Swish": _swish,
    "Gelu": _gelu,
    "Sinh": _sinh_cosh(-1),
    "Cosh": _sinh_cosh(1),
    "Tan": _tan,
    "IsNaN": _isnan,
    "IsInf": _isinf,
    "Identity": _identity,
    "Dropout": _dropout,
    "Add": _binary(Op.ADD),
    "Sub": _binary(Op.SUB),
    "Mul": _binary(Op.MUL),
    "Div": _binary(Op.DIV),
    "Pow": _pow,
    "Mod": _mod,
    "Equal": _binary(Op.EQ),
    "Less": _binary(Op.LT),
    "Greater": _binary(Op.GT),
    "LessOrEqual": _binary(Op.LE),
    "GreaterOrEqual": _binary(Op.GE),
    "And": _binary(Op.AND),
    "Or": _binary(Op.OR),
    "Xor": _xor,
    "BitShift": _bitshift,
    "Max": _variadic(Op.MAX),
    "Min": _variadic(Op.MIN),
    "Sum": _variadic(Op.ADD),
    "Mean": _variadic(Op.ADD, True),
    "Where": _where,
    "Clip": _clip,
    "Cast": _cast,
    "CastLike": _cast_like,
    "ReduceSum": _reduce("sum", 13),
    "ReduceMean": _reduce("mean"),
    "ReduceMax": _reduce("max"),
    "ReduceMin": _reduce("min"),
    "ReduceProd": _reduce("prod"),
    "ReduceL1": _reduce("l1"),
    "ReduceL2": _reduce("l2"),
    "ReduceSumSquare": _reduce("sum_square"),
    "ReduceLogSum": _reduce("log_sum"),
    "ReduceLogSumExp": _reduce("log_sum_exp"),
    "ArgMax": _arg(Op.ARGMAX),
    "ArgMin": _arg(Op.ARGMIN),
    "CumSum": _cumsum,
}

SYM_OPS: dict[str, Converter] = {
    "Gather": _sym_gather,
    "Concat": _sym_concat,
    "Unsqueeze": _sym_unsqueeze,
    "Squeeze": _sym_squeeze,
    "Slice": _sym_slice,
    "Cast": _cast,
    "CastLike": _cast_like,
    "Identity": _identity,
    "Mul": _sym_arith("mul"),
    "Div": _sym_arith("div"),
    "ReduceProd": _sym_prod,
}

__all__ = ["MATH_OPS", "SYM_OPS", "clamp", "second_operand"]
