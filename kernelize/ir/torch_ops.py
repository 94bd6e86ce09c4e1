"""The aten op table of the torch front end: ``ATEN[op](tracer, *args, **kwargs) -> value``.

Each handler receives the tracer (``kernelize.ir.torch_frontend._Builder``: its graph ``t.g``, the fx node
being mapped ``t.node`` and helpers) and the op's arguments with fx nodes replaced by their IR values
(:class:`Node`, tuples of them, or dims). Handlers express torch semantics with builder calls; the tracer
then checks the result's shape against torch's and casts it to torch's result dtype, so handlers only cast
operands where torch's type promotion changes the math (true division of integers, mixed dtypes).

Example:
    >>> ATEN[torch.ops.aten.relu.default]  # doctest: +SKIP
    <function _relu ...>
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernelize.ir.aten_table import ATEN, Handler, Lazy, handles
from kernelize.ir.dtypes import HALF, DType
from kernelize.ir.graph import Node, Op, scalar_value
from kernelize.ir.shapes import Sym

aten = torch.ops.aten


# -- elementwise --------------------------------------------------------------------------------------------
_UNARY = {
    aten.exp.default: Op.EXP,
    aten.log.default: Op.LOG,
    aten.sqrt.default: Op.SQRT,
    aten.rsqrt.default: Op.RSQRT,
    aten.reciprocal.default: Op.RECIPROCAL,
    aten.sin.default: Op.SIN,
    aten.cos.default: Op.COS,
    aten.tanh.default: Op.TANH,
    aten.sigmoid.default: Op.SIGMOID,
    aten.erf.default: Op.ERF,
    aten.neg.default: Op.NEG,
    aten.abs.default: Op.ABS,
    aten.floor.default: Op.FLOOR,
    aten.ceil.default: Op.CEIL,
    aten.round.default: Op.ROUND,
    aten.sign.default: Op.SIGN,
    aten.sgn.default: Op.SIGN,
}
_ARITH = {
    aten.add.Tensor: Op.ADD,
    aten.add.Scalar: Op.ADD,
    aten.sub.Tensor: Op.SUB,
    aten.sub.Scalar: Op.SUB,
    aten.mul.Tensor: Op.MUL,
    aten.mul.Scalar: Op.MUL,
    aten.div.Tensor: Op.DIV,
    aten.div.Scalar: Op.DIV,
    aten.pow.Tensor_Scalar: Op.POW,
    aten.pow.Tensor_Tensor: Op.POW,
    aten.pow.Scalar: Op.POW,
    aten.minimum.default: Op.MIN,
    aten.maximum.default: Op.MAX,
}
_COMPARE = {
    aten.eq.Tensor: Op.EQ,
    aten.eq.Scalar: Op.EQ,
    aten.ne.Tensor: Op.NE,
    aten.ne.Scalar: Op.NE,
    aten.lt.Tensor: Op.LT,
    aten.lt.Scalar: Op.LT,
    aten.le.Tensor: Op.LE,
    aten.le.Scalar: Op.LE,
    aten.gt.Tensor: Op.GT,
    aten.gt.Scalar: Op.GT,
    aten.ge.Tensor: Op.GE,
    aten.ge.Scalar: Op.GE,
}
_LOGICAL = {
    aten.logical_and.default: Op.AND,
    aten.logical_or.default: Op.OR,
    aten.logical_xor.default: Op.NE,
    aten.bitwise_and.Tensor: Op.AND,
    aten.bitwise_or.Tensor: Op.OR,
    aten.bitwise_xor.Tensor: Op.NE,
}


def _unary(op: Op) -> Handler:
    def handler(t, x):
        return t.g.unary(op, t.cast(x, t.out_dtype()))

    return handler


def _arith(op: Op) -> Handler:
    def handler(t, a, b, *, alpha=1):
        dtype = t.out_dtype()
        if alpha != 1:
            b = t.g.mul(t.cast(b, dtype), alpha) if isinstance(b, Node) else b * alpha
        if op in (Op.MUL, Op.DIV) and dtype in HALF and _cpu_scalar(b):
            return _opmath(t, op, a, b)
        return t.g.binary(op, t.cast(a, dtype), t.cast(b, dtype))

    return handler


def _cpu_scalar(b: Any) -> bool:
    """A 0-d tensor of a wider type as the second operand: torch reads it like a python scalar (at opmath
    precision) in ``x * s`` and ``x / s`` (the builder does the same for python scalars)."""
    return isinstance(b, Node) and b.rank == 0 and b.dtype not in HALF


def _opmath(t, op: Op, a: Any, b: Node) -> Node:
    """``a op b`` computed in f32 with ``b`` at f32 precision; the tracer rounds the result to 16 bits."""
    value = scalar_value(b)
    if value is not None and not isinstance(value, bool):
        return t.g.binary(op, t.cast(a, t.out_dtype()), value)
    return t.g.binary(op, t.cast(a, DType.F32), t.cast(b, DType.F32))


def _compare(op: Op) -> Handler:
    def handler(t, a, b):
        dtype = _common(a, b)
        return t.g.binary(op, t.cast(a, dtype), t.cast(b, dtype))

    return handler


def _logical(op: Op) -> Handler:
    def handler(t, a, b):
        return t.g.binary(op, _truth(t, a), _truth(t, b))

    return handler


def _truth(t, x):
    if not isinstance(x, Node):
        return bool(x)
    return x if x.dtype is DType.BOOL else t.g.ne(x, 0)


def _common(a: Any, b: Any) -> DType:
    """torch's type promotion of two operands (tensors or python scalars)."""

    def rep(v):
        return torch.empty((1,) * min(v.rank, 1), dtype=v.dtype.torch) if isinstance(v, Node) else v

    return DType.from_torch(torch.result_type(rep(a), rep(b)))


ATEN.update({op: _unary(o) for op, o in _UNARY.items()})
ATEN.update({op: _arith(o) for op, o in _ARITH.items()})
ATEN.update({op: _compare(o) for op, o in _COMPARE.items()})
ATEN.update({op: _logical(o) for op, o in _LOGICAL.items()})


@handles(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(t, a, b, *, alpha=1):
    return _arith(Op.SUB)(t, b, a if alpha == 1 else t.g.mul(a, alpha))


@handles(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(t, a, b, *, rounding_mode=None):
    dtype = t.out_dtype()
    if dtype in HALF and (not isinstance(b, Node) or _cpu_scalar(b)):
        dtype = DType.F32  # torch divides by a scalar in f32 (opmath) and rounds once
    a, b = t.cast(a, dtype), t.cast(b, dtype)
    if rounding_mode is None:
        return t.g.div(a, b)
    if dtype.is_float:
        return _floor_div(t, a, b) if rounding_mode == "floor" else _trunc(t, t.g.div(a, b))
    if rounding_mode == "trunc":
        return t.g.div(a, b)  # the IR's integer division truncates
    return t.g.div(t.g.sub(a, t.g.mod(a, b)), b)  # a - a mod b is a multiple of b: exact


def _fmod_floor_fix(t, m, b):
    """Whether the C remainder `m` of a / b has the other sign than b (floor semantics step down)."""
    return t.g.and_(t.g.ne(m, 0), t.g.ne(t.g.lt(b, 0), t.g.lt(m, 0)))


def _floor_div(t, a, b):
    """torch's float floor division (c10 `div_floor_floating`), not floor(a / b): that rounds
    once too often for large quotients and gives inf for inf // 2 where torch gives nan."""
    b = b if isinstance(b, Node) else t.g.scalar(b, a.dtype)  # the sign tests need b as a node
    q = t.g.div(a, b)
    m = t.g.mod(a, b)  # float MOD is C fmod
    div = t.g.div(t.g.sub(a, m), b)
    div = t.g.where(_fmod_floor_fix(t, m, b), t.g.sub(div, 1), div)
    fl = t.g.floor(div)
    fl = t.g.where(t.g.gt(t.g.sub(div, fl), 0.5), t.g.add(fl, 1), fl)
    fl = t.g.where(t.g.ne(div, 0), fl, t.g.mul(q, 0))  # a zero quotient keeps the sign of a / b
    return t.g.where(t.g.eq(b, 0), q, fl)


def _trunc(t, x):
    return t.g.where(t.g.lt(x, 0), t.g.ceil(x), t.g.floor(x))


@handles(aten.trunc.default)
def _trunc_op(t, x):
    return _trunc(t, x) if x.dtype.is_float else x


@handles(aten.remainder.Tensor, aten.remainder.Scalar)
def _remainder(t, a, b):
    dtype = t.out_dtype()
    a, b = t.cast(a, dtype), t.cast(b, dtype)
    if not dtype.is_float:
        return t.g.mod(a, b)  # integer mod is floor-mod, like torch.remainder
    b = b if isinstance(b, Node) else t.g.scalar(b, dtype)
    m = t.g.mod(a, b)  # C fmod is exact; a - floor(a / b) * b is not for large quotients
    return t.g.where(_fmod_floor_fix(t, m, b), t.g.add(m, b), m)


@handles(aten.fmod.Tensor, aten.fmod.Scalar)
def _fmod(t, a, b):
    dtype = t.out_dtype()
    a, b = t.cast(a, dtype), t.cast(b, dtype)
    if dtype.is_float:
        return t.g.mod(a, b)  # float mod is C fmod
    return t.g.sub(a, t.g.mul(t.g.div(a, b), b))


@handles(aten.where.self)
def _where(t, cond, a, b):
    dtype = t.out_dtype()
    return t.g.where(_truth(t, cond), t.cast(a, dtype), t.cast(b, dtype))


@handles(aten.logical_not.default, aten.bitwise_not.default)
def _not(t, x):
    if t.node.target is aten.bitwise_not.default and x.dtype is not DType.BOOL:
        raise t.fail("bitwise not of an integer tensor is not supported (only of bool)")
    return t.g.not_(_truth(t, x))


@handles(aten.relu.default)
def _relu(t, x):
    return t.g.clamp(x, 0.0)


@handles(aten.hardtanh.default)
def _hardtanh(t, x, lo=-1.0, hi=1.0):
    return t.g.clamp(x, lo, hi)


@handles(aten.clamp.default)
def _clamp(t, x, lo=None, hi=None):
    x = t.cast(x, t.out_dtype())
    return t.g.clamp(x, -math.inf if lo is None else lo, math.inf if hi is None else hi)


@handles(aten.clamp.Tensor)
def _clamp_tensor(t, x, lo=None, hi=None):
    dtype = t.out_dtype()
    x = t.cast(x, dtype)
    x = x if lo is None else t.g.max(x, t.cast(lo, dtype))
    return x if hi is None else t.g.min(x, t.cast(hi, dtype))


@handles(aten.leaky_relu.default)
def _leaky_relu(t, x, slope=0.01):
    return t.g.where(t.g.gt(x, 0), x, t.g.mul(x, slope))


@handles(aten.elu.default)
def _elu(t, x, alpha=1.0, scale=1.0, input_scale=1.0):
    neg = t.g.mul(t.g.sub(t.g.exp(t.g.mul(x, input_scale)), 1.0), alpha * scale)
    return t.g.where(t.g.gt(x, 0), t.g.mul(x, scale), neg)


@handles(aten.silu.default)
def _silu(t, x):
    return t.g.mul(x, t.g.sigmoid(x))


@handles(aten.hardsigmoid.default)
def _hardsigmoid(t, x):
    return t.g.clamp(t.g.add(t.g.div(x, 6.0), 0.5), 0.0, 1.0)


@handles(aten.hardswish.default)
def _hardswish(t, x):
    return t.g.mul(x, _hardsigmoid(t, x))


@handles(aten.mish.default)
def _mish(t, x):
    return t.g.mul(x, t.g.tanh(t.g.softplus(x)))


@handles(aten.gelu.default)
def _gelu(t, x, *, approximate="none"):
    return t.g.gelu(x, approximate)


@handles(aten.softplus.default)
def _softplus(t, x, beta=1, threshold=20):
    if beta == 1 and threshold == 20:
        return t.g.softplus(x)
    y = t.g.mul(x, beta)
    return t.g.where(t.g.gt(y, threshold), x, t.g.div(t.g.softplus(y), beta))


@handles(aten.log1p.default)
def _log1p(t, x):
    return t.g.log(t.g.add(t.cast(x, t.out_dtype()), 1.0))


@handles(aten.expm1.default)
def _expm1(t, x):
    return t.g.sub(t.g.exp(t.cast(x, t.out_dtype())), 1.0)


@handles(aten.exp2.default)
def _exp2(t, x):
    return t.g.exp(t.g.mul(t.cast(x, t.out_dtype()), math.log(2.0)))


@handles(aten.log2.default, aten.log10.default)
def _log_base(t, x):
    base = 2.0 if t.node.target is aten.log2.default else 10.0
    return t.g.mul(t.g.log(t.cast(x, t.out_dtype())), 1.0 / math.log(base))


@handles(aten.erfc.default)
def _erfc(t, x):
    return t.g.sub(1.0, t.g.erf(t.cast(x, t.out_dtype())))


@handles(aten.isnan.default)
def _isnan(t, x):
    return t.g.ne(x, x)


# -- casts and identities -----------------------------------------------------------------------------------
@handles(
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.to.other,
    aten.type_as.default,
)
def _to(t, x, *args, **kwargs):
    return t.cast(x, t.out_dtype())


@handles(
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten.lift_fresh.default,
    aten.positive.default,
    aten.real.default,
)
def _identity(t, x, *args, **kwargs):
    return x


@handles(aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default)
def _dropout(t, x, p, train):
    if train and p > 0:
        raise t.fail("dropout in training mode: call module.eval() before kernelize.ir.trace")
    return x


@handles(aten.native_dropout.default)
def _native_dropout(t, x, p, train):
    _dropout(t, x, p, train if train is not None else True)
    return x, Lazy(lambda: t.g.broadcast(t.g.scalar(True, DType.BOOL), x.shape))


# -- creation -----------------------------------------------------------------------------------------------
@handles(
    aten.full.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.new_full.default,
    aten.scalar_tensor.default,
)
def _full(t, like_or_size, value=None, *args, **kwargs):
    target = t.node.target
    if target is aten.zeros_like.default or target is aten.ones_like.default:
        value = float(target is aten.ones_like.default)
    if target is aten.scalar_tensor.default:
        value, like_or_size = like_or_size, ()
    if target is aten.new_full.default:
        like_or_size, value = value, args[0]
    shape = like_or_size.shape if isinstance(like_or_size, Node) else tuple(like_or_size)
    return t.g.broadcast(t.g.scalar(value, t.out_dtype()), shape)


@handles(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(t, *args, **kwargs):
    if any(isinstance(a, Sym) for a in args):
        raise t.fail("arange with a symbolic size is not supported")
    kwargs = {k: v for k, v in kwargs.items() if k in ("dtype",)}
    return t.g.const(torch.arange(*args, **kwargs).to(t.out_dtype().torch))


# python-level ops in pre-dispatch graphs that carry no tensor math
IGNORED = frozenset(
    {
        torch._C._set_grad_enabled,
        aten._assert_tensor_metadata.default,
        aten._assert_scalar.default,
        aten.sym_constrain_range_for_size.default,
        aten._assert_async.msg,
    }
)

# layout, reductions, norms and matmul/conv/pool handlers register themselves into ATEN
from kernelize.ir import torch_ops_layers as _layers  # noqa: E402, F401

__all__ = ["ATEN", "IGNORED", "Lazy"]
