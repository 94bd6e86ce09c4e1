"""Convolution epilogues: which elementwise ops after a conv run inside the convolution library call.

oneDNN (and cuDNN through torch) apply a bias, one residual add and one activation while the output tile
is still in registers, so ``relu(conv(x, w) + b + r)`` costs one pass over memory instead of three. The
planner makes each conv a ``CONV`` kernel and :func:`conv_epilogue` grows its chain along single-user
edges, in the order the library applies them::

    conv -> [add channel bias] -> [add residual of the same shape] -> [activation]

The activation is one of :data:`ACTIVATIONS` (after a residual only ``relu``, the one oneDNN's binary
post-op chain takes). A value in the middle of the chain must have no other reader and not be a graph
output: otherwise it would have to be stored anyway.

Example:
    >>> ep = conv_epilogue(conv_node, users, outputs=set(graph.outputs))  # doctest: +SKIP
    >>> ep.bias, ep.residual, ep.activation, ep.tail  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

from kernelize.autokernel.kernels import ConvChainKernel, ConvKernel, Kernel
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Node, Op
from kernelize.ir.shapes import Dim

# activation name (oneDNN's unary post-op spelling) and its scalars
ACTIVATIONS = ("relu", "hardtanh", "sigmoid", "tanh", "swish")


@dataclass(frozen=True)
class ConvEpilogue:
    """What a CONV kernel computes after the convolution itself.

    Attributes:
        nodes: the graph values the kernel computes, conv first, ``tail`` last.
        bias: a graph value of shape ``(1, C, 1, 1)`` (before broadcast) over a constant, or None.
        residual: a value of the conv's output shape added after the bias, or None.
        activation: one of :data:`ACTIVATIONS` or None; ``scalars`` its arguments (hardtanh: min, max).
    """

    nodes: tuple[Node, ...]
    bias: Node | None = None
    residual: Node | None = None
    activation: str | None = None
    scalars: tuple[float, ...] = ()

    @property
    def conv(self) -> Node:
        return self.nodes[0]

    @property
    def tail(self) -> Node:
        return self.nodes[-1]


def channel_bias(v: Node, channels: int) -> Node | None:
    """``v`` without its broadcasts when that is a constant of shape ``(1, C, 1, 1)`` over one constant."""
    while v.op is Op.BROADCAST:
        v = v.src[0]
    if tuple(v.shape) != (1, channels, 1, 1):
        return None
    base = v
    while base.op is Op.VIEW:
        base = base.src[0]
    return v if base.op is Op.CONST and math.prod(base.shape) == channels else None


def _other(u: Node, t: Node) -> Node | None:
    """The operand of binary ``u`` that is not ``t`` (None if ``t`` is not a direct operand)."""
    if len(u.src) != 2 or t not in u.src:
        return None
    a, b = u.src
    return b if a is t else a


def _activation(t: Node, u: Node, users: Mapping[Node, Sequence[Node]]) -> tuple[str, tuple, Node] | None:
    """The activation that ``u`` (the single reader of ``t``) starts, with its scalars and last node."""
    if u.op is Op.CLAMP and u.src[0] is t:
        lo, hi = u.arg.lo, u.arg.hi
        if lo == 0 and hi == math.inf:
            return "relu", (), u
        if math.isfinite(lo) and math.isfinite(hi):
            return "hardtanh", (float(lo), float(hi)), u
        return None
    if u.op in (Op.SIGMOID, Op.TANH) and u.src[0] is t:
        return u.op.value, (), u
    return None


def _swish(t: Node, readers: Sequence[Node], users: Mapping[Node, Sequence[Node]]) -> Node | None:
    """``t * sigmoid(t)`` when those two are all the readers of ``t``: the mul, else None."""
    if len(readers) != 2:
        return None
    s = next((r for r in readers if r.op is Op.SIGMOID and r.src[0] is t), None)
    m = next((r for r in readers if r.op is Op.MUL and set(r.src) == {t, s}), None)
    if s is None or m is None or list(users.get(s, ())) != [m]:
        return None
    return m


def _added(
    u: Node,
    t: Node,
    channels: Dim,
    bias_free: bool,
    residual_free: bool,
    residual_ok: Callable[[Node], bool] | None,
) -> tuple[str, Node] | None:
    """``("bias", b)`` or ``("residual", r)`` when ``u`` adds a per-channel bias or a residual to ``t``."""
    other = _other(u, t) if u.op is Op.ADD else None
    if other is None:
        return None
    b = channel_bias(other, channels) if bias_free else None
    if b is not None:
        return "bias", b
    if (
        residual_free
        and other.op is not Op.BROADCAST
        and tuple(other.shape) == tuple(t.shape)
        and (residual_ok is None or residual_ok(other))
    ):
        return "residual", other
    return None


def conv_epilogue(
    conv: Node,
    users: Mapping[Node, Sequence[Node]],
    outputs: set[Node],
    residual_ok: Callable[[Node], bool] | None = None,
    taken: Container[Node] = (),
) -> ConvEpilogue:
    """Grow the epilogue chain of ``conv`` (see the module docstring).

    Args:
        conv: a ``conv`` graph node.
        users: direct readers of each value (through layout ops).
        outputs: graph outputs (they must be stored, so a chain stops there).
        residual_ok: optional predicate on a residual candidate (the planner rejects one that would make
            the kernels depend on each other in a cycle).
        taken: values already in another conv's epilogue (``conv(a) + conv(b)`` is one conv's residual).
    """
    nodes = [conv]
    bias = residual = act = None
    scalars: tuple = ()
    channels = conv.shape[1]
    t = conv
    while act is None and t not in outputs:
        readers = list(dict.fromkeys(users.get(t, ())))
        if any(r in taken for r in readers):
            break
        if len(readers) == 2 and t.dtype.is_float and residual is None:
            m = _swish(t, readers, users)
            if m is None:
                break
            nodes += [r for r in readers if r is not m] + [m]
            act, t = "swish", m
            break
        if len(readers) != 1:
            break
        (u,) = readers
        if u.dtype != t.dtype or tuple(u.shape) != tuple(t.shape):
            break
        added = _added(u, t, channels, bias is None and residual is None, residual is None, residual_ok)
        if added is not None:
            if added[0] == "bias":
                bias = added[1]
            else:
                residual = added[1]
            t = u
            nodes.append(u)
            continue
        found = _activation(t, u, users)
        if found is None or (residual is not None and found[0] != "relu"):
            break
        act, scalars, t = found
        nodes.append(t)
    return ConvEpilogue(tuple(nodes), bias, residual, act, scalars)


# ---- conv chains ------------------------------------------------------------------------------------------
# (kernel size, stride) of the depthwise stages a chain kernel runs: the sliding-window forms of the CPU
# backend's depthwise driver
CHAIN_DEPTHWISE = frozenset({(3, 1), (3, 2), (5, 1), (5, 2)})
CHAIN_MAX_CHANNELS = 1023  # a 1x1 stage's input channels: wider GEMMs are better left to the library
# The least bytes of intermediates a chain must keep out of memory (a symbolic dim counted as 1). Side by
# side on one core, MobileNetV2's blocks ran 0.8x their separate convs' time as a chain when the expanded
# tensor was 4.8 MB (batch 1, 112 x 112 x 96) and 1.0-1.5x when it was 0.6-1.8 MB and stayed in cache
# anyway; at batch 8 the whole model went from 77 to 66 ms (EfficientNet-B0 from 116 to 110 ms).
CHAIN_MIN_BYTES = 4 << 20


def chain_stage(k: Kernel) -> str | None:
    """``"pointwise"`` (a 1x1 conv of stride 1, no padding, one group), ``"depthwise"`` (one channel per
    group, a square kernel and stride of :data:`CHAIN_DEPTHWISE`, no dilation) or None, for an f32 CONV
    kernel with static channels: the stages a conv chain is made of."""
    if not isinstance(k, ConvKernel) or k.node.dtype is not DType.F32:
        return None
    x, w = k.node.src
    a = k.node.arg
    if not all(isinstance(d, int) for d in (*w.shape, *x.shape[1:])):
        return None
    co, cig, kh, kw = w.shape
    if (kh, kw) == (1, 1) and a.stride == (1, 1) and not any(a.padding) and a.groups == 1:
        return "pointwise" if cig <= CHAIN_MAX_CHANNELS else None
    square = kh == kw and a.stride[0] == a.stride[1] and a.dilation == (1, 1)
    if cig == 1 and a.groups == co == x.shape[1] and square and (kh, a.stride[0]) in CHAIN_DEPTHWISE:
        return "depthwise"
    return None


def conv_chains(
    kernels: Sequence[Kernel], channels_last: Container[Node], outputs: Container[Node]
) -> list[Kernel]:
    """``kernels`` with each expand (1x1) -> depthwise -> project (1x1) run of CONV kernels, or two of them
    around the depthwise one, replaced by one CONV_CHAIN kernel (see ``cpu_conv.h``, ``kz_conv_chain``).

    A link needs the earlier stage's output to be read by the next stage's conv alone (no residual, no
    other reader, not a graph output); only the last stage may add a residual; the chain's input, output
    and residual are NHWC buffers (``channels_last``). The intermediates, 6x wider than the block's input in
    MobileNetV2, are then never written to memory.

    Example:
        >>> [k.kind for k in conv_chains(kernels, nhwc, outputs)]  # doctest: +SKIP
        ['conv', 'conv_chain', 'conv_chain', 'library']
    """
    readers: dict[Node, list[Kernel]] = {}
    for k in kernels:
        for b in k.reads:
            readers.setdefault(b, []).append(k)
    writer = {k.writes[0]: k for k in kernels if isinstance(k, ConvKernel)}

    def feeds(a: Kernel, b: Kernel) -> bool:
        t = a.epilogue.tail
        return (
            t not in outputs and readers.get(t) == [b] and b.node.src[0] is t and b.epilogue.residual is not t
        )

    chained: dict[int, Kernel] = {}  # id of a stage kernel -> its chain
    for d in kernels:
        if chain_stage(d) != "depthwise" or d.epilogue.residual is not None:
            continue
        # a stage belongs to one chain: MobileNet v1's depthwise -> pointwise -> depthwise -> pointwise would
        # otherwise chain its middle 1x1 as the first chain's project and the second's expand, and the
        # second chain read the first's inner value, which nothing stores (planning failed at batch 8)
        a = writer.get(d.node.src[0])
        free_a = a is not None and id(a) not in chained and a.epilogue.residual is None
        head = [a, d] if free_a and chain_stage(a) == "pointwise" and feeds(a, d) else [d]
        (c, *more) = readers.get(d.epilogue.tail, [None])
        free_c = c is not None and not more and id(c) not in chained
        tail = [c] if free_c and chain_stage(c) == "pointwise" and feeds(d, c) else []
        for stages in (head + tail, head, [d, *tail]):  # the longest chain whose ends work
            last = stages[-1].epilogue
            ends = [stages[0].node.src[0], last.tail, *([last.residual] if last.residual is not None else [])]
            if len(stages) > 1 and all(e in channels_last for e in ends) and _kept(stages) >= CHAIN_MIN_BYTES:
                chain = _chain_kernel(stages)
                chained.update((id(s), chain) for s in stages)
                break
    out, seen = [], set()
    for k in kernels:
        chain = chained.get(id(k), k)
        if id(chain) not in seen:
            seen.add(id(chain))
            out.append(chain)
    return out


def _kept(stages: Sequence[Kernel]) -> int:
    """Bytes of the intermediates a chain of ``stages`` never stores (symbolic dims counted as 1)."""
    return sum(
        math.prod(d if isinstance(d, int) else 1 for d in s.epilogue.tail.shape)
        * s.epilogue.tail.dtype.itemsize
        for s in stages[:-1]
    )


def _chain_kernel(stages: Sequence[Kernel]) -> Kernel:
    inner = {s.epilogue.tail for s in stages[:-1]}
    inputs = tuple(dict.fromkeys(b for s in stages for b in s.inputs if b not in inner))
    (node,) = [s.node for s in stages if chain_stage(s) == "depthwise"]
    return ConvChainKernel(
        "",
        stages[-1].domain,
        node=node,
        inputs=inputs,
        stages=tuple(stages),
        computes=tuple(n for s in stages for n in s.computes),
    )


__all__ = [
    "ACTIVATIONS",
    "CHAIN_DEPTHWISE",
    "ConvEpilogue",
    "chain_stage",
    "channel_bias",
    "conv_chains",
    "conv_epilogue",
]
