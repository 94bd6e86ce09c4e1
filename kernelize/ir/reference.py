"""The reference executor: each op with plain torch eager calls. Simple and obviously correct; the oracle
every backend is compared with.

Example:
    >>> out, = evaluate(graph, [torch.randn(4, 64)])  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from kernelize.ir.attention import reference_attention, split_operands
from kernelize.ir.dtypes import DType, compute_dtype
from kernelize.ir.experts import reference_experts
from kernelize.ir.graph import Graph, Node, Op
from kernelize.ir.ops import ConvArgs, NormArgs, PoolArgs
from kernelize.ir.router import reference_route, reference_topk
from kernelize.ir.shapes import ShapeError, bind, shape_str, unify
from kernelize.ir.stats import NO_IDENTITY, STATS, elem_operands


def bind_inputs(graph: Graph, inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Check ``inputs`` against the graph's inputs and return the symbol bindings.

    Raises:
        ValueError: wrong count or a missing name; TypeError: wrong dtype; ShapeError: wrong shape.
    """
    if isinstance(inputs, Mapping):
        missing = [i.arg for i in graph.inputs if i.arg not in inputs]
        extra = sorted(set(inputs) - {i.arg for i in graph.inputs})
        if missing or extra:
            raise ValueError(
                f"graph inputs are {[i.arg for i in graph.inputs]}; missing {missing}, unknown {extra}"
            )
        inputs = [inputs[i.arg] for i in graph.inputs]
    if len(inputs) != len(graph.inputs):
        raise ValueError(
            f"graph takes {len(graph.inputs)} inputs {[i.arg for i in graph.inputs]}, got {len(inputs)}"
        )
    env: dict[str, int] = {}
    for node, t in zip(graph.inputs, inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"input {node.arg!r} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != node.dtype.torch:
            raise TypeError(f"input {node.arg!r} must have dtype {node.dtype.torch}, got {t.dtype}")
        unify(env, node.shape, tuple(t.shape), f"input {node.arg!r}")
    return env


def evaluate(graph: Graph, inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run ``graph`` on ``inputs`` (positional in ``graph.inputs`` order, or by name); return its outputs."""
    env = bind_inputs(graph, inputs)
    if isinstance(inputs, Mapping):
        inputs = [inputs[i.arg] for i in graph.inputs]
    vals: dict[Node, torch.Tensor] = dict(zip(graph.inputs, inputs))
    for node in graph.nodes:
        if node.op is Op.INPUT:
            continue
        out = EVAL[node.op](node, [vals[s] for s in node.src], env)
        want = bind(node.shape, env)
        assert tuple(out.shape) == want, (
            f"{node.op} gave {tuple(out.shape)}, IR says {shape_str(node.shape)}={want}"
        )
        vals[node] = out.to(node.dtype.torch)
    return [vals[o] for o in graph.outputs]


def _f(t: torch.Tensor, dtype: DType) -> torch.Tensor:
    """Upcast 16-bit floats to f32 for math, as kernels do."""
    return t.to(compute_dtype(dtype).torch)


def _binary(fn: Callable) -> Callable:
    return lambda n, xs, env: fn(_f(xs[0], n.src[0].dtype), _f(xs[1], n.src[1].dtype))


def _unary(fn: Callable) -> Callable:
    return lambda n, xs, env: fn(_f(xs[0], n.src[0].dtype))


def _slice(n: Node, xs, env) -> torch.Tensor:
    # untouched axes keep (0, size, 1) and a symbolic size is a Sym: bind it
    return xs[0][tuple(slice(*bind((a, b), env), c) for a, b, c in n.arg)]


def _gather(n: Node, xs, env) -> torch.Tensor:
    x, idx = xs
    size = x.shape[n.arg]
    idx = torch.where(idx < 0, idx + size, idx).long()
    if idx.numel() and (idx.min() < 0 or idx.max() >= size):
        raise IndexError(f"gather index out of range [{-size}, {size}) on axis {n.arg}")
    out = torch.index_select(x, n.arg, idx.flatten())
    return out.reshape(tuple(x.shape[: n.arg]) + tuple(idx.shape) + tuple(x.shape[n.arg + 1 :]))


def _pad(n: Node, xs, env) -> torch.Tensor:
    flat = [p for lo_hi in reversed(n.arg.pads) for p in lo_hi]
    return F.pad(xs[0], flat, value=n.arg.value)


def _conv(n: Node, xs, env) -> torch.Tensor:
    a: ConvArgs = n.arg
    top, left, bottom, right = a.padding
    x = F.pad(_f(xs[0], n.dtype), (left, right, top, bottom))
    return F.conv2d(x, _f(xs[1], n.dtype), stride=a.stride, dilation=a.dilation, groups=a.groups)


def _pool(n: Node, xs, env) -> torch.Tensor:
    a: PoolArgs = n.arg
    top, left, bottom, right = a.padding
    pad = (left, right, top, bottom)
    x = _f(xs[0], n.dtype)
    if a.kind == "max" and _torch_pads(a):
        # torch pads with -inf itself: no padded copy (ResNet-50's stem pool at batch 8: a 25 MB one)
        out = F.max_pool2d(x, a.kernel, a.stride, (top, left), a.dilation, ceil_mode=False)
    elif a.kind == "max":
        x = F.pad(x, pad, value=-math.inf)
        out = F.max_pool2d(x, a.kernel, a.stride, 0, a.dilation, ceil_mode=a.ceil_mode)
    else:
        assert a.dilation == (1, 1), "avg pool with dilation"
        ones = F.pad(torch.ones_like(x[:1, :1]), pad, value=1.0 if a.count_pad else 0.0)
        sums = dict(kernel_size=a.kernel, stride=a.stride, ceil_mode=a.ceil_mode, divisor_override=1)
        out = F.avg_pool2d(F.pad(x, pad), **sums) / F.avg_pool2d(ones, **sums)
    # torch drops a last ceil-mode window only when it starts past the (here pre-padded) input; the IR also
    # drops one that starts in the right padding, so keep the IR's (never larger) output size
    oh, ow = bind(n.shape, env)[2:]
    return out[..., :oh, :ow]


def _torch_pads(a: PoolArgs) -> bool:
    """Whether torch's pooling takes ``a``'s padding as its own: the same on both sides, at most half the
    window, and no ceil mode (whose last window torch and the IR drop differently)."""
    top, left, bottom, right = a.padding
    half = [k // 2 for k in a.kernel]
    return not a.ceil_mode and top == bottom <= half[0] and left == right <= half[1]


def _reduce(fn: Callable) -> Callable:
    def run(n: Node, xs, env):
        x = xs[0]
        if 0 in x.shape and STATS[n.op].acc in NO_IDENTITY:
            raise ValueError(f"{n.op} of an empty tensor {tuple(x.shape)} has no identity")
        return fn(_f(x, n.src[0].dtype) if n.src[0].dtype.is_float else x, n.arg)

    return run


def _amax(x, axes):
    return x.amax(dim=axes, keepdim=True) if x.numel() else x.sum(dim=axes, keepdim=True)


def _prod(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    kept = [i for i in range(x.dim()) if i not in axes]
    out = x.permute(kept + list(axes)).flatten(len(kept)).prod(-1)
    return out.reshape([1 if i in axes else s for i, s in enumerate(x.shape)])


def _norm_operands(n: Node, xs) -> dict[str, torch.Tensor]:
    """A norm's element ``x``, weight ``w`` and bias ``b`` (those it has), upcast for math."""
    return {k: _f(xs[i], n.dtype) for k, i in elem_operands(tuple(range(len(xs))), n.arg).items()}


# the math is torch's own, not the backends' formulas from kernelize.ir.stats: the oracle stays independent
def _layernorm(n: Node, xs, env) -> torch.Tensor:
    a: NormArgs = n.arg
    t = _norm_operands(n, xs)
    return F.layer_norm(t["x"], t["x"].shape[-1:], t.get("w"), t.get("b"), a.eps)


def _rmsnorm(n: Node, xs, env) -> torch.Tensor:
    a: NormArgs = n.arg
    t = _norm_operands(n, xs)
    y = t["x"] * torch.rsqrt(t["x"].pow(2).mean(-1, keepdim=True) + a.eps)
    return y * t["w"] if "w" in t else y


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x) if x.is_floating_point() else x


def _where(n, xs, env):
    return torch.where(xs[0], _f(xs[1], n.dtype), _f(xs[2], n.dtype))


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # integer: python (floor) semantics like torch.remainder; float: C fmod like ONNX Mod(fmod=1)
    return torch.fmod(a, b) if a.is_floating_point() else torch.remainder(a, b)


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a / b if a.is_floating_point() else torch.div(a, b, rounding_mode="trunc")


def _attention(args, q, k, v, mask, sinks) -> torch.Tensor:
    return reference_attention(q, k, v, mask, args, sinks)


EVAL: dict[Op, Callable[[Node, list[torch.Tensor], dict[str, int]], torch.Tensor]] = {
    Op.CONST: lambda n, xs, env: n.arg.tensor,
    Op.VIEW: lambda n, xs, env: xs[0].reshape(bind(n.shape, env)),
    Op.BROADCAST: lambda n, xs, env: xs[0].expand(bind(n.shape, env)),
    Op.PERMUTE: lambda n, xs, env: xs[0].permute(n.arg),
    Op.SLICE: _slice,
    Op.FLIP: lambda n, xs, env: xs[0].flip(n.arg),
    Op.GATHER: _gather,
    Op.CONCAT: lambda n, xs, env: torch.cat(xs, n.arg),
    Op.PAD: _pad,
    Op.MATMUL: lambda n, xs, env: (
        torch.matmul(_f(xs[0], n.dtype), _f(xs[1], n.dtype))
        if n.dtype.is_float
        else torch.matmul(xs[0], xs[1])
    ),
    Op.CONV: _conv,
    Op.POOL: _pool,
    Op.ATTENTION: lambda n, xs, env: _attention(n.arg, *split_operands(xs, n.arg)),
    Op.EXPERTS: lambda n, xs, env: reference_experts(*xs[:5], n.arg, *xs[5:]),
    Op.TOPK: lambda n, xs, env: reference_topk(xs[0], n.arg),
    Op.ROUTE: lambda n, xs, env: reference_route(xs[0], xs[1] if len(xs) > 1 else None, n.arg),
    Op.ABS: _unary(torch.abs),
    Op.NEG: _unary(torch.neg),
    Op.EXP: _unary(torch.exp),
    Op.LOG: _unary(torch.log),
    Op.SQRT: _unary(torch.sqrt),
    Op.RSQRT: _unary(torch.rsqrt),
    Op.RECIPROCAL: _unary(lambda x: 1 / x),
    Op.SIN: _unary(torch.sin),
    Op.COS: _unary(torch.cos),
    Op.TANH: _unary(torch.tanh),
    Op.SIGMOID: _unary(torch.sigmoid),
    Op.ERF: _unary(torch.erf),
    Op.SOFTPLUS: _unary(F.softplus),
    Op.FLOOR: _unary(lambda x: torch.floor(x) if x.is_floating_point() else x),
    Op.CEIL: _unary(lambda x: torch.ceil(x) if x.is_floating_point() else x),
    Op.ROUND: _unary(_round),
    Op.SIGN: _unary(torch.sign),
    Op.NOT: _unary(torch.logical_not),
    Op.CAST: lambda n, xs, env: xs[0].to(n.dtype.torch),
    Op.CLAMP: lambda n, xs, env: torch.clamp(_f(xs[0], n.dtype), n.arg.lo, n.arg.hi),
    Op.GELU: lambda n, xs, env: F.gelu(_f(xs[0], n.dtype), approximate=n.arg),
    Op.ADD: _binary(torch.add),
    Op.SUB: _binary(torch.sub),
    Op.MUL: _binary(torch.mul),
    Op.DIV: _binary(_div),
    Op.MIN: _binary(torch.minimum),
    Op.MAX: _binary(torch.maximum),
    Op.POW: _binary(torch.pow),
    Op.MOD: _binary(_mod),
    Op.EQ: _binary(torch.eq),
    Op.NE: _binary(torch.ne),
    Op.LT: _binary(torch.lt),
    Op.LE: _binary(torch.le),
    Op.GT: _binary(torch.gt),
    Op.GE: _binary(torch.ge),
    Op.AND: _binary(torch.logical_and),
    Op.OR: _binary(torch.logical_or),
    Op.WHERE: _where,
    Op.SUM: _reduce(lambda x, a: x.sum(dim=a, keepdim=True)),
    Op.MEAN: _reduce(lambda x, a: x.mean(dim=a, keepdim=True)),
    Op.REDUCE_MAX: _reduce(_amax),
    Op.REDUCE_MIN: _reduce(lambda x, a: x.amin(dim=a, keepdim=True)),
    Op.PROD: _reduce(_prod),
    Op.ARGMAX: _reduce(lambda x, a: x.argmax(dim=a[0], keepdim=True)),
    Op.ARGMIN: _reduce(lambda x, a: x.argmin(dim=a[0], keepdim=True)),
    Op.SOFTMAX: lambda n, xs, env: torch.softmax(_f(xs[0], n.dtype), n.arg),
    Op.LOG_SOFTMAX: lambda n, xs, env: torch.log_softmax(_f(xs[0], n.dtype), n.arg),
    Op.LAYERNORM: _layernorm,
    Op.RMSNORM: _rmsnorm,
}
missing = set(Op) - set(EVAL) - {Op.INPUT}
assert not missing, f"reference executor lacks {missing}"
del missing

__all__ = ["EVAL", "ShapeError", "bind_inputs", "evaluate"]
