"""Scheduling a compiled graph: the step list (how each kernel runs, which buffers die after it), the
per-signature shapes of every step, the one-kernel fast path and the replay program.

A :class:`Step` per kernel, in the plan's order: what the runtime runs it as (:data:`RUN_AS`), its compiled
kernel and the buffers nothing reads after it (:func:`steps_of`). Per input signature, :func:`bind_steps`
computes the shapes each step writes and its symbol values; with an arena, :func:`program` turns runs of
generated steps into replay batches (:mod:`kernelize.runtime.replay`).

Example:
    >>> steps = steps_of(kernels, compiled, keep, conv_runner)  # doctest: +SKIP
    >>> bound = bind_steps(steps, {"batch": 4})  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kernelize.autokernel.kernels import (
    AttentionKernel,
    ConvKernel,
    ExpertsKernel,
    Kernel,
    LibraryKernel,
    MatmulKernel,
    dispatch,
)
from kernelize.ir.graph import Graph, Node, Op
from kernelize.ir.shapes import Dim, bind
from kernelize.runtime.backend import CompiledKernel
from kernelize.runtime.conv import ConvRunner
from kernelize.runtime.replay import Batch, batch_of, step_call

# how the runtime runs each kind of kernel: a torch call of its node ("library"), a launch on its node's
# operands seen through their layout views, any strides ("operands"), the conv runner ("conv"), or a launch
# on the buffers the plan lowered it for (row-major, or NHWC where the plan lays a buffer out so: "buffers")
RUN_AS = {
    LibraryKernel: "library",
    AttentionKernel: "operands",
    ExpertsKernel: "operands",
    ConvKernel: "conv",
    Kernel: "buffers",
}


@dataclass(frozen=True)
class Step:
    kernel: Kernel
    compiled: CompiledKernel | None
    free: tuple[Node, ...]  # buffers dead after this step
    library: bool = False
    operands: bool = False  # launched on the node's operands seen through their views (attention)
    conv: ConvRunner | None = None


def steps_of(
    kernels: Sequence[Kernel],
    compiled: Mapping[str, CompiledKernel],
    keep: Container[Node],
    conv_runner: Callable[[Kernel, CompiledKernel | None], ConvRunner],
) -> list[Step]:
    """One step per kernel, in order; a buffer not in ``keep`` is freed after the last kernel reading it.
    ``conv_runner(kernel, compiled)`` makes the runner of a kernel run as a conv."""
    last: dict[Node, int] = {}
    for i, k in enumerate(kernels):
        for b in k.reads:
            last[b] = i
    free: list[list[Node]] = [[] for _ in kernels]
    for b, i in last.items():
        if b not in keep:
            free[i].append(b)
    steps = []
    for k, dead in zip(kernels, free, strict=True):
        run_as, built = dispatch(RUN_AS, k, "the runtime"), compiled.get(k.name)
        conv = conv_runner(k, built) if run_as == "conv" else None
        steps.append(Step(k, built, tuple(dead), run_as == "library", run_as == "operands", conv))
    return steps


def strided_inputs(graph: Graph, kernels: Sequence[Kernel]) -> tuple[bool, ...]:
    """Per graph input, whether it keeps its strides: inputs only attention kernels read (those kernels take
    any strides) and that are not outputs; every other input is made contiguous."""
    readers: dict[Node, set[str]] = {}
    for k in kernels:
        for b in k.reads:
            readers.setdefault(b, set()).add(dispatch(RUN_AS, k, "the runtime"))
    return tuple(n not in graph.outputs and readers.get(n, set()) == {"operands"} for n in graph.inputs)


@dataclass(frozen=True)
class Bound:
    """Everything a call derives from its input shapes (cached per distinct shapes, dtypes, devices)."""

    env: dict[str, int]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per step, the shapes of the buffers it writes
    sizes: tuple[dict[str, int], ...]  # per step, its symbol values
    launch: tuple[bool, ...]  # per step, whether anything is written (empty outputs skip the launch)
    torch_pool: bool  # whether a step runs a long op on torch's OpenMP pool (see `uses_torch_pool`)
    # per graph output that views a buffer, where it lies in it (see `library.materialize_view`)
    views: dict = field(default_factory=dict, compare=False)


def bind_steps(steps: Sequence[Step], env: dict[str, int]) -> Bound:
    """The shapes, symbol values and launch flags of ``steps`` under the symbol bindings ``env``."""
    shapes = tuple(tuple(bind(b.shape, env) for b in st.kernel.writes) for st in steps)
    sizes = tuple({s: env[s] for s in st.kernel.symbols} for st in steps)
    launch = tuple(any(math.prod(sh) for sh in per) for per in shapes)
    return Bound(env, shapes, sizes, launch, uses_torch_pool(steps, env, sizes))


# library ops that may run long on torch's OpenMP pool (oneDNN / MKL GEMMs and convs): long from
# LONG_MACS multiply-adds (~0.1 ms on one core). A lighter one (ShuffleNet's 120 -> 30 grouped 1x1 conv at
# 28 x 28: 0.9 M) runs on the calling thread alone when its graph's run is on kernelize's workers.
LONG_OPS = frozenset({Op.MATMUL, Op.CONV})
LONG_MACS = 1 << 22


def multiply_adds(node: Node, env: Mapping[str, int]) -> int:
    """The multiply-adds of a MATMUL or CONV ``node`` under ``env``."""
    out = math.prod(bind(node.shape, env))
    w = bind(node.src[1].shape, env)
    return out * (math.prod(w[1:]) if node.op is Op.CONV else bind(node.src[0].shape, env)[-1])


def _many_rows(k: Kernel, sizes: Mapping[str, int]) -> bool:
    from kernelize.autokernel.matmul import FEW_ROWS, rows_of
    from kernelize.codegen.cpu_gemv import runs_in_tiles

    return rows_of(k, sizes) > FEW_ROWS and not runs_in_tiles(k)


# per kernel class, whether its generated step runs a long op on torch's OpenMP pool at the step's sizes: a
# matmul past its few-row sizes calls a library GEMM (unless the generated tiles take it), an experts
# kernel's many-pair path library GEMMs
ON_TORCH_POOL: dict[type, Callable[[Kernel, Mapping[str, int]], bool]] = {
    ExpertsKernel: lambda k, sizes: True,
    MatmulKernel: _many_rows,
    Kernel: lambda k, sizes: False,
}


def uses_torch_pool(
    steps: Sequence[Step], env: Mapping[str, int], sizes: Sequence[Mapping[str, int]]
) -> bool:
    """Whether a step runs a long op on torch's OpenMP pool under ``env``: a conv through oneDNN or a library
    GEMM / conv of :data:`LONG_MACS` or more, or a generated kernel per :data:`ON_TORCH_POOL`. A run of such
    a graph keeps its generated kernels' regions on that pool too, so that two pools' idle workers do not
    spin against each other (docs/runtime.md, "Threads")."""
    for st, sz in zip(steps, sizes):
        k = st.kernel
        if st.conv is not None or st.library:
            torch_op = st.conv.generated is None if st.conv is not None else k.node.op in LONG_OPS
            if torch_op and multiply_adds(k.node, env) >= LONG_MACS:
                return True
        elif dispatch(ON_TORCH_POOL, k, "the workers policy")(k, sz):
            return True
    return False


class Direct(NamedTuple):
    """How a graph of one generated kernel runs without the buffer bookkeeping (see :func:`direct_reads`)."""

    reads: tuple[int | torch.Tensor, ...]  # per kernel read, the graph input's index or the constant
    order: tuple[int, ...]  # per graph output, the index of the kernel write it is (or views)
    views: tuple[tuple[Dim, ...] | None, ...]  # per graph output, the shape it views its write as, or None


def direct_reads(steps: Sequence[Step], graph: Graph, consts: Mapping[Node, torch.Tensor]) -> Direct | None:
    """When ``steps`` are one generated kernel that reads only inputs and constants and writes exactly the
    graph's outputs, or reshapes (``VIEW``) of them (a projection of ``[1, 1, K]`` rows writes ``[1, N]``):
    the reads, and per output its write and view. Else None."""
    if len(steps) != 1:
        return None
    step = steps[0]
    k = step.kernel
    outs = [o.src[0] if o.op is Op.VIEW and o.src[0] in k.writes else o for o in graph.outputs]
    if step.library or step.operands or step.conv is not None or step.compiled is None:
        return None
    if set(k.writes) != set(outs) or len(set(outs)) != len(outs) or len(k.writes) != len(outs):
        return None
    where = {n: i for i, n in enumerate(graph.inputs)}
    if any(o in where for o in graph.outputs) or not all(b in where or b in consts for b in k.reads):
        return None
    reads = tuple(where[b] if b in where else consts[b] for b in k.reads)
    views = tuple(None if o is w else tuple(o.shape) for o, w in zip(graph.outputs, outs))
    return Direct(reads, tuple(k.writes.index(o) for o in outs), views)


def program(
    steps: Sequence[Step],
    bound: Bound,
    views: Mapping[Node, torch.Tensor],
    consts: Mapping[Node, torch.Tensor],
    channels_last: Container[Node],
    skip: Container[int] = (),
) -> list[int | Batch]:
    """The steps for ``bound``'s signature: runs of generated steps as replay batches, the rest alone (step
    indices). ``views``: the arena's buffers; ``channels_last``: the buffers laid out NHWC; ``skip``: steps
    left out (concats their pieces' convs write in place)."""
    unfixed: set[Node] = set()  # arena buffers a Python step may replace by tensors of its own

    def fixed(b: Node) -> torch.Tensor | None:
        return views[b] if b in views and b not in unfixed else consts.get(b)

    units: list[int | Batch] = []
    run: list = []
    for i, (step, shapes, sizes) in enumerate(zip(steps, bound.shapes, bound.sizes)):
        if i in skip:
            continue
        entry = step_call(step, shapes, sizes, fixed, channels_last, bound.env) if bound.launch[i] else None
        if entry is not None:
            run.append((i, *entry))
            continue
        own_tensor = step.conv is None and step.compiled is not None and step.compiled.fresh is not None
        if step.library or own_tensor:
            unfixed.update(step.kernel.writes)  # a library op (a GEMM, a pool) returning its own tensor
        if run:
            units.append(batch_of(run))
            run = []
        units.append(i)
    if run:
        units.append(batch_of(run))
    return units


__all__ = [
    "RUN_AS",
    "Bound",
    "Direct",
    "Step",
    "bind_steps",
    "direct_reads",
    "program",
    "steps_of",
    "strided_inputs",
]
