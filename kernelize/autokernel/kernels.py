"""Kernel specs: the contract between the fusion planner and the three code generators.

A :class:`Kernel` is a loop nest over a ``domain`` (a shape). Its ``body`` is a tiny SSA program of
:class:`Load` and :class:`Compute` entries, referenced by position (``v0``, ``v1``... in generated code);
:class:`Store` entries write body values to buffers. Layout ops of the graph never appear here: the
planner folds them into the ``strides`` / ``offset`` of loads and stores, concat and pad into masked
loads, gather into an indirect load.

Kinds:

* ``POINTWISE``: every body value is indexed by the whole domain.
* ``ROW``: the trailing ``row_rank`` domain axes form a row reduced inside one program. Values are either
  *full* (vary along the row) or *per-row* (results of a reduction, and elementwise ops on those only);
  see :func:`row_invariant`. Row ops (softmax, log-softmax, layernorm, rmsnorm) take full operands and
  give full results; reductions (sum, mean, max, min, prod, argmax, argmin) give per-row results.
* ``MATMUL``: ``body[0]`` is ``Compute(Op.MATMUL, src=(a, b), arg=K)`` where ``a`` / ``b`` are loads indexed
  over ``(*batch, M, K)`` / ``(*batch, K, N)`` (their strides have ``len(domain) + 1`` entries); the
  domain is ``(*batch, M, N)`` and the rest of the body is the elementwise epilogue over it. Precisely
  (as the planner emits it): ``body[1]`` is ``a`` and ``body[2]`` is ``b`` (the only forward references in
  a body), both with strides over ``(*batch, M, N, K)`` (``a`` has stride 0 on ``N``, ``b`` on ``M``), and
  ``arg`` is the contracted size ``K``.
* ``SPLITK`` (derived by GPU backends from a MATMUL kernel, never planned; see
  :mod:`kernelize.autokernel.matmul`): ``body`` as a MATMUL kernel's first three entries, no epilogue; the
  one store is an f32 buffer over the domain that each program *adds* its partial sums over a slice of K to.
  A MATMUL kernel may hold several matmuls sharing ``body[1]`` (``PlanSettings.merge_matmuls``): each
  further one is ``Compute(Op.MATMUL, src=(1, j))`` after its right operand's load ``j``.
* ``ATTENTION``: ``node`` (an ``Op.ATTENTION`` graph node) as one fused kernel over ``domain = node.shape``
  (``[B, Hq, Lq, Dv]``); ``inputs`` are the buffers under its operands. Generated code reads the operands
  (q, k, v and the broadcast mask) through the strides of the tensors the runtime hands it, which are the
  operands seen through their layout views (:func:`kernelize.runtime.library.library_operands`): a
  transposed or broadcast operand is never copied. No body.
* ``CONV``: ``node`` is a conv run by the library (oneDNN with prepacked weights on the CPU, cuDNN on a GPU)
  with ``epilogue`` (:class:`~kernelize.autokernel.conv.ConvEpilogue`: bias, residual, activation) fused as
  post-ops; ``inputs`` are the activation, weight, bias and residual buffers; it writes ``epilogue.tail``.
* ``CONV_CHAIN`` (``PlanSettings.conv_chains``): ``stages`` are CONV kernels run as one, the output of
  each the input of the next and nowhere stored: a 1x1 expansion, a depthwise conv, a 1x1 projection (an
  inverted-residual block), or two of them around the depthwise one; ``node`` is the depthwise conv,
  ``inputs`` the buffers the stages read from outside the chain; it writes the last stage's tail.
* ``LIBRARY``: ``node`` (conv, pool, or a matmul better left to a library) runs as one torch call on
  ``inputs``; no body.

Reductions and row ops in a ``ROW`` kernel work over the row: a reduction's ``Compute.arg`` is the
tuple of row axes of the domain (``x.sum(dim=arg, keepdim=True)`` over domain-shaped values), softmax and
log-softmax carry the domain axis of the row (the last), norms keep the graph node's ``arg``. The one
exception is a *column sum* (``PlanSettings(column_reduce="accumulate")``): a sum or mean whose ``arg`` is
every axis outside the row; its value varies along the row, nothing in the kernel reads it, and it is only
stored (strides 0 on the outer axes), once every row has been added (see :func:`column_sums`).

Example (``y = x * rsqrt(mean(x*x) + eps) * w`` over rows of 4096, as an rmsnorm row kernel)::

    Kernel(name="k0", kind=ROW, domain=(batch*seq, 4096), row_rank=1,
           body=(Load(x, strides=(4096, 1)), Load(w, strides=(0, 1)),
                 Compute(Op.RMSNORM, f32, src=(0, 1), arg=NormArgs(1e-6, has_weight=True))),
           stores=(Store(value=2, buffer=y, strides=(4096, 1)),))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kernelize._compat import StrEnum
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import REDUCE, ROW, Node, Op
from kernelize.ir.printer import format_arg
from kernelize.ir.shapes import Dim, Shape, shape_str, symbols


class KernelKind(StrEnum):
    POINTWISE = "pointwise"
    ROW = "row"
    MATMUL = "matmul"
    CONV = "conv"
    CONV_CHAIN = "conv_chain"
    SPLITK = "splitk"
    ATTENTION = "attention"
    LIBRARY = "library"


# kernels that run one graph node on its operands (no body)
NODE_KINDS = frozenset({KernelKind.LIBRARY, KernelKind.ATTENTION})


@dataclass(frozen=True)
class Indirect:
    """Adds ``wrap(body[value], size) * stride`` to a load's offset (gather); negative indices wrap once."""

    value: int
    stride: Dim
    size: Dim


@dataclass(frozen=True)
class Load:
    """Read ``buffer`` (a contiguous row-major tensor of ``buffer.shape``) at
    ``offset + sum(index[d] * strides[d]) + sum(indirect)`` for each domain index.

    ``mask`` lists ``(axis, lo, hi)``: where the domain index on ``axis`` is outside ``[lo, hi)`` nothing is
    read and the value is ``other`` (pad, concat).
    """

    buffer: Node
    strides: tuple[Dim, ...]
    offset: Dim = 0
    mask: tuple[tuple[int, Dim, Dim], ...] = ()
    other: float = 0.0
    indirect: tuple[Indirect, ...] = ()

    @property
    def dtype(self) -> DType:
        return self.buffer.dtype

    @property
    def constant(self) -> bool | int | float | None:
        """The value when this load reads a single-valued constant (generators inline it as a literal)."""
        if self.buffer.op is not Op.CONST or self.mask or self.indirect or any(s != 0 for s in self.strides):
            return None
        t = self.buffer.arg.tensor
        if t.numel() == 0 or not bool((t == t.reshape(-1)[0]).all()):
            return None
        return t.reshape(-1)[0].item()


@dataclass(frozen=True)
class Compute:
    """One operation on earlier body values (``src`` are body positions), in the IR's op semantics.

    ``dtype`` is the IR dtype of the result (generated code computes 16-bit floats in f32). Besides graph
    elementwise / reduce / row ops, ``Op.CONCAT`` appears with ``arg = ConcatArgs(axis, ends)``: the value
    is ``src[i]`` for the first ``i`` with ``index[axis] < ends[i]``.
    """

    op: Op
    dtype: DType
    src: tuple[int, ...] = ()
    arg: Any = None


@dataclass(frozen=True)
class Store:
    """Write ``body[value]`` to ``buffer`` at ``offset + sum(index[d] * strides[d])`` over the domain.

    In a row kernel a per-row value has stride 0 on the row axes (written once per row).
    """

    value: int
    buffer: Node
    strides: tuple[Dim, ...]
    offset: Dim = 0


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: KernelKind
    domain: Shape
    body: tuple[Load | Compute, ...] = ()
    stores: tuple[Store, ...] = ()
    row_rank: int = 0
    node: Node | None = None  # LIBRARY, ATTENTION, CONV: the graph op to run
    inputs: tuple[Node, ...] = ()  # LIBRARY, ATTENTION, CONV: its operands' buffers
    epilogue: Any = None  # CONV: the fused ConvEpilogue
    stages: tuple[Kernel, ...] = ()  # CONV_CHAIN: its CONV kernels, in order
    # graph values this kernel computes, for printing and pictures
    computes: tuple[Node, ...] = field(default=(), compare=False)

    @cached_property  # computed once per kernel: the runtime reads these on every launch
    def reads(self) -> tuple[Node, ...]:
        """Distinct buffers read, in first-use order (the generated function's input arguments)."""
        if self.kind in NODE_KINDS or self.kind in (KernelKind.CONV, KernelKind.CONV_CHAIN):
            return tuple(dict.fromkeys(self.inputs))
        return tuple(dict.fromkeys(e.buffer for e in self.body if isinstance(e, Load)))

    @cached_property
    def writes(self) -> tuple[Node, ...]:
        """Distinct buffers written (the generated function's output arguments)."""
        if self.kind in NODE_KINDS:
            return (self.node,)
        if self.kind is KernelKind.CONV:
            return (self.epilogue.tail,)
        if self.kind is KernelKind.CONV_CHAIN:
            return (self.stages[-1].epilogue.tail,)
        return tuple(dict.fromkeys(s.buffer for s in self.stores))

    @cached_property
    def symbols(self) -> tuple[str, ...]:
        """Symbolic dimension names the kernel takes as runtime integer arguments, sorted."""
        dims: list[Dim] = list(self.domain)
        for e in (*self.body, *self.stores):
            if isinstance(e, Load | Store):
                dims += [*e.strides, e.offset, *(d for m in getattr(e, "mask", ()) for d in m[1:])]
                dims += [d for i in getattr(e, "indirect", ()) for d in (i.stride, i.size)]
        return tuple(
            sorted(symbols(dims) | {n for b in (*self.reads, *self.writes) for n in symbols(b.shape)})
        )

    def __str__(self) -> str:
        head = f"{self.name}: {self.kind} over {shape_str(self.domain)}"
        if self.kind is KernelKind.ROW:
            head += f" (row = last {self.row_rank})"
        lines = [head]
        if self.kind is KernelKind.CONV_CHAIN:
            for stage in self.stages:
                lines += ["  " + line for line in str(stage).splitlines()]
            return "\n".join(lines)
        if self.kind in NODE_KINDS or self.kind is KernelKind.CONV:
            arg = "" if self.node.arg is None else f" {format_arg(self.node.arg)}"
            lines.append(f"  {self.node.op}{arg}")
        if self.kind is KernelKind.CONV:
            ep = self.epilogue
            post = [
                "bias" if ep.bias is not None else "",
                "+ residual" if ep.residual is not None else "",
                f"{ep.activation}{list(ep.scalars) if ep.scalars else ''}" if ep.activation else "",
            ]
            lines.append(f"  post-ops: {' '.join(p for p in post if p) or '-'}")
        for i, e in enumerate(self.body):
            if isinstance(e, Load):
                extra = f" mask={e.mask} other={e.other}" if e.mask else ""
                extra += f" indirect={[(i.value, i.stride) for i in e.indirect]}" if e.indirect else ""
                lines.append(
                    f"  v{i} = load {e.dtype}{shape_str(e.buffer.shape)} strides={e.strides} "
                    f"offset={e.offset}{extra}"
                )
            else:
                arg = "" if e.arg is None else f" {{{format_arg(e.arg)}}}"
                lines.append(f"  v{i} = {e.op}({', '.join(f'v{s}' for s in e.src)}){arg} : {e.dtype}")
        for s in self.stores:
            lines.append(
                f"  store v{s.value} -> {s.buffer.dtype}{shape_str(s.buffer.shape)} strides={s.strides}"
                + (f" offset={s.offset}" if s.offset != 0 else "")
            )
        return "\n".join(lines)


def row_invariant(kernel: Kernel) -> list[bool]:
    """For each body entry of a ROW kernel: True when its value is the same along the whole row."""
    out: list[bool] = []
    for e in kernel.body:
        if isinstance(e, Load):
            row_strides = e.strides[len(e.strides) - kernel.row_rank :] if kernel.row_rank else ()
            row_masks = [m for m in e.mask if m[0] >= len(kernel.domain) - kernel.row_rank]
            out.append(
                all(s == 0 for s in row_strides) and not row_masks and all(out[i.value] for i in e.indirect)
            )
        elif e.op in REDUCE:
            out.append(not _is_column_sum(kernel, e))
        elif e.op in ROW:
            out.append(False)
        elif e.op is Op.CONCAT:
            out.append(e.arg.axis < len(kernel.domain) - kernel.row_rank and all(out[s] for s in e.src))
        else:
            out.append(all(out[s] for s in e.src))
    return out


def _is_column_sum(kernel: Kernel, e: Compute) -> bool:
    split = len(kernel.domain) - kernel.row_rank
    return e.op in REDUCE and bool(e.arg) and all(a < split for a in e.arg)


def column_sums(kernel: Kernel) -> list[int]:
    """The body positions of a ROW kernel's column sums (sums over every axis outside the row)."""
    if kernel.kind is not KernelKind.ROW:
        return []
    return [i for i, e in enumerate(kernel.body) if isinstance(e, Compute) and _is_column_sum(kernel, e)]
