"""Whole-graph checks: every node's shape and dtype rule, topological order, inputs and outputs.

The builder checks each node as it is made; ``verify`` re-checks a finished graph (for example after a
pass that pushed nodes directly) by re-building every node from placeholders of its operands' shapes and
dtypes with the builder's own rules, so the two can never disagree.

Example:
    >>> g = Graph()
    >>> x = g.input("x", ("batch", 8), "f32")
    >>> g.output(g.exp(x))
    >>> verify(g)  # returns None; raises VerifyError listing every problem otherwise
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kernelize.ir.attention import split_operands
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import BINARY, UNARY, Constant, DTypeError, Graph, Node, Op
from kernelize.ir.ops import (
    AttentionArgs,
    ClampArgs,
    ConvArgs,
    ExpertsArgs,
    NormArgs,
    PadArgs,
    PoolArgs,
    RouteArgs,
    TopkArgs,
)
from kernelize.ir.printer import format_node
from kernelize.ir.shapes import ShapeError, Sym, shape_str, symbols
from kernelize.ir.stats import STATS

# how many problems one VerifyError lists before it stops
MAX_PROBLEMS = 20


class VerifyError(ValueError):
    """The graph breaks an IR rule; the message names every offending node (``%12 = add(%3, %4) ...``)."""


def verify(graph: Graph) -> None:
    """Check ``graph``; raise :class:`VerifyError` naming each bad node and its problem.

    Checks: node identity and index bookkeeping, operands defined before use (topological order), every
    node's dtype and shape against the builder's rule for its op, operands of elementwise ops already
    broadcast to the result shape, inputs registered and uniquely named, symbolic dims bound by some
    input, outputs in the graph.

    Example:
        >>> verify(trace(torch.nn.LayerNorm(8), torch.randn(2, 8)))  # doctest: +SKIP
    """
    problems: list[str] = []
    seen: dict[Node, int] = {}

    def bad(node: Node | None, msg: str) -> None:
        where = _describe(graph, node) if node is not None else "graph"
        problems.append(f"{where}: {msg}")

    input_set = set(graph.inputs)
    bound = {n for i in graph.inputs for n in symbols(i.shape)}
    for i, node in enumerate(graph.nodes):
        if node in seen:
            bad(node, f"appears twice in graph.nodes (at %{seen[node]} and %{i})")
            continue
        if graph._index.get(node) != i:
            bad(node, f"index bookkeeping says %{graph._index.get(node)}, position is %{i}")
        late = [s for s in node.src if s not in seen]
        if late:
            bad(
                node,
                "uses " + ", ".join(_ref(graph, s) for s in late) + " before it is defined "
                "(nodes must be in topological order)",
            )
            seen[node] = i
            continue
        seen[node] = i
        free = symbols(node.shape) - bound
        if free:
            bad(node, f"symbolic dims {sorted(free)} are bound by no graph input")
        msg = _check(node)
        if msg:
            bad(node, msg)
        if node.op is Op.INPUT and node not in input_set:
            bad(node, "is an input node missing from graph.inputs")
    _check_io(graph, seen, bad)
    if problems:
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        raise VerifyError(
            f"graph fails verification ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
            + "\n  ".join(problems[:MAX_PROBLEMS])
            + more
        )


def _check_io(graph: Graph, seen: dict[Node, int], bad: Callable[[Node | None, str], None]) -> None:
    """Inputs registered, input nodes and uniquely named; outputs in the graph."""
    names = [i.arg for i in graph.inputs]
    for inp in graph.inputs:
        if inp not in seen:
            bad(None, f"input {inp} is not in graph.nodes")
        elif inp.op is not Op.INPUT:
            bad(inp, "is listed in graph.inputs but is not an input node")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        bad(None, f"input names {dup} are used more than once")
    for k, out in enumerate(graph.outputs):
        if out not in seen:
            bad(None, f"output {k} ({out}) is not in graph.nodes")


def _ref(graph: Graph, node: Node) -> str:
    i = graph._index.get(node)
    return f"%{i}" if i is not None else f"<foreign {node}>"


def _describe(graph: Graph, node: Node) -> str:
    try:
        return format_node(graph, node)
    except KeyError:  # an operand outside the graph
        return f"{node} (operands {', '.join(_ref(graph, s) for s in node.src)})"


def _check(node: Node) -> str | None:
    """None when ``node`` obeys its op's rule, else what is wrong."""
    if not all(
        isinstance(d, Sym) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in node.shape
    ):
        return f"shape {node.shape!r} has a dim that is neither a size >= 0 nor a Sym"
    rule = _RULES.get(node.op)
    if rule is None:
        return f"op {node.op} has no verification rule"
    g = Graph()
    srcs = [g.input(f"s{i}", s.shape, s.dtype) for i, s in enumerate(node.src)]
    try:
        want = rule(g, srcs, node)
    except (ShapeError, DTypeError, ValueError, TypeError, AssertionError, IndexError) as e:
        return f"breaks the {node.op} rule: {e or type(e).__name__}"
    if isinstance(want, str):
        return want
    if want is None:
        return None
    if want.dtype != node.dtype or want.shape != node.shape:
        return (
            f"should be {want.dtype}{shape_str(want.shape)} by the {node.op} rule, "
            f"is {node.dtype}{shape_str(node.shape)}"
        )
    return None


def _nsrc(node: Node, n: int | tuple[int, ...]) -> None:
    ok = (n,) if isinstance(n, int) else n
    if len(node.src) not in ok:
        raise ValueError(f"takes {' or '.join(map(str, ok))} operands, has {len(node.src)}")


def _source(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 0)
    if n.op is Op.INPUT:
        return None if isinstance(n.arg, str) else f"input name {n.arg!r} is not a string"
    if not isinstance(n.arg, Constant):
        return f"constant payload is {type(n.arg).__name__}, not Constant"
    t = n.arg.tensor
    if tuple(t.shape) != n.shape or t.dtype != n.dtype.torch:
        return f"payload is {t.dtype}{list(t.shape)} but the node says {n.dtype}{shape_str(n.shape)}"
    return None


def _same_shape_operands(n: Node) -> str | None:
    off = [i for i, s in enumerate(n.src) if s.shape != n.shape]
    if off:
        return (
            f"operand {off[0]} has shape {shape_str(n.src[off[0]].shape)}, not the result shape "
            f"{shape_str(n.shape)} (elementwise operands must be broadcast explicitly)"
        )
    return None


def _unary(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 1)
    if n.op is Op.CAST:
        return g.push(Op.CAST, n.dtype, s[0].shape, s)
    if n.op is Op.CLAMP:
        a = n.arg
        if not isinstance(a, ClampArgs) or math.isnan(a.lo) or math.isnan(a.hi):
            return f"clamp bounds {a!r} must be ClampArgs of two numbers"
        return g.push(Op.CLAMP, s[0].dtype, s[0].shape, s)
    if n.op is Op.GELU:
        return g.gelu(s[0], n.arg)
    return g.unary(n.op, s[0])


def _elementwise(want: Node, n: Node) -> Any:
    """The rule's result when it disagrees with the node, else the explicit-broadcast check."""
    if want.shape != n.shape or want.dtype != n.dtype:
        return want
    return _same_shape_operands(n)


def _binary(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 2)
    return _elementwise(g.binary(n.op, s[0], s[1]), n)


def _where(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 3)
    return _elementwise(g.where(*s), n)


def _reduce(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 1)
    if not (
        isinstance(n.arg, tuple)
        and list(n.arg) == sorted(set(n.arg))
        and all(isinstance(a, int) and 0 <= a < s[0].rank for a in n.arg)
    ):
        return f"axes {n.arg!r} must be a sorted tuple of distinct axes of the operand"
    return g.reduce(n.op, s[0], n.arg, keepdim=True)


def _view(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 1)
    return g.view(s[0], n.shape) if n.shape != s[0].shape else s[0]


def _broadcast(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 1)
    if s[0].rank != n.rank:
        return f"broadcasts rank {s[0].rank} to rank {n.rank} (a broadcast keeps the rank; view first)"
    return g.broadcast(s[0], n.shape)


def _slice(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 1)
    x = s[0]
    if not isinstance(n.arg, tuple) or len(n.arg) != x.rank:
        return f"ranges {n.arg!r} must hold one (start, stop, step) per axis of the operand"
    shape = []
    for d, (start, stop, step) in zip(x.shape, n.arg):
        if (start, stop, step) == (0, d, 1):
            shape.append(d)
            continue
        if isinstance(d, Sym) or step <= 0 or not 0 <= start <= d or not start <= stop <= d + step - 1:
            return f"range ({start}, {stop}, {step}) does not fit dim {d}"
        shape.append(-(-(stop - start) // step))
    return g.push(Op.SLICE, x.dtype, shape, s, n.arg)


def _concat(g: Graph, s: list[Node], n: Node) -> Any:
    if len(s) < 2:
        return f"concat of {len(s)} operand(s)"
    return g.concat(s, n.arg)


def _pad(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 1)
    a = n.arg
    if not isinstance(a, PadArgs):
        return f"arg {a!r} is not PadArgs"
    if any(lo < 0 or hi < 0 for lo, hi in a.pads):
        return f"negative pads {a.pads} (crop with a slice)"
    return g.pad(s[0], a.pads, a.value)


def _conv(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 2)
    a = n.arg
    if not isinstance(a, ConvArgs):
        return f"arg {a!r} is not ConvArgs"
    return g.conv(s[0], s[1], stride=a.stride, padding=a.padding, dilation=a.dilation, groups=a.groups)


def _pool(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 1)
    a = n.arg
    if not isinstance(a, PoolArgs):
        return f"arg {a!r} is not PoolArgs"
    return g.pool(s[0], a.kind, a.kernel, a.stride, a.padding, a.dilation, a.ceil_mode, a.count_pad)


def _matmul(g: Graph, s: list[Node], n: Node) -> Any:
    _nsrc(n, 2)
    a, b = s
    if a.rank < 2 or b.rank != a.rank or a.shape[:-2] != b.shape[:-2]:
        return (
            f"operands {shape_str(a.shape)} and {shape_str(b.shape)} must have rank >= 2 and equal "
            "batch dims (the builder broadcasts them)"
        )
    return g.matmul(a, b)


def _attention(g: Graph, s: list[Node], n: Node) -> Any:
    a = n.arg
    if not isinstance(a, AttentionArgs):
        return f"arg {a!r} is not AttentionArgs"
    _nsrc(n, 3 + (a.mask != "none") + a.sinks)
    q, k, v, mask, sinks = split_operands(s, a)
    if mask is not None and mask.shape != (*q.shape[:3], k.shape[2]):
        return f"mask {shape_str(mask.shape)} is not broadcast to [batch, heads, q_len, k_len]"
    out = g.attention(
        q, k, v, mask, scale=a.scale, causal=a.causal, gqa=a.groups > 1, score_mod=a.score_mod, sinks=sinks
    )
    if out.arg != a:
        return f"arg {a} disagrees with the operands ({out.arg})"
    return out


def _row(g: Graph, s: list[Node], n: Node) -> Any:
    if n.op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
        _nsrc(n, 1)
        if not isinstance(n.arg, int) or not 0 <= n.arg < s[0].rank:
            return f"axis {n.arg!r} is not an axis of the operand"
        return g.softmax(s[0], n.arg) if n.op is Op.SOFTMAX else g.log_softmax(s[0], n.arg)
    a = n.arg
    if not isinstance(a, NormArgs):
        return f"arg {a!r} is not NormArgs"
    _nsrc(n, 1 + a.params)
    if n.op is Op.LAYERNORM:
        w = s[1] if a.has_weight else None
        b = s[1 + a.has_weight] if a.has_bias else None
        return g.layernorm(s[0], w, b, a.eps)
    if a.has_bias:
        return "rmsnorm has no bias"
    return g.rmsnorm(s[0], s[1] if a.has_weight else None, a.eps)


def _experts(g: Graph, s: list[Node], n: Node) -> Any:
    a = n.arg
    if not isinstance(a, ExpertsArgs):
        return f"arg {a!r} is not ExpertsArgs"
    _nsrc(n, 7 if a.bias else 5)
    biases = dict(zip(("up_bias", "down_bias"), s[5:], strict=False))
    return g.experts(*s[:5], act=a.act, gated=a.gated, **biases, **a.form)


def _topk(g: Graph, s: list[Node], n: Node) -> Any:
    if not isinstance(n.arg, TopkArgs):
        return f"arg {n.arg!r} is not TopkArgs"
    _nsrc(n, 1)
    return g.topk(s[0], n.arg.k)[n.arg.indices]


def _route(g: Graph, s: list[Node], n: Node) -> Any:
    a = n.arg
    if not isinstance(a, RouteArgs):
        return f"arg {a!r} is not RouteArgs"
    _nsrc(n, 2 if a.bias else 1)
    dtype = DType.F32 if a.indices else n.dtype
    fields = dict(score=a.score, renorm=a.renorm, eps=a.eps, scale=a.scale)
    return g.route(s[0], a.k, s[1] if a.bias else None, dtype=dtype, **fields)[a.indices]


_RULES: dict[Op, Callable[[Graph, list[Node], Node], Any]] = {
    Op.INPUT: _source,
    Op.CONST: _source,
    Op.VIEW: _view,
    Op.BROADCAST: _broadcast,
    Op.PERMUTE: lambda g, s, n: (_nsrc(n, 1), g.permute(s[0], n.arg))[1],
    Op.SLICE: _slice,
    Op.FLIP: lambda g, s, n: (_nsrc(n, 1), g.flip(s[0], n.arg))[1],
    Op.GATHER: lambda g, s, n: (_nsrc(n, 2), g.gather(s[0], s[1], n.arg))[1],
    Op.CONCAT: _concat,
    Op.PAD: _pad,
    Op.MATMUL: _matmul,
    Op.ATTENTION: _attention,
    Op.EXPERTS: _experts,
    Op.TOPK: _topk,
    Op.ROUTE: _route,
    Op.CONV: _conv,
    Op.POOL: _pool,
    Op.WHERE: _where,
    **dict.fromkeys(UNARY, _unary),
    **dict.fromkeys(BINARY, _binary),
    # the row-statistic ops: reductions and row ops (those with an element formula)
    **{op: _reduce if spec.elem is None else _row for op, spec in STATS.items()},
}

__all__ = ["VerifyError", "verify"]
