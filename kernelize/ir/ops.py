"""Graph operations: a string enum plus named groups (in dumps an op reads as its value, e.g. ``add``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from kernelize._compat import StrEnum

if TYPE_CHECKING:
    from kernelize.ir.score_mod import ScoreMod

OPTIONAL = {"optional": True}  # dataclass field metadata: the printer leaves the field out at its default


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
    PAD = "pad"  # arg: PadArgs
    # heavy ops
    MATMUL = "matmul"
    CONV = "conv"  # arg: ConvArgs
    POOL = "pool"  # arg: PoolArgs
    ATTENTION = "attention"  # softmax(scale * q @ k^T + mask) @ v, fused (arg: AttentionArgs)
    EXPERTS = "experts"  # routed mixture-of-experts MLPs with their weighted combine (arg: ExpertsArgs)
    # selection along the last axis (kernelize.ir.router): two nodes per call, the values and the indices
    TOPK = "topk"  # arg: TopkArgs
    ROUTE = "route"  # a router's scores, bias, top-k, renormalisation and cast in one op (arg: RouteArgs)
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
    LAYERNORM = "layernorm"  # arg: NormArgs
    RMSNORM = "rmsnorm"  # arg: NormArgs (has_bias False)


# values that come from outside any kernel
SOURCE = frozenset({Op.INPUT, Op.CONST})
# pure re-indexing of one operand: strides and offsets, never a copy
LAYOUT = frozenset({Op.VIEW, Op.BROADCAST, Op.PERMUTE, Op.SLICE, Op.FLIP})
# one output element from the same-index elements of the operands
UNARY = frozenset(
    {
        Op.ABS,
        Op.NEG,
        Op.EXP,
        Op.LOG,
        Op.SQRT,
        Op.RSQRT,
        Op.RECIPROCAL,
        Op.SIN,
        Op.COS,
        Op.TANH,
        Op.SIGMOID,
        Op.ERF,
        Op.SOFTPLUS,
        Op.FLOOR,
        Op.CEIL,
        Op.ROUND,
        Op.SIGN,
        Op.NOT,
        Op.CAST,
        Op.CLAMP,
        Op.GELU,
    }
)
COMPARE = frozenset({Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MIN, Op.MAX, Op.POW, Op.MOD, Op.AND, Op.OR}) | COMPARE
ELEMENTWISE = UNARY | BINARY | {Op.WHERE}
# reductions over `arg` axes
REDUCE = frozenset({Op.SUM, Op.MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN, Op.PROD, Op.ARGMAX, Op.ARGMIN})
# row ops: a reduction and its elementwise use in one op
ROW = frozenset({Op.SOFTMAX, Op.LOG_SOFTMAX, Op.LAYERNORM, Op.RMSNORM})
# unary ops defined on floats only
FLOAT_ONLY = UNARY - {Op.ABS, Op.NEG, Op.FLOOR, Op.CEIL, Op.ROUND, Op.SIGN, Op.NOT, Op.CAST, Op.CLAMP}

# mask kinds of an attention op: no mask, a boolean keep-mask, an additive float mask
ATTENTION_MASKS = ("none", "bool", "add")


@dataclass(frozen=True)
class AttentionArgs:
    """The attributes of an ``ATTENTION`` node.

    Attributes:
        scale: multiplies ``q @ k^T`` before the mask.
        causal: key ``j`` is dropped for query ``i`` when ``j > i`` (top-left aligned, as torch's
            ``is_causal``).
        mask: ``"none"``, ``"bool"`` (the 4th operand keeps a score where True) or ``"add"`` (the 4th
            operand is added to the scores).
        groups: query heads per key/value head (grouped-query attention; 1 = one key head per query head).
        score_mod: a :class:`~kernelize.ir.score_mod.ScoreMod` applied to the scaled scores before the causal
            cut and the mask (soft-capping, a sliding window, ...); None: none.
        sinks: the last operand is an f32 logit per query head ``[Hq]`` that joins every row's softmax as a
            key whose value is zero (attention sinks, gpt-oss): it takes a share of the weights and adds
            nothing to the output.
    """

    scale: float
    causal: bool = False
    mask: str = "none"
    groups: int = 1
    score_mod: ScoreMod | None = field(default=None, metadata=OPTIONAL)
    sinks: bool = field(default=False, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        if self.mask not in ATTENTION_MASKS:
            raise ValueError(f"AttentionArgs.mask must be one of {ATTENTION_MASKS}, got {self.mask!r}")
        if self.groups < 1:
            raise ValueError(f"AttentionArgs.groups must be >= 1, got {self.groups}")
        object.__setattr__(self, "scale", float(self.scale))


# activations of an EXPERTS op's MLPs (their formulas: kernelize.ir.experts.ACTIVATIONS)
EXPERT_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")


@dataclass(frozen=True)
class ExpertsArgs:
    """The attributes of an ``EXPERTS`` node (:mod:`kernelize.ir.experts`).

    Attributes:
        act: the MLPs' activation, one of ``EXPERT_ACTIVATIONS``.
        gated: the up weight is ``[gate; up]`` (``act(x @ gate^T) * (x @ up^T)``, Llama-style experts);
            False: one up weight (``act(x @ up^T)``).
        interleaved: the gate and up rows alternate (gate row j is row 2j, up row j is 2j + 1: gpt-oss)
            instead of the gate rows then the up rows.
        bias: the node has two more operands, the up bias ``[E, N]`` (rows as the up weight's) and the down
            bias ``[E, H]``, added before the gate and before the routing weight.
        alpha, gate_limit, act_limit, up_limit, up_shift: the gate's form (gated experts):
            ``h = min(act(min(g, gate_limit)), act_limit) * (clamp(u, -up_limit, up_limit) + up_shift)``, a
            limit of None being no clamp and ``alpha`` scaling silu's sigmoid (``v * sigmoid(alpha * v)``).
            The defaults give ``act(g) * u``; gpt-oss clamps g and u at 7 with alpha 1.702 and shift 1.

    Example:
        >>> ExpertsArgs("silu")
        ExpertsArgs(act='silu', gated=True)
        >>> oss = ExpertsArgs("silu", interleaved=True, gate_limit=7.0, up_limit=7.0, alpha=1.702, up_shift=1)
        >>> oss.plain, oss.gate_form
        (False, (1.702, 7.0, None, 7.0, 1.0))
    """

    act: str
    gated: bool = True
    interleaved: bool = field(default=False, metadata=OPTIONAL)
    bias: bool = field(default=False, metadata=OPTIONAL)
    alpha: float = field(default=1.0, metadata=OPTIONAL)
    gate_limit: float | None = field(default=None, metadata=OPTIONAL)
    act_limit: float | None = field(default=None, metadata=OPTIONAL)
    up_limit: float | None = field(default=None, metadata=OPTIONAL)
    up_shift: float = field(default=0.0, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        if self.act not in EXPERT_ACTIVATIONS:
            raise ValueError(f"ExpertsArgs.act must be one of {EXPERT_ACTIVATIONS}, got {self.act!r}")
        for name in ("alpha", "up_shift", "gate_limit", "act_limit", "up_limit"):  # one spelling per value
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else float(value))
        if self.alpha != 1.0 and self.act != "silu":
            raise ValueError(f"ExpertsArgs.alpha scales silu's sigmoid; act is {self.act!r}")
        if not self.gated and (self.interleaved or self.gate_form != _PLAIN_GATE):
            raise ValueError("ExpertsArgs: interleaved rows and a gate form need gated experts")

    @property
    def gate_form(self) -> tuple:
        """(alpha, gate_limit, act_limit, up_limit, up_shift)."""
        return (self.alpha, self.gate_limit, self.act_limit, self.up_limit, self.up_shift)

    @property
    def form(self) -> dict:
        """The keywords of ``Graph.experts`` beside act, gated and the biases: interleaving, the gate form."""
        return {f.name: getattr(self, f.name) for f in fields(self)[2:] if f.name != "bias"}

    @property
    def plain(self) -> bool:
        """No interleaving, biases or gate form: what every backend's kernel runs."""
        return not (self.interleaved or self.bias) and self.gate_form == _PLAIN_GATE

    def __repr__(self) -> str:
        more = "".join(
            f", {f.name}={getattr(self, f.name)!r}"
            for f in fields(self)[2:]
            if getattr(self, f.name) != f.default
        )
        return f"ExpertsArgs(act={self.act!r}, gated={self.gated!r}{more})"


_PLAIN_GATE = (1.0, None, None, None, 0.0)


@dataclass(frozen=True)
class NormArgs:
    """The attributes of a ``LAYERNORM`` or ``RMSNORM`` node.

    Attributes:
        eps: added to the variance (layernorm) or the mean square (rmsnorm) before the square root.
        has_weight: the node's second operand is a weight over the last axis.
        has_bias: the next operand is a bias over the last axis (layernorm only).

    Example:
        >>> NormArgs(1e-6, has_weight=True)
        NormArgs(eps=1e-06, has_weight=True, has_bias=False)
    """

    eps: float
    has_weight: bool = False
    has_bias: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "has_weight", bool(self.has_weight))
        object.__setattr__(self, "has_bias", bool(self.has_bias))

    @property
    def params(self) -> int:
        """How many operands follow the input (weight and bias)."""
        return self.has_weight + self.has_bias


@dataclass(frozen=True)
class ConvArgs:
    """The attributes of a ``CONV`` node (2-D, NCHW input, OIHW weight).

    Attributes:
        stride: (height, width) steps of the window.
        padding: zeros added (top, left, bottom, right).
        dilation: (height, width) spacing of the kernel taps.
        groups: input and output channels split into this many independent convolutions.
    """

    stride: tuple[int, int]
    padding: tuple[int, int, int, int]
    dilation: tuple[int, int]
    groups: int = 1

    def __post_init__(self) -> None:
        for f in ("stride", "padding", "dilation"):
            object.__setattr__(self, f, tuple(getattr(self, f)))


@dataclass(frozen=True)
class PoolArgs:
    """The attributes of a ``POOL`` node (2-D, NCHW).

    Attributes:
        kind: ``"max"`` or ``"avg"``.
        kernel: (height, width) of the window.
        stride: (height, width) steps of the window.
        padding: (top, left, bottom, right); max pooling pads with -inf, average pooling with zeros.
        dilation: (height, width) spacing of the window taps (max pooling only).
        ceil_mode: output sizes round up (a last window must still start inside the input or left padding).
        count_pad: an average counts the padding it covers (torch's ``count_include_pad``).
    """

    kind: str
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: tuple[int, int] = (1, 1)
    ceil_mode: bool = False
    count_pad: bool = False

    def __post_init__(self) -> None:
        for f in ("kernel", "stride", "padding", "dilation"):
            object.__setattr__(self, f, tuple(getattr(self, f)))
        object.__setattr__(self, "ceil_mode", bool(self.ceil_mode))
        object.__setattr__(self, "count_pad", bool(self.count_pad))


@dataclass(frozen=True)
class PadArgs:
    """The attributes of a ``PAD`` node.

    Attributes:
        pads: ``(before, after)`` per axis, each >= 0 (the builder turns negative pads into slices).
        value: the constant the new elements hold.
    """

    pads: tuple[tuple[int, int], ...]
    value: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "pads", tuple((lo, hi) for lo, hi in self.pads))
        object.__setattr__(self, "value", float(self.value))


@dataclass(frozen=True)
class ClampArgs:
    """The bounds of a ``CLAMP`` node: ``min(max(x, lo), hi)``, as ``torch.clamp`` (even when they cross).

    Example:
        >>> ClampArgs(0, 6)  # relu6
        ClampArgs(lo=0.0, hi=6.0)
    """

    lo: float = -math.inf
    hi: float = math.inf

    def __post_init__(self) -> None:
        object.__setattr__(self, "lo", float(self.lo))
        object.__setattr__(self, "hi", float(self.hi))


@dataclass(frozen=True)
class ConcatArgs:
    """The arg of a ``CONCAT`` inside a kernel body (the graph node's arg is just the axis): the value is
    operand ``i`` for the first ``i`` with ``index[axis] < ends[i]``.

    Example:
        >>> ConcatArgs(1, (13, 19))  # operands of 13 and 6 columns
        ConcatArgs(axis=1, ends=(13, 19))
    """

    axis: int
    ends: tuple  # cumulative sizes along ``axis`` (ints or symbolic dims)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ends", tuple(self.ends))


@dataclass(frozen=True)
class TopkArgs:
    """The attributes of a ``TOPK`` node: the ``k`` largest values along the last axis, largest first, ties
    to the lower index (:mod:`kernelize.ir.router`). A call is two nodes: the values (``indices`` False,
    the operand's dtype) and the int64 indices (``indices`` True)."""

    k: int
    indices: bool = False


# what a router does to its logits before choosing: softmax, sigmoid, or nothing (gpt-oss chooses on logits)
ROUTE_SCORES = ("softmax", "sigmoid", "none")
# what it does to the K chosen scores after: nothing, divide by their sum (+ eps), a softmax over them
ROUTE_RENORMS = ("none", "sum", "softmax")


@dataclass(frozen=True)
class RouteArgs:
    """The attributes of a ``ROUTE`` node (:mod:`kernelize.ir.router`): per row of logits ``x [..., E]``::

        s = score(x)                      (f32; softmax, sigmoid or x itself)
        index = topk(s + bias, k)         (bias: an optional second operand [E], for the choice only)
        w = renorm(s[index]) * scale      (none, s / (sum + eps), softmax over the K)

    A call is two nodes with equal fields but ``indices``: the weights (in the node's float dtype) and the
    int64 indices; the planner runs both in one kernel. Index nodes keep the defaults of the weight-only
    fields (renorm, eps, scale), so both twins of one router share :attr:`choice`.

    Example:
        >>> RouteArgs(8, "softmax", renorm="sum").choice
        (8, 'softmax', False)
    """

    k: int
    score: str = "softmax"
    bias: bool = field(default=False, metadata=OPTIONAL)
    renorm: str = field(default="none", metadata=OPTIONAL)
    eps: float = field(default=0.0, metadata=OPTIONAL)
    scale: float = field(default=1.0, metadata=OPTIONAL)
    indices: bool = field(default=False, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        if self.score not in ROUTE_SCORES or self.renorm not in ROUTE_RENORMS:
            raise ValueError(
                f"RouteArgs: score must be one of {ROUTE_SCORES} and renorm one of {ROUTE_RENORMS}, got "
                f"{self.score!r}, {self.renorm!r}"
            )
        if self.k < 1:
            raise ValueError(f"RouteArgs.k must be >= 1, got {self.k}")
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "scale", float(self.scale))

    @property
    def choice(self) -> tuple:
        """What decides the indices (k, score, bias): equal for the two twins of one router."""
        return (self.k, self.score, self.bias)


# typed op arguments (printed field by field)
TYPED_ARGS = (
    TopkArgs,
    RouteArgs,
    AttentionArgs,
    ExpertsArgs,
    NormArgs,
    ConvArgs,
    PoolArgs,
    PadArgs,
    ClampArgs,
    ConcatArgs,
)
