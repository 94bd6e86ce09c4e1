"""Graph operations: a string enum plus named groups (in dumps an op reads as its value, e.g. ``add``)."""

from __future__ import annotations

from kernelize._compat import StrEnum


class Op(StrEnum):
    # sources
    INPUT = "input"
    CONST = "const"
    # layout: become strides and offsets in kernels
    VIEW = "view"
    BROADCAST = "broadcast"
    PERMUTE = "permute"
    SLICE = "slice"
    FLIP = "flip"
    # data movement that needs its own indexing
    GATHER = "gather"
    CONCAT = "concat"
    PAD = "pad"
    # heavy ops
    MATMUL = "matmul"
    CONV = "conv"
    POOL = "pool"
    # unary
    ABS = "abs"
    NEG = "neg"
    EXP = "exp"
    LOG = "log"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    RECIPROCAL = "reciprocal"
    SIN = "sin"
    COS = "cos"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    ERF = "erf"
    SOFTPLUS = "softplus"
    FLOOR = "floor"
    CEIL = "ceil"
    ROUND = "round"
    SIGN = "sign"
    NOT = "not"
    CAST = "cast"
    CLAMP = "clamp"
    GELU = "gelu"
    # binary
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MIN = "min"
    MAX = "max"
    POW = "pow"
    MOD = "mod"
    EQ = "eq"
    NE = "ne"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    AND = "and"
    OR = "or"
    # ternary
    WHERE = "where"
    # reductions (keep the reduced axes as size 1)
    SUM = "sum"
    MEAN = "mean"
    REDUCE_MAX = "reduce_max"
    REDUCE_MIN = "reduce_min"
    PROD = "prod"
    ARGMAX = "argmax"
    ARGMIN = "argmin"
    # compound row ops that passes recognise (over the last axis, or `arg` axis for softmax)
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log_softmax"
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


# values that come from outside any kernel
SOURCE = frozenset({Op.INPUT, Op.CONST})
# pure re-indexing of one operand: strides and offsets, never a copy
LAYOUT = frozenset({Op.VIEW, Op.BROADCAST, Op.PERMUTE, Op.SLICE, Op.FLIP})
# one output element from the same-index elements of the operands
UNARY = frozenset({Op.ABS, Op.NEG, Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.RECIPROCAL, Op.SIN, Op.COS,
    Op.TANH, Op.SIGMOID, Op.ERF, Op.SOFTPLUS, Op.FLOOR, Op.CEIL, Op.ROUND, Op.SIGN, Op.NOT, Op.CAST,
    Op.CLAMP, Op.GELU})
COMPARE = frozenset({Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MIN, Op.MAX, Op.POW, Op.MOD, Op.AND, Op.OR}) | COMPARE
ELEMENTWISE = UNARY | BINARY | {Op.WHERE}
# reductions over `arg` axes
REDUCE = frozenset({Op.SUM, Op.MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN, Op.PROD, Op.ARGMAX, Op.ARGMIN})
# row ops: a reduction and its elementwise use in one op
ROW = frozenset({Op.SOFTMAX, Op.LOG_SOFTMAX, Op.LAYERNORM, Op.RMSNORM})
# unary ops defined on floats only
FLOAT_ONLY = frozenset({Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.RECIPROCAL, Op.SIN, Op.COS, Op.TANH,
    Op.SIGMOID, Op.ERF, Op.SOFTPLUS, Op.GELU})
