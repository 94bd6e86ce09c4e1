"""The graph IR: an append-only, topologically ordered SSA DAG of abstract values.

Every :class:`Node` is a value with an op, a dtype and a shape; it has no strides and no memory. The
:class:`Graph` builder checks shapes and dtypes as it builds (raising :class:`ShapeError` /
:class:`DTypeError` naming the operands) and hash-conses on ``(op, dtype, shape, src, arg)``, so common
subexpressions are shared for free.

Example:
    >>> g = Graph()
    >>> x = g.input("x", (Sym.of("batch"), 64), DType.F32)
    >>> w = g.input("w", (64,), DType.F32)
    >>> y = g.rmsnorm(x, w, eps=1e-6)
    >>> g.output(y)
    >>> print(g)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernelize.ir.dtypes import HALF, DType, promote
from kernelize.ir.errors import DTypeError
from kernelize.ir.ops import (
    BINARY,
    COMPARE,
    ELEMENTWISE,
    FLOAT_ONLY,
    LAYOUT,
    REDUCE,
    ROW,
    SOURCE,
    UNARY,
    ClampArgs,
    ConvArgs,
    NormArgs,
    Op,
    PadArgs,
    PoolArgs,
)
from kernelize.ir.shapes import (
    Dim,
    Shape,
    ShapeError,
    Sym,
    broadcast_shapes,
    normalize_axis,
    numel,
    shape_str,
)


def _digest(dtype: torch.dtype, shape: Sequence[int], content: str) -> str:
    """A constant's digest: its dtype, shape and the sha1 of its bytes."""
    return hashlib.sha1(f"{dtype}{tuple(shape)}{content}".encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class Constant:
    """A constant tensor, hashed and compared by content so equal constants are shared."""

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        t = self.tensor.detach().cpu().contiguous()
        if t.numel() == 1:  # one element is "contiguous" with any strides, but view(uint8) needs stride 1
            t = t.clone(memory_format=torch.contiguous_format)
        object.__setattr__(self, "tensor", t)
        buffer = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""  # no copy
        object.__setattr__(self, "content", hashlib.sha1(buffer).hexdigest())
        object.__setattr__(self, "digest", _digest(t.dtype, t.shape, self.content))

    def reshaped(self, shape: Sequence[int]) -> Constant:
        """This constant's values in row-major ``shape``: a view, whose digest comes from the bytes' digest
        without reading them again (a transformer's weights are reshaped twice while folding: 800 MB)."""
        if self.content is None:  # read back with a digest only: hash once
            return Constant(self.tensor.reshape(tuple(shape)))
        t = self.tensor.reshape(tuple(shape))
        c = Constant.known(t, _digest(t.dtype, t.shape, self.content))
        object.__setattr__(c, "content", self.content)
        return c

    @classmethod
    def known(cls, tensor: torch.Tensor, digest: str) -> Constant:
        """A constant whose digest was computed before (a graph read back from the graph cache, which
        recorded it): hashing 100M parameters again would take seconds. ``tensor`` must be contiguous."""
        assert tensor.is_contiguous() and tensor.device.type == "cpu", (
            "Constant.known takes a dense CPU tensor"
        )
        c = object.__new__(cls)
        object.__setattr__(c, "tensor", tensor)
        object.__setattr__(c, "digest", digest)
        object.__setattr__(c, "content", None)  # the bytes' own digest, unknown
        return c

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Constant) and other.digest == self.digest

    def __repr__(self) -> str:
        t = self.tensor
        if t.numel() <= 4:
            return repr(t.tolist())
        return f"<{t.numel()} values {self.digest[:8]}>"


@dataclass(frozen=True, eq=False)
class Node:
    """One SSA value. Identity is equality: the graph hash-conses, so equal nodes are the same object."""

    op: Op
    dtype: DType
    shape: Shape
    src: tuple[Node, ...] = ()
    arg: Any = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Node({self.op}, {self.dtype}{shape_str(self.shape)})"


Scalar = bool | int | float
Operand = Node | Scalar


class Graph:
    """Append-only builder and container of nodes in topological order."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: list[Node] = []
        self.outputs: list[Node] = []
        self._index: dict[Node, int] = {}
        self._cons: dict[tuple, Node] = {}

    # -- core ---------------------------------------------------------------------------------------------
    def push(
        self, op: Op, dtype: DType, shape: Sequence[Dim], src: Sequence[Node] = (), arg: Any = None
    ) -> Node:
        """Append a node, or return the existing identical one (hash-consing)."""
        src, shape = tuple(src), tuple(shape)
        for s in src:
            assert s in self._index, f"operand {s} of {op} is not in this graph"
        key = (op, dtype, shape, tuple(map(id, src)), arg)
        if op is not Op.INPUT and key in self._cons:
            return self._cons[key]
        node = Node(Op(op), DType(dtype), shape, src, arg)
        self._cons[key] = node
        self._index[node] = len(self.nodes)
        self.nodes.append(node)
        return node

    def index(self, node: Node) -> int:
        return self._index[node]

    def __contains__(self, node: object) -> bool:
        return node in self._index

    def __len__(self) -> int:
        return len(self.nodes)

    def output(self, *nodes: Node) -> None:
        for n in nodes:
            assert n in self._index, f"output {n} is not in this graph"
        self.outputs.extend(nodes)

    def users(self) -> dict[Node, list[Node]]:
        """Map each node to the nodes that read it (outputs are not users)."""
        out: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for s in dict.fromkeys(n.src):
                out[s].append(n)
        return out

    def __str__(self) -> str:
        from kernelize.ir.printer import format_graph

        return format_graph(self)

    # -- sources ------------------------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence[Dim | str], dtype: DType | str) -> Node:
        """A graph input. String dims become symbolic dims (``"batch"`` -> ``Sym.of("batch")``)."""
        if any(i.arg == name for i in self.inputs):
            raise ValueError(f"graph already has an input named {name!r}")
        dims = tuple(_input_dim(name, axis, d) for axis, d in enumerate(shape))
        node = self.push(Op.INPUT, DType(dtype), dims, (), name)
        self.inputs.append(node)
        return node

    def const(self, value: torch.Tensor | Scalar | Sequence, dtype: DType | str | None = None) -> Node:
        """A constant; python scalars become 0-d constants (default dtype from the value)."""
        t = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
        if dtype is not None:
            t = t.to(DType(dtype).torch)
        return self.push(Op.CONST, DType.from_torch(t.dtype), tuple(t.shape), (), Constant(t))

    def scalar(self, value: Scalar, dtype: DType | str) -> Node:
        return self.const(torch.tensor(value, dtype=DType(dtype).torch))

    # -- layout -------------------------------------------------------------------------------------------
    def view(self, x: Node, shape: Sequence[Dim]) -> Node:
        """Reshape (row-major); one ``-1`` is inferred."""
        shape = list(shape)
        if shape.count(-1) > 1:
            raise ShapeError(f"view of {x} to {shape}: at most one -1")
        if -1 in shape:
            rest = numel([d for d in shape if d != -1])
            try:
                shape[shape.index(-1)] = (
                    numel(x.shape) // rest
                    if isinstance(numel(x.shape), Sym)
                    else _exact_div(numel(x.shape), rest)
                )
            except (ShapeError, TypeError, ZeroDivisionError):
                raise ShapeError(f"cannot view {shape_str(x.shape)} as {shape}") from None
        shape = tuple(shape)
        if numel(shape) != numel(x.shape):
            raise ShapeError(
                f"cannot view {shape_str(x.shape)} ({numel(x.shape)} elements) as "
                f"{shape_str(shape)} ({numel(shape)} elements)"
            )
        if shape == x.shape:
            return x
        if x.op is Op.VIEW:  # view of view
            return self.view(x.src[0], shape)
        return self.push(Op.VIEW, x.dtype, shape, (x,))

    def broadcast(self, x: Node, shape: Sequence[Dim]) -> Node:
        """Numpy-style broadcast to ``shape`` (leading dims added through a view)."""
        shape = tuple(shape)
        if len(shape) < x.rank:
            raise ShapeError(f"cannot broadcast {shape_str(x.shape)} to lower rank {shape_str(shape)}")
        if x.rank < len(shape):
            if x.op is Op.BROADCAST:  # broadcast of broadcast: widen the original instead
                x = x.src[0]
            x = self.view(x, (1,) * (len(shape) - x.rank) + x.shape)
        if any(a != b and a != 1 for a, b in zip(x.shape, shape)):
            raise ShapeError(f"cannot broadcast {shape_str(x.shape)} to {shape_str(shape)}")
        if shape == x.shape:
            return x
        if x.op is Op.BROADCAST:
            x = x.src[0]
        return self.push(Op.BROADCAST, x.dtype, shape, (x,))

    def permute(self, x: Node, perm: Sequence[int]) -> Node:
        perm = tuple(normalize_axis(p, x.rank) for p in perm)
        if sorted(perm) != list(range(x.rank)):
            raise ShapeError(f"permute of {shape_str(x.shape)}: {perm} is not a permutation of its axes")
        if perm == tuple(range(x.rank)):
            return x
        if x.op is Op.PERMUTE:  # permute of permute
            return self.permute(x.src[0], tuple(x.arg[p] for p in perm))
        return self.push(Op.PERMUTE, x.dtype, tuple(x.shape[p] for p in perm), (x,), perm)

    def transpose(self, x: Node, a: int = -2, b: int = -1) -> Node:
        perm = list(range(x.rank))
        a, b = normalize_axis(a, x.rank), normalize_axis(b, x.rank)
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(x, perm)

    def slice(self, x: Node, axis: int, start: int = 0, stop: int | None = None, step: int = 1) -> Node:
        """``x[..., start:stop:step, ...]`` along ``axis`` (python semantics, ``step > 0``)."""
        axis = normalize_axis(axis, x.rank)
        if step <= 0:
            raise ShapeError(f"slice step must be positive (got {step}); use flip for reversal")
        d = x.shape[axis]
        if isinstance(d, Sym):
            if start == 0 and stop is None and step == 1:
                return x
            raise ShapeError(f"cannot slice symbolic dimension {d} of {shape_str(x.shape)}")
        start, stop, _ = slice(start, stop, step).indices(d)
        size = max(0, -(-(stop - start) // step))
        if start == 0 and size == d and (step == 1 or d <= 1):
            return x
        ranges = tuple(
            (0, s, 1) if i != axis else (start, start + size * step, step) for i, s in enumerate(x.shape)
        )
        shape = tuple(size if i == axis else s for i, s in enumerate(x.shape))
        return self.push(Op.SLICE, x.dtype, shape, (x,), ranges)

    def flip(self, x: Node, axes: Sequence[int]) -> Node:
        axes = tuple(sorted({normalize_axis(a, x.rank) for a in axes}))
        axes = tuple(a for a in axes if x.shape[a] != 1)
        if not axes:
            return x
        return self.push(Op.FLIP, x.dtype, x.shape, (x,), axes)

    # -- data movement ------------------------------------------------------------------------------------
    def gather(self, x: Node, index: Node, axis: int = 0) -> Node:
        """``numpy.take(x, index, axis)``: shape ``x[:axis] + index + x[axis+1:]``; negative indices wrap."""
        axis = normalize_axis(axis, x.rank)
        if not index.dtype.is_int:
            raise DTypeError(f"gather index must be an integer type, got {index.dtype} (data {x})")
        shape = x.shape[:axis] + index.shape + x.shape[axis + 1 :]
        return self.push(Op.GATHER, x.dtype, shape, (x, index), axis)

    def concat(self, xs: Sequence[Node], axis: int) -> Node:
        xs = [x for x in xs if x.shape[normalize_axis(axis, x.rank)] != 0] or list(xs[:1])
        if len(xs) == 1:
            return xs[0]
        axis = normalize_axis(axis, xs[0].rank)
        for x in xs[1:]:
            if x.dtype != xs[0].dtype:
                raise DTypeError(f"concat of {xs[0]} and {x}: dtypes differ")
            if x.rank != xs[0].rank or any(
                a != b for i, (a, b) in enumerate(zip(x.shape, xs[0].shape)) if i != axis
            ):
                raise ShapeError(
                    f"concat along axis {axis}: {shape_str(xs[0].shape)} and "
                    f"{shape_str(x.shape)} differ off that axis"
                )
        if any(isinstance(x.shape[axis], Sym) for x in xs):
            raise ShapeError(f"concat along symbolic axis {axis} is not supported")
        shape = list(xs[0].shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        return self.push(Op.CONCAT, xs[0].dtype, shape, xs, axis)

    def pad(self, x: Node, pads: Sequence[tuple[int, int]], value: Scalar = 0) -> Node:
        """Constant padding: ``pads[i] = (before, after)`` for each axis; negative pads crop."""
        if len(pads) != x.rank:
            raise ShapeError(
                f"pad of {shape_str(x.shape)} needs {x.rank} (before, after) pairs, got {len(pads)}"
            )
        for i, (lo, hi) in enumerate(pads):
            if lo < 0 or hi < 0:
                stop = None if hi >= 0 else x.shape[i] + hi
                x = self.slice(x, i, max(-lo, 0), stop)
        pads = tuple((max(lo, 0), max(hi, 0)) for lo, hi in pads)
        if not any(lo or hi for lo, hi in pads):
            return x
        if any(isinstance(d, Sym) and (lo or hi) for d, (lo, hi) in zip(x.shape, pads)):
            raise ShapeError(f"cannot pad a symbolic dimension of {shape_str(x.shape)}")
        shape = tuple(d + lo + hi if lo or hi else d for d, (lo, hi) in zip(x.shape, pads))
        return self.push(Op.PAD, x.dtype, shape, (x,), PadArgs(pads, value))

    # -- heavy ops ----------------------------------------------------------------------------------------
    def matmul(self, a: Node, b: Node) -> Node:
        """``torch.matmul`` semantics: batched, broadcasting, 1-d operands through views."""
        if a.rank == 0 or b.rank == 0:
            raise ShapeError(f"matmul of {a} and {b}: operands must have rank >= 1")
        if a.dtype != b.dtype:
            raise DTypeError(f"matmul of {a} and {b}: dtypes differ")
        av = self.view(a, (1, *a.shape)) if a.rank == 1 else a
        bv = self.view(b, (*b.shape, 1)) if b.rank == 1 else b
        if av.shape[-1] != bv.shape[-2]:
            raise ShapeError(
                f"matmul of {shape_str(a.shape)} and {shape_str(b.shape)}: inner dims "
                f"{av.shape[-1]} and {bv.shape[-2]} differ"
            )
        batch = broadcast_shapes(av.shape[:-2], bv.shape[:-2])
        av = self.broadcast(av, (*batch, *av.shape[-2:]))
        bv = self.broadcast(bv, (*batch, *bv.shape[-2:]))
        out = self.push(Op.MATMUL, a.dtype, (*batch, av.shape[-2], bv.shape[-1]), (av, bv))
        if a.rank == 1:
            out = self.view(out, (*out.shape[:-2], out.shape[-1]))
        if b.rank == 1:
            out = self.view(out, out.shape[:-1])
        return out

    def attention(self, q: Node, k: Node, v: Node, mask: Node | None = None, **kw: Any) -> Node:
        """Fused scaled-dot-product attention (:func:`kernelize.ir.attention.build_attention`)."""
        from kernelize.ir.attention import build_attention

        return build_attention(self, q, k, v, mask, **kw)

    def experts(self, x: Node, index: Node, weights: Node, up: Node, down: Node, **kw: Any) -> Node:
        """Routed mixture-of-experts MLPs (:func:`kernelize.ir.experts.build_experts`)."""
        from kernelize.ir.experts import build_experts

        return build_experts(self, x, index, weights, up, down, **kw)

    def topk(self, x: Node, k: int) -> tuple[Node, Node]:
        """(values, int64 indices) of the ``k`` largest along the last axis
        (:func:`kernelize.ir.router.build_topk`; ties: the lower index first)."""
        from kernelize.ir.router import build_topk

        return build_topk(self, x, k)

    def route(self, x: Node, k: int, bias: Node | None = None, **kw: Any) -> tuple[Node, Node]:
        """(weights, int64 indices) of a mixture-of-experts router over logits ``x``
        (:func:`kernelize.ir.router.build_route`)."""
        from kernelize.ir.router import build_route

        return build_route(self, x, k, bias, **kw)

    def conv(
        self,
        x: Node,
        w: Node,
        bias: Node | None = None,
        *,
        stride: Sequence[int] = (1, 1),
        padding: Sequence[int] = (0, 0, 0, 0),
        dilation: Sequence[int] = (1, 1),
        groups: int = 1,
    ) -> Node:
        """2-D convolution, NCHW. ``padding`` is (top, left, bottom, right); bias becomes a broadcast add."""
        if x.rank != 4 or w.rank != 4:
            raise ShapeError(
                f"conv needs NCHW input and OIHW weight, got {shape_str(x.shape)} and {shape_str(w.shape)}"
            )
        if x.dtype != w.dtype:
            raise DTypeError(f"conv of {x} with weight {w}: dtypes differ")
        n, c, h, wd = x.shape
        o, cg, kh, kw = w.shape
        if isinstance(c, Sym) or c != cg * groups or o % groups:
            raise ShapeError(
                f"conv: input {shape_str(x.shape)} and weight {shape_str(w.shape)} do not fit groups={groups}"
            )
        stride, padding, dilation = tuple(stride), tuple(padding), tuple(dilation)
        oh = (h + padding[0] + padding[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (wd + padding[1] + padding[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        if oh < 0 or ow < 0:
            raise ShapeError(f"conv output of {shape_str(x.shape)} with kernel {kh}x{kw} would be empty")
        out = self.push(Op.CONV, x.dtype, (n, o, oh, ow), (x, w), ConvArgs(stride, padding, dilation, groups))
        if bias is not None:
            out = self.add(out, self.view(bias, (o, 1, 1)))
        return out

    def pool(
        self,
        x: Node,
        kind: str,
        kernel: Sequence[int],
        stride: Sequence[int] | None = None,
        padding: Sequence[int] = (0, 0, 0, 0),
        dilation: Sequence[int] = (1, 1),
        ceil_mode: bool = False,
        count_include_pad: bool = False,
    ) -> Node:
        """2-D max or average pooling over NCHW. ``padding`` is (top, left, bottom, right)."""
        if kind not in ("max", "avg"):
            raise ValueError(f"pool kind must be 'max' or 'avg', got {kind!r}")
        if x.rank != 4:
            raise ShapeError(f"pool needs NCHW input, got {shape_str(x.shape)}")
        kernel = tuple(kernel)
        stride = tuple(stride or kernel)
        padding, dilation = tuple(padding), tuple(dilation)
        rnd = math.ceil if ceil_mode else math.floor
        sizes = []
        for i, d in enumerate(x.shape[2:]):
            span = d + padding[i] + padding[i + 2] - dilation[i] * (kernel[i] - 1) - 1
            size = rnd(span / stride[i]) + 1
            if ceil_mode and (size - 1) * stride[i] >= d + padding[i]:
                size -= 1  # the last window must start inside the input or left padding
            sizes.append(size)
        arg = PoolArgs(kind, kernel, stride, padding, dilation, ceil_mode, count_include_pad)
        return self.push(Op.POOL, x.dtype, (*x.shape[:2], *sizes), (x,), arg)

    # -- elementwise --------------------------------------------------------------------------------------
    def unary(self, op: Op, x: Node) -> Node:
        assert op in UNARY and op not in (Op.CAST, Op.CLAMP, Op.GELU), op
        if op in FLOAT_ONLY and not x.dtype.is_float:
            raise DTypeError(f"{op} needs a floating operand, got {x}")
        if op is Op.NOT and x.dtype is not DType.BOOL:
            raise DTypeError(f"not needs a bool operand, got {x}")
        return self.push(op, x.dtype, x.shape, (x,))

    def binary(self, op: Op, a: Operand, b: Operand) -> Node:
        """Elementwise binary op; scalars take the other operand's dtype; shapes broadcast.

        Like torch, a python scalar multiplying or dividing a 16-bit float keeps f32 precision: the op
        computes in f32 and rounds once (``x / 1e5`` on f16 is ``cast(cast(x, f32) / 1e5, f16)``, not a
        division by f16's ``inf``). Other ops round the scalar to the tensor's dtype first, as torch does.
        """
        assert op in BINARY, op
        wide = self._opmath(op, a, b)
        if wide is not None:
            return wide
        a, b = self._operands(a, b)
        if a.dtype != b.dtype:
            raise DTypeError(f"{op} of {a} and {b}: dtypes differ (cast one of them first)")
        if op in (Op.AND, Op.OR) and a.dtype is not DType.BOOL:
            raise DTypeError(f"{op} needs bool operands, got {a} and {b}")
        shape = broadcast_shapes(a.shape, b.shape)
        canon = self._identity(op, a, b, shape)
        if canon is not None:
            return canon
        a, b = self.broadcast(a, shape), self.broadcast(b, shape)
        return self.push(op, DType.BOOL if op in COMPARE else a.dtype, shape, (a, b))

    def where(self, cond: Node, a: Operand, b: Operand) -> Node:
        a, b = self._operands(a, b)
        if cond.dtype is not DType.BOOL:
            raise DTypeError(f"where condition must be bool, got {cond}")
        if a.dtype != b.dtype:
            raise DTypeError(f"where of {a} and {b}: dtypes differ")
        shape = broadcast_shapes(cond.shape, a.shape, b.shape)
        srcs = [self.broadcast(v, shape) for v in (cond, a, b)]
        return self.push(Op.WHERE, a.dtype, shape, srcs)

    def cast(self, x: Node, dtype: DType | str) -> Node:
        dtype = DType(dtype)
        if dtype == x.dtype:
            return x
        return self.push(Op.CAST, dtype, x.shape, (x,))

    def clamp(self, x: Node, lo: float = -math.inf, hi: float = math.inf) -> Node:
        if lo == -math.inf and hi == math.inf:
            return x
        return self.push(Op.CLAMP, x.dtype, x.shape, (x,), ClampArgs(lo, hi))

    def gelu(self, x: Node, approximate: str = "none") -> Node:
        if approximate not in ("none", "tanh"):
            raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
        if not x.dtype.is_float:
            raise DTypeError(f"gelu needs a floating operand, got {x}")
        return self.push(Op.GELU, x.dtype, x.shape, (x,), approximate)

    # -- reductions and row ops ---------------------------------------------------------------------------
    def reduce(self, op: Op, x: Node, axes: int | Iterable[int] | None = None, keepdim: bool = False) -> Node:
        """Reduce over ``axes`` (all when None). The node keeps them as size 1; ``keepdim=False`` views."""
        assert op in REDUCE, op
        axes = range(x.rank) if axes is None else [axes] if isinstance(axes, int) else axes
        axes = tuple(sorted({normalize_axis(a, x.rank) for a in axes}))
        if op in (Op.ARGMAX, Op.ARGMIN) and len(axes) != 1:
            raise ShapeError(f"{op} reduces exactly one axis, got {axes}")
        if op is Op.MEAN and not x.dtype.is_float:
            raise DTypeError(f"mean needs a floating operand, got {x}")
        dtype = DType.I64 if op in (Op.ARGMAX, Op.ARGMIN) else x.dtype
        kept = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        out = self.push(op, dtype, kept, (x,), axes)
        return out if keepdim else self.view(out, tuple(d for i, d in enumerate(x.shape) if i not in axes))

    def softmax(self, x: Node, axis: int = -1) -> Node:
        return self._row(Op.SOFTMAX, x, normalize_axis(axis, x.rank))

    def log_softmax(self, x: Node, axis: int = -1) -> Node:
        return self._row(Op.LOG_SOFTMAX, x, normalize_axis(axis, x.rank))

    def layernorm(
        self, x: Node, weight: Node | None = None, bias: Node | None = None, eps: float = 1e-5
    ) -> Node:
        """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``."""
        params = self._norm_params(x, weight, bias)
        return self._row(Op.LAYERNORM, x, NormArgs(eps, weight is not None, bias is not None), params)

    def rmsnorm(self, x: Node, weight: Node | None = None, eps: float = 1e-6) -> Node:
        """RMSNorm over the last axis: ``x * rsqrt(mean(x^2) + eps) * weight``."""
        params = self._norm_params(x, weight, None)
        return self._row(Op.RMSNORM, x, NormArgs(eps, weight is not None), params)

    def _row(self, op: Op, x: Node, arg: Any, params: Sequence[Node] = ()) -> Node:
        if not x.dtype.is_float:
            raise DTypeError(f"{op} needs a floating operand, got {x}")
        if x.rank == 0:
            raise ShapeError(f"{op} needs rank >= 1, got a scalar")
        return self.push(op, x.dtype, x.shape, (x, *params), arg)

    def _norm_params(self, x: Node, *params: Node | None) -> list[Node]:
        out = []
        for p in params:
            if p is None:
                continue
            if p.shape != (x.shape[-1],):
                raise ShapeError(
                    f"norm parameter {shape_str(p.shape)} must have shape [{x.shape[-1]}] "
                    f"(last dim of input {shape_str(x.shape)})"
                )
            if p.dtype != x.dtype:
                raise DTypeError(f"norm parameter {p} and input {x}: dtypes differ")
            out.append(p)
        return out

    # -- helpers ------------------------------------------------------------------------------------------
    def _opmath(self, op: Op, a: Operand, b: Operand) -> Node | None:
        """``op(x, s)`` in f32 for a 16-bit ``x`` and a python scalar ``s`` of mul/div that the 16-bit type
        cannot hold exactly (torch's opmath), else None (the plain rule is exact)."""
        if op not in (Op.MUL, Op.DIV) or isinstance(a, Node) == isinstance(b, Node):
            return None
        x, s = (a, b) if isinstance(a, Node) else (b, a)
        if x.dtype not in HALF or isinstance(s, bool) or fits_exactly(s, x.dtype):
            return None
        wide = self.cast(x, DType.F32)
        out = self.binary(op, wide, s) if x is a else self.binary(op, s, wide)
        return self.cast(out, x.dtype)

    def _operands(self, a: Operand, b: Operand) -> tuple[Node, Node]:
        if not isinstance(a, Node) and not isinstance(b, Node):
            raise TypeError("at least one operand must be a graph node")
        if not isinstance(a, Node):
            a = self.scalar(a, b.dtype)
        if not isinstance(b, Node):
            b = self.scalar(b, a.dtype)
        return a, b

    def _identity(self, op: Op, a: Node, b: Node, shape: Shape) -> Node | None:
        """x+0, 0+x, x-0, x*1, 1*x, x/1 -> x (when that changes neither shape nor dtype)."""
        if a.dtype is DType.BOOL:
            return None
        for x, c, ops, neutral in (
            (a, b, (Op.ADD, Op.SUB), 0),
            (b, a, (Op.ADD,), 0),
            (a, b, (Op.MUL, Op.DIV), 1),
            (b, a, (Op.MUL,), 1),
        ):
            if op in ops and x.shape == shape and scalar_value(c) == neutral:
                return x
        return None


def _input_dim(name: str, axis: int, d: object) -> Dim:
    """One dim of a graph input: a name becomes a Sym; a size must be an integer >= 0 (bools, floats and
    negative sizes would pass later checks and fail only when kernels run)."""
    if isinstance(d, str):
        return Sym.of(d)
    if isinstance(d, Sym):
        return d
    if not isinstance(d, bool):
        try:
            size = operator.index(d)
        except TypeError:
            size = -1
        if size >= 0:
            return size
    raise ShapeError(f"input {name!r}: dim {axis} is {d!r}; a dim is an integer >= 0, a Sym or a name (str)")


def reach(nodes: Iterable[Node], follow: Callable[[Node], bool]) -> set[Node]:
    """``nodes`` and every node reached from them through the sources of nodes for which ``follow`` holds
    (an explicit stack: deep graphs do not hit the recursion limit).

    Example:
        >>> g = Graph(); x = g.input("x", (4,), "f32"); y = g.exp(g.neg(x))
        >>> len(reach([y], lambda n: True)), len(reach([y], lambda n: False))
        (3, 1)
    """
    seen: set[Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if follow(n):
            stack.extend(n.src)
    return seen


def fits_exactly(value: Scalar, dtype: DType) -> bool:
    """Whether ``dtype`` holds the f32 value of python scalar ``value`` exactly (NaN counts as held)."""
    if isinstance(value, float) and math.isnan(value):
        return True
    wide = torch.tensor(value, dtype=torch.float32)
    return bool(wide.to(dtype.torch).to(torch.float32) == wide)


def _exact_div(a: int, b: int) -> int:
    if b == 0 or a % b:
        raise ShapeError(f"{a} is not divisible by {b}")
    return a // b


def scalar_value(node: Node) -> float | None:
    """The single value of a constant (through layout ops), or None when it is not a uniform constant."""
    while node.op in LAYOUT:
        node = node.src[0]
    if node.op is not Op.CONST:
        return None
    t = node.arg.tensor
    if t.numel() == 1:
        return t.item()
    flat = t.reshape(-1)
    if flat.numel() and flat[-1] != flat[0]:  # a weight differs at once: no full compare of its values
        return None
    if flat.numel() and bool((flat == flat[0]).all()):
        return flat[0].item()
    return None


def _binary_method(op: Op):
    def method(self: Graph, a: Operand, b: Operand) -> Node:
        return self.binary(op, a, b)

    method.__name__ = method.__qualname__ = str(op.value)
    method.__doc__ = f"Elementwise ``{op.value}`` with broadcasting."
    return method


def _unary_method(op: Op):
    def method(self: Graph, x: Node) -> Node:
        return self.unary(op, x)

    method.__name__ = method.__qualname__ = str(op.value)
    method.__doc__ = f"Elementwise ``{op.value}``."
    return method


# g.add(a, b), g.exp(x), ...: one method per binary/unary op, named after the op
for _op in BINARY:
    setattr(Graph, _op.value + ("_" if _op in (Op.AND, Op.OR) else ""), _binary_method(_op))
for _op in UNARY - {Op.CAST, Op.CLAMP, Op.GELU}:
    setattr(Graph, _op.value + ("_" if _op is Op.NOT else ""), _unary_method(_op))

__all__ = [
    "BINARY",
    "COMPARE",
    "ELEMENTWISE",
    "LAYOUT",
    "REDUCE",
    "ROW",
    "SOURCE",
    "UNARY",
    "Constant",
    "DType",
    "DTypeError",
    "Graph",
    "Node",
    "Op",
    "ShapeError",
    "Sym",
    "fits_exactly",
    "promote",
    "reach",
    "scalar_value",
]
