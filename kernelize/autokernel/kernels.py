"""Kernel specs: the contract between the fusion planner and the three code generators.

Each kind of kernel is a class of its own (:class:`Kernel` is the base; ``kind`` names the class) with its
own fields, reads and writes. Backends pick what to do with a kernel through a table keyed by class
(:func:`dispatch`), never by comparing kinds. Two families:

* **Loop kernels** (:class:`LoopKernel`): a loop nest over a ``domain`` (a shape). Its ``body`` is a tiny
  SSA program of :class:`Load` and :class:`Compute` entries, referenced by position (``v0``, ``v1``... in
  generated code); :class:`Store` entries write body values to buffers. Layout ops of the graph never
  appear here: the planner folds them into the ``strides`` / ``offset`` of loads and stores, concat and pad
  into masked loads, gather into an indirect load.

  * :class:`PointwiseKernel`: every body value is indexed by the whole domain.
  * :class:`RowKernel`: the trailing ``row_rank`` domain axes form a row reduced inside one program. Values
    are either *full* (vary along the row) or *per-row* (results of a reduction, and elementwise ops on
    those only); see :func:`row_invariant`. Row ops (softmax, log-softmax, layernorm, rmsnorm) take full
    operands and give full results; reductions (sum, mean, max, min, prod, argmax, argmin) give per-row
    results.
  * :class:`MatmulKernel`: matmuls sharing their left operand (:attr:`MatmulKernel.a`; several with
    ``PlanSettings.merge_matmuls``), each ``Compute(Op.MATMUL, src=(a, b), arg=K)`` over loads whose
    strides run over ``(*batch, M, N, K)``; the domain is ``(*batch, M, N)`` and the rest of the body is
    the elementwise epilogue over it. Operands and the contraction size are named properties.
  * :class:`SplitKKernel` (derived by GPU backends from a MATMUL kernel, never planned; see
    :mod:`kernelize.autokernel.matmul`).

* **Node kernels** (:class:`NodeKernel`): one graph ``node`` run on the buffers under its operands
  (``inputs``), no body: :class:`LibraryKernel` (one torch call), :class:`AttentionKernel` (a fused
  attention template), :class:`ConvKernel` (a conv with its bias / residual / activation epilogue) and
  :class:`ConvChainKernel` (conv stages run as one, intermediates never stored).

Reductions and row ops in a ``ROW`` kernel work over the row: a reduction's ``Compute.arg`` is the
tuple of row axes of the domain (``x.sum(dim=arg, keepdim=True)`` over domain-shaped values), softmax and
log-softmax carry the domain axis of the row (the last), norms keep the graph node's ``arg``. The one
exception is a *column sum* (``PlanSettings(column_reduce="accumulate")``): a sum or mean whose ``arg`` is
every axis outside the row; its value varies along the row, nothing in the kernel reads it, and it is only
stored (strides 0 on the outer axes), once every row has been added (see :func:`column_sums`).

Example (``y = x * rsqrt(mean(x*x) + eps) * w`` over rows of 4096, as an rmsnorm row kernel)::

    RowKernel(name="k0", domain=(batch*seq, 4096), row_rank=1,
           body=(Load(x, strides=(4096, 1)), Load(w, strides=(0, 1)),
                 Compute(Op.RMSNORM, f32, src=(0, 1), arg=NormArgs(1e-6, has_weight=True))),
           stores=(Store(value=2, buffer=y, strides=(4096, 1)),))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar, TypeVar

from kernelize._compat import StrEnum
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import REDUCE, ROW, Node, Op
from kernelize.ir.printer import format_arg
from kernelize.ir.shapes import Dim, Shape, Sym, numel, shape_str, symbols

if TYPE_CHECKING:
    from kernelize.autokernel.conv import ConvEpilogue

T = TypeVar("T")


class KernelKind(StrEnum):
    POINTWISE = "pointwise"
    ROW = "row"
    MATMUL = "matmul"
    CONV = "conv"
    CONV_CHAIN = "conv_chain"
    SPLITK = "splitk"
    ATTENTION = "attention"
    EXPERTS = "experts"
    ROUTER = "router"
    LIBRARY = "library"


# kinds whose kernel runs one graph node (a library call or a fixed template; no body): never merged
NODE_KINDS = frozenset(
    {
        KernelKind.LIBRARY,
        KernelKind.ATTENTION,
        KernelKind.EXPERTS,
        KernelKind.ROUTER,
        KernelKind.CONV,
        KernelKind.CONV_CHAIN,
    }
)


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
        flat = self.buffer.arg.tensor.reshape(-1)
        if flat.numel() == 0 or bool(flat[-1] != flat[0]):  # (perf) a weight differs at its ends: no scan
            return None
        return flat[0].item() if bool((flat == flat[0]).all()) else None


@dataclass(frozen=True)
class Compute:
    """One operation on earlier body values (``src`` are body positions), in the IR's op semantics.

    ``dtype`` is the IR dtype of the result (generated code computes 16-bit floats in f32). ``arg`` is the
    graph node's argument of ``op`` (see :mod:`kernelize.ir.ops`), or, in a kernel: a reduction's row axes, a
    matmul's contraction size, ``ConcatArgs(axis, ends)`` for ``Op.CONCAT`` (the value is ``src[i]`` for the
    first ``i`` with ``index[axis] < ends[i]``).
    """

    op: Op
    dtype: DType
    src: tuple[int, ...] = ()
    arg: object = None


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
    """What every kind has: a name, the domain it runs over, and (for printing and pictures) the graph
    values it computes. Each kind is a subclass with its own fields, reads and writes; backends dispatch on
    the class (:func:`dispatch`), ``kind`` names it."""

    name: str
    domain: Shape
    computes: tuple[Node, ...] = field(default=(), compare=False, kw_only=True)
    kind: ClassVar[KernelKind]

    @cached_property  # computed once per kernel: the runtime reads these on every launch
    def reads(self) -> tuple[Node, ...]:
        """Distinct buffers read, in first-use order (the generated function's input arguments)."""
        raise NotImplementedError

    @cached_property
    def writes(self) -> tuple[Node, ...]:
        """Distinct buffers written (the generated function's output arguments)."""
        raise NotImplementedError

    @property
    def ops(self) -> tuple[Op, ...]:
        """The operations the kernel computes (for labels in profiles)."""
        return tuple(n.op for n in self.computes)

    @property
    def touched(self) -> tuple[Node, ...]:
        """The values whose memory the kernel reads: its buffers, and (node kernels) the values under its
        node's operands' layout views."""
        return self.reads

    @property
    def nhwc_reads(self) -> tuple[Node, ...]:
        """The buffers the kernel can read channels-last (a library's activation or residual operand); a
        kernel that has some also writes channels-last."""
        return ()

    def _dims(self) -> list[Dim]:
        """Every size the kernel's indexing names (beyond its buffers' shapes)."""
        return list(self.domain)

    @cached_property
    def symbols(self) -> tuple[str, ...]:
        """Symbolic dimension names the kernel takes as runtime integer arguments, sorted."""
        buffers = {n for b in (*self.reads, *self.writes) for n in symbols(b.shape)}
        return tuple(sorted(symbols(self._dims()) | buffers))

    def _lines(self) -> list[str]:
        return []

    def __str__(self) -> str:
        return "\n".join([f"{self.name}: {self.kind} over {shape_str(self.domain)}", *self._lines()])


@dataclass(frozen=True)
class LoopKernel(Kernel):
    """A generated loop nest: ``body`` (loads and computes) evaluated over the domain, ``stores`` written."""

    body: tuple[Load | Compute, ...] = ()
    stores: tuple[Store, ...] = ()

    @property
    def row_rank(self) -> int:
        """How many trailing domain axes form a row reduced inside one program (0 but in ROW kernels)."""
        return 0

    @cached_property
    def reads(self) -> tuple[Node, ...]:
        return tuple(dict.fromkeys(e.buffer for e in self.body if isinstance(e, Load)))

    @property
    def ops(self) -> tuple[Op, ...]:
        return tuple(e.op for e in self.body if isinstance(e, Compute))

    @cached_property
    def writes(self) -> tuple[Node, ...]:
        return tuple(dict.fromkeys(s.buffer for s in self.stores))

    def _dims(self) -> list[Dim]:
        dims = list(self.domain)
        for e in (*self.body, *self.stores):
            if isinstance(e, Load | Store):
                dims += [*e.strides, e.offset]
            if isinstance(e, Load):
                dims += [d for m in e.mask for d in m[1:]]
                dims += [d for i in e.indirect for d in (i.stride, i.size)]
        return dims

    def _lines(self) -> list[str]:
        lines = []
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
        return lines


@dataclass(frozen=True)
class PointwiseKernel(LoopKernel):
    """Every body value is indexed by the whole domain."""

    kind: ClassVar[KernelKind] = KernelKind.POINTWISE


@dataclass(frozen=True)
class RowKernel(LoopKernel):
    """The trailing ``row_rank`` domain axes form a row reduced inside one program (see the module doc)."""

    kind: ClassVar[KernelKind] = KernelKind.ROW
    row_rank: int = 1

    def __str__(self) -> str:
        head, *rest = super().__str__().split("\n")
        return "\n".join([f"{head} (row = last {self.row_rank})", *rest])


@dataclass(frozen=True)
class Matmul:
    """One matmul of a MATMUL kernel, by name: ``value`` is its body position, ``b`` its right operand."""

    value: int
    b: Load


@dataclass(frozen=True)
class MatmulKernel(LoopKernel):
    """Matmuls sharing their left operand ``a``, then an elementwise epilogue over ``(*batch, M, N)``.

    The body's matmul values are ``Compute(Op.MATMUL, src=(a, b), arg=K)``; both operands are plain loads
    whose strides run over ``(*batch, M, N, K)`` (:attr:`contraction_axis` is the last: ``a`` has stride 0
    on ``N``, ``b`` on ``M``). The operands and the contraction size are named here; generators read them
    from :attr:`a`, :attr:`matmuls` and :attr:`k`, never by body position.
    """

    kind: ClassVar[KernelKind] = KernelKind.MATMUL

    def __post_init__(self) -> None:
        mms = [(i, e) for i, e in enumerate(self.body) if isinstance(e, Compute) and e.op is Op.MATMUL]
        if not mms:
            raise ValueError(f"matmul kernel {self.name}: no MATMUL in the body")
        for _, e in mms:
            if e.src[0] != mms[0][1].src[0]:
                raise ValueError(f"matmul kernel {self.name}: matmuls must share their left operand")
            if not isinstance(e.arg, int | Sym):
                raise ValueError(f"matmul kernel {self.name}: a MATMUL's arg must be its contraction size")
            for s in e.src:
                ld = self.body[s]
                if not isinstance(ld, Load) or ld.mask or ld.indirect:
                    raise ValueError(f"matmul kernel {self.name}: operands must be plain strided loads")

    @cached_property
    def a_index(self) -> int:
        """The body position of the shared left operand."""
        return self.body[self.matmuls[0].value].src[0]

    @property
    def a(self) -> Load:
        return self.body[self.a_index]

    @cached_property
    def matmuls(self) -> tuple[Matmul, ...]:
        return tuple(
            Matmul(i, self.body[e.src[1]])
            for i, e in enumerate(self.body)
            if isinstance(e, Compute) and e.op is Op.MATMUL
        )

    @property
    def k(self) -> Dim:
        """The contraction size."""
        return self.body[self.matmuls[0].value].arg

    def _dims(self) -> list[Dim]:
        return [*super()._dims(), self.k]  # a symbolic contraction is an argument too

    @property
    def contraction_axis(self) -> int:
        """The axis of the operands' strides that is contracted (one past the domain's)."""
        return len(self.domain)


@dataclass(frozen=True)
class SplitKKernel(LoopKernel):
    """Derived by GPU backends from a MATMUL kernel, never planned (:mod:`kernelize.autokernel.matmul`):
    ``body`` is a MATMUL kernel's matmul and its two operand loads, no epilogue; the one store is an f32
    buffer over the domain that each program *adds* its partial sums over a slice of K to."""

    kind: ClassVar[KernelKind] = KernelKind.SPLITK


@dataclass(frozen=True)
class NodeKernel(Kernel):
    """One graph node (``node``) run as one call on the buffers under its operands (``inputs``)."""

    node: Node
    inputs: tuple[Node, ...]

    @cached_property
    def reads(self) -> tuple[Node, ...]:
        return tuple(dict.fromkeys(self.inputs))

    @cached_property
    def writes(self) -> tuple[Node, ...]:
        return (self.node,)

    @property
    def touched(self) -> tuple[Node, ...]:
        return (*self.reads, *self.node.src)

    def _lines(self) -> list[str]:
        arg = "" if self.node.arg is None else f" {format_arg(self.node.arg)}"
        return [f"  {self.node.op}{arg}"]


@dataclass(frozen=True)
class LibraryKernel(NodeKernel):
    """A conv, pool, or a matmul better left to a library: one torch call."""

    kind: ClassVar[KernelKind] = KernelKind.LIBRARY

    @property
    def nhwc_reads(self) -> tuple[Node, ...]:
        return (self.node.src[0],) if self.node.op is Op.POOL else ()


@dataclass(frozen=True)
class AttentionKernel(NodeKernel):
    """An ``Op.ATTENTION`` node as one fused kernel over ``domain = node.shape`` (``[B, Hq, Lq, Dv]``).

    Generated code reads the operands (q, k, v, the broadcast mask, sinks) through the strides of the
    tensors the runtime hands it, which are the operands seen through their layout views
    (:func:`kernelize.runtime.library.library_operands`): a transposed or broadcast operand is never copied.
    """

    kind: ClassVar[KernelKind] = KernelKind.ATTENTION


@dataclass(frozen=True)
class ExpertsKernel(NodeKernel):
    """An ``Op.EXPERTS`` node (:mod:`kernelize.ir.experts`) as one grouped-expert kernel: it sorts the
    (token, slot) pairs by expert, runs each selected expert's MLP (up, activation, down) over its tokens and
    adds the weighted results per token. It reads its operands through the strides of the tensors the
    runtime hands it (the expert weights in place, however large)."""

    kind: ClassVar[KernelKind] = KernelKind.EXPERTS


@dataclass(frozen=True)
class RouterKernel(NodeKernel):
    """The two ``Op.ROUTE`` nodes of one router (:mod:`kernelize.ir.router`) as one row kernel: one program
    per row of logits ``[rows, E]`` (plus the choice bias ``[E]``) scores, chooses and renormalises, and
    writes the weights and the int64 indices ``[rows, K]``, whichever of them the graph uses. ``node`` is
    either twin (its arg's :attr:`~kernelize.ir.ops.RouteArgs.choice` is the router's); :attr:`weights`
    and :attr:`index` name the twins written."""

    kind: ClassVar[KernelKind] = KernelKind.ROUTER
    outputs: tuple[Node, ...] = ()  # the twins written: weights first; empty: just ``node``

    @cached_property
    def writes(self) -> tuple[Node, ...]:
        return self.outputs or (self.node,)

    @property
    def weights(self) -> Node | None:
        return next((n for n in self.writes if not n.arg.indices), None)

    @property
    def index(self) -> Node | None:
        return next((n for n in self.writes if n.arg.indices), None)

    @property
    def rows(self) -> Dim:
        return numel(self.node.shape[:-1])

    @property
    def experts(self) -> int:
        return self.node.src[0].shape[-1]


# the kernel class of each one-node kind the planner builds
NODE_KERNELS: dict[KernelKind, type[NodeKernel]] = {
    KernelKind.ATTENTION: AttentionKernel,
    KernelKind.EXPERTS: ExpertsKernel,
    KernelKind.ROUTER: RouterKernel,
    KernelKind.LIBRARY: LibraryKernel,
}


@dataclass(frozen=True)
class ConvKernel(NodeKernel):
    """A conv run by the library (oneDNN with prepacked weights on the CPU, cuDNN on a GPU) or generated,
    with ``epilogue`` (bias, residual, activation) fused as post-ops; ``inputs`` are the activation,
    weight, bias and residual buffers; it writes ``epilogue.tail``."""

    kind: ClassVar[KernelKind] = KernelKind.CONV
    epilogue: ConvEpilogue

    @cached_property
    def writes(self) -> tuple[Node, ...]:
        return (self.epilogue.tail,)

    @property
    def touched(self) -> tuple[Node, ...]:
        residual = self.epilogue.residual
        return (*super().touched, *(() if residual is None else (residual,)))

    @property
    def nhwc_reads(self) -> tuple[Node, ...]:
        residual = self.epilogue.residual
        return (self.node.src[0], *(() if residual is None else (residual,)))

    def _lines(self) -> list[str]:
        ep = self.epilogue
        post = [
            "bias" if ep.bias is not None else "",
            "+ residual" if ep.residual is not None else "",
            f"{ep.activation}{list(ep.scalars) if ep.scalars else ''}" if ep.activation else "",
        ]
        return [*super()._lines(), f"  post-ops: {' '.join(p for p in post if p) or '-'}"]


@dataclass(frozen=True)
class ConvChainKernel(NodeKernel):
    """CONV kernels (``stages``) run as one, the output of each the input of the next and nowhere stored:
    a 1x1 expansion, a depthwise conv, a 1x1 projection (an inverted-residual block), or two of them around
    the depthwise one (``PlanSettings.conv_chains``); ``node`` is the depthwise conv, ``inputs`` the buffers
    the stages read from outside the chain; it writes the last stage's tail."""

    kind: ClassVar[KernelKind] = KernelKind.CONV_CHAIN
    stages: tuple[ConvKernel, ...]

    @cached_property
    def writes(self) -> tuple[Node, ...]:
        return self.stages[-1].writes

    def _lines(self) -> list[str]:
        return ["  " + line for stage in self.stages for line in str(stage).splitlines()]


LOOP_KERNELS: dict[KernelKind, type[LoopKernel]] = {
    k.kind: k for k in (PointwiseKernel, RowKernel, MatmulKernel, SplitKKernel)
}


def loop_kernel(
    kind: KernelKind,
    name: str,
    domain: Shape,
    body: tuple[Load | Compute, ...],
    stores: tuple[Store, ...],
    row_rank: int = 0,
    computes: tuple[Node, ...] = (),
) -> LoopKernel:
    """The loop kernel of ``kind`` (how the planner builds one from a fusion group's kind)."""
    extra = {"row_rank": row_rank} if kind is KernelKind.ROW else {}
    return LOOP_KERNELS[kind](name, domain, body, stores, computes=computes, **extra)


def dispatch(table: Mapping[type, T], kernel: Kernel, backend: str) -> T:
    """``table``'s entry for ``kernel``'s class (or the nearest base class it names): how each backend
    picks the code generator, launcher or runner of a kind."""
    for cls in type(kernel).__mro__:
        if cls in table:
            return table[cls]
    raise ValueError(
        f"{backend} has no code for {kernel.kind} kernels (kernel {kernel.name}); library kernels are run "
        "by the runtime with torch"
    )


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
    if not isinstance(kernel, RowKernel):
        return []
    return [i for i, e in enumerate(kernel.body) if isinstance(e, Compute) and _is_column_sum(kernel, e)]
