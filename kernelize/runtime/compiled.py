"""Compile a graph into a torch callable: plan, generate and compile every kernel, then launch in order.

:func:`compile_graph` plans the graph (``kernelize.autokernel.plan``), compiles each generated kernel
with a backend from :data:`BACKENDS`, and returns a :class:`CompiledGraph`. Calling it checks the inputs
(dtype, shape, device), allocates outputs and intermediates with ``torch.empty``, runs ``LIBRARY``
kernels (convolution, pooling, library matmuls) with torch and launches the generated ones. Every call
goes through one ``torch.library`` custom op, ``kernelize::run_graph``, whose fake implementation
computes output shapes from the graph, so ``torch.compile(fullgraph=True)`` traces through a model that
calls a compiled graph.

Example:
    >>> g = Graph(); x = g.input("x", ("batch", 64), "f32"); g.output(g.softmax(x))
    >>> cg = compile_graph(g, backend="cpu")  # doctest: +SKIP
    >>> y, = cg(torch.randn(3, 64))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TextIO

import torch
from torch import nn

from kernelize.autokernel.kernels import Kernel
from kernelize.codegen import cpu_pool
from kernelize.codegen.cpu_build import WORKERS, openmp_away, with_workers, workers_policy
from kernelize.ir.graph import Graph, Node, Op
from kernelize.ir.reference import EVAL, bind_inputs, evaluate
from kernelize.ir.shapes import bind
from kernelize.runtime.backend import Backend, CCall, CompiledKernel
from kernelize.runtime.buffers import (
    Buffers,
    arena_for,
    arena_lifetimes,
    channels_last_layout,
    concats_in_place,
    no_alias,
    outputs_own_buffers,
    residuals_in_place,
)
from kernelize.runtime.cache import GRAPHS, graph_fingerprint
from kernelize.runtime.conv import ConvRunner
from kernelize.runtime.launch import launch, launch_fresh
from kernelize.runtime.library import materialize, materialize_view, view_bases
from kernelize.runtime.memory import Arena
from kernelize.runtime.replay import Batch
from kernelize.runtime.schedule import (
    Bound,
    Step,
    bind_steps,
    direct_reads,
    program,
    steps_of,
    strided_inputs,
)

logger = logging.getLogger(__name__)


class _LazyBackend:
    """A backend factory imported on first use (``"module:Class"``), so importing the runtime stays cheap."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> Backend:
        module, cls = self.path.split(":")
        return getattr(importlib.import_module(module), cls)()

    def __repr__(self) -> str:
        return f"_LazyBackend({self.path!r})"


# backend name -> factory; "reference" is not here: it runs `kernelize.ir.evaluate` without a plan
BACKENDS: dict[str, Callable[[], Backend]] = {
    "triton": _LazyBackend("kernelize.codegen.triton:TritonBackend"),
    "cuda": _LazyBackend("kernelize.codegen.cuda:CudaBackend"),
    "cpu": _LazyBackend("kernelize.codegen.cpu_backend:CpuBackend"),
}
BACKEND_NAMES = ("reference", *BACKENDS)

# key -> CompiledGraph, for the custom op (which can only take strings and tensors). Held weakly, so a graph
# nobody references is freed with its constants; whoever calls a graph (a hub entry, a module, a closure
# that torch.compile traced) holds it, and a key is never reused (serial number, not id()).
_REGISTRY: weakref.WeakValueDictionary[str, CompiledGraph] = weakref.WeakValueDictionary()
_SERIAL = itertools.count()


def default_device(backend: str) -> torch.device:
    """CUDA for the GPU backends when a GPU exists, CPU otherwise."""
    if backend in ("triton", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def make_backend(name: str) -> Backend:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {list(BACKEND_NAMES)}") from None
    return factory()


def compile_graph(
    graph: Graph,
    backend: str = "triton",
    device: torch.device | str | None = None,
    *,
    plan: Any = None,
    cache: bool = True,
    pool_outputs: bool = True,
) -> CompiledGraph:
    """Plan ``graph``, compile every kernel with ``backend`` and return a callable on torch tensors.

    Args:
        graph: the graph to run (from ``trace``, ``load_onnx`` or the builder).
        backend: ``"triton"``, ``"cuda"``, ``"cpu"`` or ``"reference"`` (the eager oracle, no kernels).
        device: where inputs live and kernels run; CUDA for the GPU backends when available, else CPU.
        plan: a ready plan (anything with ``.kernels``, or a sequence of kernels) instead of ``plan(graph)``.
        cache: reuse the CompiledGraph of an identical graph, backend and device compiled before.
        pool_outputs: False: the graph's outputs are always new tensors nothing else references
            (gradients: autograd adopts a gradient nothing else references and copies any other one,
            which costs more than the kernel that computed it); on the CPU they ask for transparent huge
            pages before their first touch (``memory.empty_huge``) and keep no memory between calls.

    Raises:
        ValueError: unknown backend, or a device the backend cannot run on (the message says what to do).

    Example:
        >>> cg = compile_graph(graph, backend="cpu")  # doctest: +SKIP
        >>> outs = cg(x, w)  # doctest: +SKIP
    """
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKEND_NAMES)}")
    device = torch.device(device) if device is not None else default_device(backend)
    if plan is not None or not cache:
        return _build(graph, backend, device, plan, pool_outputs)
    key = (graph_fingerprint(graph), backend, str(device), pool_outputs)
    return GRAPHS.get_or_build(key, lambda: _build(graph, backend, device, None, pool_outputs))


def _build(graph: Graph, backend: str, device: torch.device, plan: Any, pool_outputs: bool) -> CompiledGraph:
    if backend == "reference":
        return CompiledGraph(graph, "reference", device, plan=None, kernels=[], compiled={})
    impl = make_backend(backend)
    if not impl.device_ok(device):
        hint = (
            " (set TRITON_INTERPRET=1 before importing the model code to run Triton kernels on CPU tensors)"
            if backend == "triton" and device.type == "cpu"
            else ""
        )
        raise ValueError(f"backend {backend!r} cannot run on device {device}{hint}; pass another device=")
    if plan is None:
        try:
            from kernelize.autokernel.plan import plan as make_plan
        except ImportError as e:  # the planner ships separately; say so instead of a bare ImportError
            raise RuntimeError(f"compile_graph needs kernelize.autokernel.plan ({e}); pass plan=") from e
        # a backend may ask for its own plan settings: the cpu backend generates matmul kernels (few-row
        # functions, or torch's GEMM plus a generated epilogue) and lays buffers out channels-last
        plan = make_plan(graph, impl.plan_settings)
    kernels = list(plan.kernels if hasattr(plan, "kernels") else plan)
    graph = getattr(plan, "graph", None) or graph
    generated = [k for k in kernels if impl.generates(k)]
    compiled = _compile_all(impl, generated)
    logger.debug("compiled %d kernels (%d generated) with %s", len(kernels), len(compiled), backend)
    cg = CompiledGraph(graph, backend, device, plan=plan, kernels=kernels, compiled=compiled)
    if not pool_outputs:
        cg.fresh = frozenset(graph.outputs)
    return cg


def _compile_all(impl: Backend, kernels: Sequence[Kernel]) -> dict[str, CompiledKernel]:
    """Compile every generated kernel, batched when the backend can (``compile_many``), behind a progress
    bar on an interactive terminal once compiling takes more than half a second (a warm start, all kernels
    cached, shows none)."""
    from tqdm.auto import tqdm

    if not kernels:
        return {}
    with (
        tqdm(
            total=len(kernels),
            desc=f"compiling {impl.name} kernels",
            unit="kernel",
            disable=None,
            leave=False,
            delay=BAR_DELAY_S,
        ) as bar,
        _ticking(bar),
    ):
        done = impl.compile_many(kernels, bar.update)
    return {k.name: c for k, c in zip(kernels, done)}


BAR_DELAY_S = 0.5


@contextmanager
def _ticking(bar: Any, every_s: float = 0.25) -> Iterator[None]:
    """Redraw ``bar`` (its elapsed time) every ``every_s`` once its delay has passed: kernels finish a whole
    translation unit at a time, and tqdm draws a delayed bar only when it is updated, so a compile of two
    units would show nothing until it was over."""
    stop = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not stop.wait(every_s):
            if time.monotonic() - start >= BAR_DELAY_S:
                bar.refresh()

    ticker = threading.Thread(target=tick, name="kernelize-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


_BOUND_CACHE_MAX = 256  # distinct input signatures remembered per compiled graph
# library ops the CPU runs with kernelize's own compiled functions where they apply: (applies(node, x), run)
_GLOBAL = (cpu_pool.global_supports, cpu_pool.global_reduce)
CPU_LIBRARY = {Op.POOL: (cpu_pool.supports, cpu_pool.pool), Op.SUM: _GLOBAL, Op.MEAN: _GLOBAL}
# runs of generated steps go to C in one call (kernelize.runtime.replay); KERNELIZE_REPLAY=0 keeps Python
REPLAY = os.environ.get("KERNELIZE_REPLAY", "1") != "0"


class FixedCall(NamedTuple):
    """:meth:`CompiledGraph.fixed_call`: a graph's C calls on buffers that stay the same from run to run.

    Attributes:
        calls: the calls in order, as made on the inputs they were built from.
        patches: ``(call, argument, input, byte offset)``: where a varying input's data pointer (plus the
            offset of the view of it the call reads) goes.
        outputs: the graph's outputs, on ``writes``.
        writes: the buffers the kernels write (the program that makes the calls holds them).
    """

    calls: tuple[CCall, ...]
    patches: tuple[tuple[int, int, int, int], ...]
    outputs: tuple[torch.Tensor, ...]
    writes: tuple[torch.Tensor, ...]


class CompiledGraph:
    """A graph compiled for one backend and device; call it like ``kernelize.ir.evaluate``.

    The steps and the replay program come from :mod:`kernelize.runtime.schedule`, the memory plan (layouts,
    arena lifetimes, output buffers, aliasing) from :mod:`kernelize.runtime.buffers`; this class runs them.

    Attributes:
        graph: the graph it runs (the plan's graph).
        backend: backend name; device: where inputs must live.
        plan: the fusion plan (None for the reference backend).
        kernels: the generated kernels' :class:`CompiledKernel` (source, hash) in launch order.
        key: the name this graph is registered under for the ``kernelize::run_graph`` custom op.
    """

    def __init__(
        self,
        graph: Graph,
        backend: str,
        device: torch.device,
        plan: Any,
        kernels: Sequence[Kernel],
        compiled: Mapping[str, CompiledKernel],
    ) -> None:
        self.graph, self.backend, self.device, self.plan = graph, backend, device, plan
        self.kernels: list[CompiledKernel] = [compiled[k.name] for k in kernels if k.name in compiled]
        self.key = f"{graph_fingerprint(graph)}:{backend}:{device}:{next(_SERIAL)}"
        self._consts = {n: n.arg.tensor.to(device) for n in graph.nodes if n.op is Op.CONST}
        # outputs that are views keep the buffers they view alive until the outputs are materialised
        keep = set(graph.inputs) | view_bases(graph.outputs) | set(self._consts)
        self._steps = steps_of(kernels, compiled, keep, self._conv_runner)
        self._cl = channels_last_layout(plan, kernels) if device.type == "cpu" else frozenset()
        self._bound: dict[tuple, Bound] = {}
        self._strided = strided_inputs(graph, kernels)
        # fresh large CPU outputs cost more in page faults than the kernels: the pool hands a buffer out
        # again once the caller has dropped it
        self._buffers = Buffers(device, backend == "cpu" and device.type == "cpu", self._cl)
        # intermediates that generated kernels write live in one arena per input signature
        self._lives = (
            arena_lifetimes(kernels, self._steps, set(graph.outputs), keep, self._cl)
            if self._buffers.pool is not None
            else {}
        )
        self._inplace = residuals_in_place(self._steps)
        # concats whose pieces their convs write into the concat's buffer: with the arena, their steps skip
        self._slices = concats_in_place(kernels, self._steps, self._lives)
        self._arenas: OrderedDict[tuple, Arena] = OrderedDict()
        # one generated kernel from inputs to outputs (most hub layers): calls skip the buffer bookkeeping,
        # which is most of a small call's cost (decode pays it for every layer of every token)
        self._direct = direct_reads(self._steps, graph, self._consts)
        self._own_outputs = outputs_own_buffers(self._steps, graph)
        # under the `auto` workers policy, a CPU graph's run that calls none of torch's parallel GEMMs or
        # convs runs its regions on kernelize's workers, whose caller never waits for a worker that has not
        # started. Public: the layers of a torch model set it False, since torch's own ops run between their
        # calls and two pools would spin against each other (Qwen3-MoE decode: 8-12% slower on the workers)
        self.own_workers = backend == "cpu" and workers_policy() == "auto"
        _REGISTRY[self.key] = self

    @property
    def fresh(self) -> frozenset[Node]:
        """Buffers never taken from the pool: new tensors nothing else references (``pool_outputs=False``)."""
        return self._buffers.fresh

    @fresh.setter
    def fresh(self, nodes: frozenset[Node]) -> None:
        self._buffers.fresh = frozenset(nodes)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """Run on ``inputs`` (in ``graph.inputs`` order); returns the outputs as a list.

        Under ``torch.compile`` the call is the ``kernelize::run_graph`` custom op (traced through its fake
        implementation); in eager mode it skips the dispatcher, which costs about 50 us per call.

        Raises:
            ValueError: an input requires grad while grad mode is on (compiled graphs have no backward).
        """
        if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in inputs):
            raise self._grad_error(inputs)
        if torch.compiler.is_compiling():
            return list(torch.ops.kernelize.run_graph(self.key, list(inputs)))
        return self.run(inputs)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The eager implementation behind the custom op."""
        bound = self._bind(inputs)
        workers = self.backend == "cpu" and (self.own_workers or WORKERS.value == 1)  # `auto` or `kernelize`
        if not workers or bound.torch_pool:
            if bound.torch_pool:  # its first parallel op may be torch's: its pool off this core first
                openmp_away(torch.get_num_threads())
            return self._run(inputs, bound)
        return with_workers(lambda: self._run(inputs, bound))

    def _run(self, inputs: Sequence[torch.Tensor], bound: Bound) -> list[torch.Tensor]:
        if self._direct is not None:
            return self._run_direct(inputs, bound)
        if self.backend == "reference":
            return no_alias(evaluate(self.graph, list(inputs)), inputs)
        arena = arena_for(self._arenas, bound.shapes, self._lives, self._inplace, self._slices.pieces)
        views = None if arena is None else arena.take()
        if views is None:
            return self._run_steps(inputs, bound, {})
        skip = self._slices.skip
        try:
            if arena.program is None and REPLAY:
                arena.program = program(self._steps, bound, views, self._consts, self._cl, skip)
            return self._run_steps(inputs, bound, views, arena.program, skip)
        finally:
            arena.release()

    def _run_steps(
        self,
        inputs: Sequence[torch.Tensor],
        bound: Bound,
        views: Mapping[Node, torch.Tensor],
        units=None,
        skip: frozenset[int] = frozenset(),
    ) -> list[torch.Tensor]:
        """The steps in order (``units``: runs of them as replay batches); intermediates in ``views`` are
        written there, the rest allocated. Steps in ``skip`` (concats written in place) are not run: their
        buffers are the arena's from the start."""
        vals: dict[Node, torch.Tensor] = dict(self._consts)
        vals.update((b, views[b]) for i in skip for b in self._steps[i].kernel.writes)
        strided = self._strided
        vals.update((n, t if s else t.contiguous()) for n, t, s in zip(self.graph.inputs, inputs, strided))
        for unit in [i for i in range(len(self._steps)) if i not in skip] if units is None else units:
            if isinstance(unit, Batch):
                self._run_batch(unit, vals, bound, views)
            else:
                self._run_step(unit, vals, bound, views)
        env = bound.env
        outs = [materialize_view(o, vals, env, bound.views).contiguous() for o in self.graph.outputs]
        return outs if self._own_outputs else no_alias(outs, inputs)

    def _run_step(self, i: int, vals: dict, bound: Bound, views: Mapping[Node, torch.Tensor]) -> None:
        step, shapes, env = self._steps[i], bound.shapes[i], bound.env
        k = step.kernel
        if step.conv is not None:
            ep = k.epilogue
            x, w = (materialize(s, vals, env) for s in ep.conv.src)
            r = None if ep.residual is None else materialize(ep.residual, vals, env)
            out = views.get(ep.tail)
            if out is None and step.conv.generated is not None and ep.tail in self.graph.outputs:
                out = self._buffers.empty(ep.tail, shapes[0], nhwc=True)
            vals[ep.tail] = step.conv(x, w, r, channels_last=ep.tail in self._cl, out=out)
        elif step.library:
            vals[k.node] = self._library(k, vals, bound)
        else:
            if step.operands:
                reads = [materialize(s, vals, env) for s in k.node.src]
            else:
                reads = [vals[b] if b in vals else materialize(b, vals, env) for b in k.reads]
            writes = self._written(step, reads, shapes, bound.sizes[i], bound.launch[i], views)
            vals.update(zip(k.writes, writes))
        for b in step.free:
            vals.pop(b, None)

    def _run_batch(self, batch: Batch, vals: dict, bound: Bound, views: Mapping[Node, torch.Tensor]) -> None:
        """The batch's steps from C (see :mod:`kernelize.runtime.replay`); their arena buffers go into
        ``vals`` first (a call may read a view of one an earlier call of the batch writes)."""
        env = bound.env
        for i in batch.steps:
            vals.update((b, views[b]) for b in self._steps[i].kernel.writes if b in views)

        def allocate(i: int) -> None:
            k = self._steps[i].kernel
            vals.update(zip(k.writes, self._buffers.outputs(k, bound.shapes[i], views)))

        batch.run(lambda b: vals[b] if b in vals else materialize(b, vals, env), allocate)
        for i in batch.steps:
            for b in self._steps[i].free:
                vals.pop(b, None)

    def run_into(
        self, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """``run`` for a graph of one generated kernel, writing output ``i`` into ``outs[i]`` (None: a new
        buffer). An out may be the memory of an input only when the kernel reads that input at exactly the
        element it writes (pointwise kernels, the write pass of row kernels), as a chunked loss writes the
        gradient of its logits over them.

        Raises:
            ValueError: the graph is not one generated kernel from inputs to outputs, or an out's shape,
                dtype, device or layout is not the output's (contiguous).
        """
        if self.backend == "reference":  # every output computed first, then copied: any out is fine
            got = self.run(inputs)
            for j, (g, o) in enumerate(zip(got, outs, strict=True)):
                if o is not None:
                    self._check_out(j, o, (tuple(g.shape), g.dtype, g.device))
            return [g if o is None else o.copy_(g) for g, o in zip(got, outs, strict=True)]
        bound = self._bind(inputs)
        step = self._steps[0]
        # a direct step writes only graph outputs, and no graph output is channels-last (the planner keeps
        # outputs dense; channels_last_buffers picks what conv and pool steps write): no layout test here
        if (
            self._direct is None
            or step.compiled.fresh is not None
            or any(v is not None for v in self._direct.views)
        ):
            raise ValueError(
                f"run_into: compiled graph {self.key} is not one generated kernel from its inputs to its "
                "outputs; call run() and copy"
            )
        order = self._direct.order
        views = {}
        for j, out in enumerate(outs):
            if out is None:
                continue
            node = step.kernel.writes[order[j]]
            self._check_out(j, out, (tuple(bound.shapes[0][order[j]]), node.dtype.torch, self.device))
            views[node] = out
        return self._run_direct(inputs, bound, views)

    def fixed_call(self, inputs: Sequence[torch.Tensor], varying: Sequence[int]) -> FixedCall | None:
        """For a CPU graph of generated kernels only: the C calls a run on ``inputs`` makes, writing into
        buffers allocated here that stay the same from run to run, for a replay program
        (:class:`kernelize.runtime.replay.Program`) that makes them again with other inputs of the same
        signature. ``varying``: the inputs whose data pointers change between runs (the rest, weights, stay
        put); where the calls read them is in :attr:`FixedCall.patches`. None for any other graph (a library
        step, a conv, a kernel with no C call at these sizes), or an input read through a copy."""
        if self.device.type != "cpu" or self.backend == "reference":
            return None
        bound = self._bind(inputs)
        if any(not (t.is_contiguous() or strided) for t, strided in zip(inputs, self._strided)):
            return None  # a run reads a copy of it (a weight's copy could go stale)
        if any(not inputs[j].is_contiguous() for j in varying):
            return None
        vals: dict[Node, torch.Tensor] = {**self._consts, **dict(zip(self.graph.inputs, inputs))}
        spans = [(j, inputs[j].data_ptr(), inputs[j].data_ptr() + inputs[j].nbytes) for j in varying]
        # the storages a call may read: an operand made anew from them (a copy) would not follow a patch
        known = {t.untyped_storage().data_ptr() for t in vals.values()}
        calls, patches, writes_all = [], [], []
        for i, step in enumerate(self._steps):
            k, compiled = step.kernel, step.compiled
            if step.library or step.operands or step.conv is not None or compiled is None:
                return None
            if compiled.c_call is None:  # (a kernel with `fresh` gives a C call only where it launches)
                return None
            reads = [vals[b] if b in vals else materialize(b, vals, bound.env) for b in k.reads]
            if any(t.untyped_storage().data_ptr() not in known for t in reads):
                return None
            writes = [torch.empty(s, dtype=b.dtype.torch) for b, s in zip(k.writes, bound.shapes[i])]
            known.update(w.untyped_storage().data_ptr() for w in writes)
            call = compiled.c_call(reads, writes, bound.sizes[i])
            if call is None:
                return None
            slots = call.slots or range(len(reads) + len(writes))
            for t, a in zip(reads, slots):
                hit = [(j, t.data_ptr() - lo) for j, lo, hi in spans if lo <= t.data_ptr() < hi]
                if hit and a is None:
                    return None  # a varying input the call sees only through a derived argument
                patches += [(len(calls), a, j, offset) for j, offset in hit]
            calls.append(call)
            writes_all += writes
            vals.update(zip(k.writes, writes))
        outs = [materialize_view(o, vals, bound.env, bound.views) for o in self.graph.outputs]
        if any(lo <= o.data_ptr() < hi for o in outs for _, lo, hi in spans):
            return None  # an output that is (a view of) a varying input: it would not stay put
        return FixedCall(tuple(calls), tuple(patches), tuple(outs), tuple(writes_all))

    def _check_out(self, j: int, out: torch.Tensor, want: tuple) -> None:
        """``out`` is contiguous with output ``j``'s (shape, dtype, device) ``want``, else ValueError."""
        if (tuple(out.shape), out.dtype, out.device) != want or not out.is_contiguous():
            raise ValueError(
                f"run_into: output {j} of {self.key} is {want}, contiguous; got "
                f"{(tuple(out.shape), out.dtype, out.device)} (contiguous: {out.is_contiguous()})"
            )

    def _run_direct(
        self,
        inputs: Sequence[torch.Tensor],
        bound: Bound,
        views: Mapping[Node, torch.Tensor] = {},  # noqa: B006 (read only)
    ) -> list[torch.Tensor]:
        """``run`` for a graph of one kernel from inputs to outputs: its outputs are fresh (or recycled
        buffers nothing else holds, or the caller's ``views``), so they alias no input and need no copy."""
        step, (direct, order, shapes) = self._steps[0], self._direct
        reads = [inputs[r].contiguous() if isinstance(r, int) else r for r in direct]
        writes = self._written(step, reads, bound.shapes[0], bound.sizes[0], bound.launch[0], views)
        return [writes[i] if s is None else writes[i].view(bind(s, bound.env)) for i, s in zip(order, shapes)]

    def _written(
        self,
        step: Step,
        reads: list[torch.Tensor],
        shapes: Sequence[tuple[int, ...]],
        sizes: Mapping[str, int],
        launch_it: bool,
        views: Mapping[Node, torch.Tensor] = {},  # noqa: B006 (read only)
    ) -> list[torch.Tensor]:
        """Run a generated kernel; returns what it wrote: the tensors a library call made itself
        (``CompiledKernel.fresh``), else the arena's ``views`` or buffers allocated here, filled by
        ``launch``."""
        if step.compiled.fresh is not None and launch_it:
            return launch_fresh(step, reads, sizes, lambda: self._buffers.outputs(step.kernel, shapes, views))
        writes = self._buffers.outputs(step.kernel, shapes, views)
        if launch_it:
            launch(step, reads, writes, sizes)
        return writes

    def _grad_error(self, inputs: Sequence[torch.Tensor]) -> ValueError:
        """Outputs of generated kernels carry no autograd history: say so rather than drop the gradient."""
        names = [n.arg for n, t in zip(self.graph.inputs, inputs) if getattr(t, "requires_grad", False)]
        return ValueError(
            f"input {names[0]!r} of compiled graph {self.key} requires grad, but compiled graphs have no "
            "backward, so the outputs would silently not require grad. For inference call it under "
            "torch.no_grad() or torch.inference_mode() (or pass detached inputs); to train a kernelized "
            "layer, kernelize with Mode.TRAINING (hub layers run their compiled graphs inside an "
            "autograd.Function that supplies the backward)"
        )

    def _bind(self, inputs: Sequence[torch.Tensor]) -> Bound:
        """The symbol bindings and per-step shapes for ``inputs``, checked once per distinct input signature.

        (perf) A repeated signature (dtypes, shapes, devices) skips the checks and the shape arithmetic; a
        new one goes through ``bind_inputs`` (which raises the errors for wrong inputs) and the device check.
        """
        try:
            key = tuple((t.dtype, t.shape, t.device) for t in inputs)
        except AttributeError:  # not a tensor: bind_inputs says which input
            key = None
        bound = self._bound.get(key) if key is not None else None
        if bound is not None:
            return bound
        env = bind_inputs(self.graph, inputs)
        for node, t in zip(self.graph.inputs, inputs):
            if t.device.type != self.device.type:
                raise ValueError(
                    f"input {node.arg!r} is on {t.device} but this graph was compiled for {self.device} "
                    f"({self.backend} backend); move the input with .to({str(self.device)!r})"
                )
        bound = bind_steps(self._steps, env)
        if key is not None:
            if len(self._bound) >= _BOUND_CACHE_MAX:
                self._bound.clear()
            self._bound[key] = bound
        return bound

    def _library(self, k: Kernel, vals: dict[Node, torch.Tensor], bound: Bound) -> torch.Tensor:
        node, env = k.node, bound.env
        args = [materialize(s, vals, env) for s in node.src]
        own = CPU_LIBRARY.get(node.op)
        fmt = torch.channels_last if node in self._cl else torch.contiguous_format
        if own is not None and own[0](node, args[0]):
            return own[1](node, args[0], env).to(node.dtype.torch).contiguous(memory_format=fmt)
        if node.op is Op.MATMUL and node.dtype.is_float and self.device.type == "cuda":
            out = torch.matmul(*args)  # cuBLAS accumulates 16-bit inputs in f32 already
            return out.to(node.dtype.torch).contiguous(memory_format=fmt)
        return EVAL[node.op](node, args, env).to(node.dtype.torch).contiguous(memory_format=fmt)

    def _conv_runner(self, k: Kernel, generated: CompiledKernel | None) -> ConvRunner:
        bias = k.epilogue.bias
        return ConvRunner(k, None if bias is None else materialize(bias, dict(self._consts), {}), generated)

    def __repr__(self) -> str:
        return (
            f"CompiledGraph({self.backend} on {self.device}, {len(self._steps)} steps, "
            f"{len(self.kernels)} generated kernels)"
        )


@torch.library.custom_op("kernelize::run_graph", mutates_args=())
def run_graph(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the CompiledGraph registered under ``key`` (the op ``torch.compile`` sees)."""
    return _registered(key).run(inputs)


def _registered(key: str) -> CompiledGraph:
    cg = _REGISTRY.get(key)
    if cg is None:
        raise RuntimeError(
            f"no compiled graph under {key!r}: it was released when nothing referenced it any more; keep "
            "the CompiledGraph (or the module that calls it) alive while code that calls it runs"
        )
    return cg


@run_graph.register_fake
def _run_graph_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    cg = _registered(key)
    env = bind_inputs(cg.graph, inputs)
    device = inputs[0].device if inputs else cg.device
    return [torch.empty(bind(o.shape, env), dtype=o.dtype.torch, device=device) for o in cg.graph.outputs]


class CompiledModule(nn.Module):
    """An ``nn.Module`` whose forward runs a CompiledGraph (one output -> a tensor, several -> a tuple).

    Example:
        >>> m = CompiledModule(compile_graph(graph, backend="cpu"))  # doctest: +SKIP
        >>> y = m(x)  # doctest: +SKIP
    """

    def __init__(self, compiled: CompiledGraph) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outs = self.compiled(*inputs)
        return outs[0] if len(outs) == 1 else tuple(outs)


def print_kernels(graph: Graph, backend: str = "triton", file: TextIO | None = None) -> None:
    """Print the fusion plan of ``graph`` and the generated source of each kernel (``inspect --kernels``)."""
    file = file or sys.stdout
    impl = make_backend(backend)
    from kernelize.autokernel.plan import plan as make_plan

    p = make_plan(graph, impl.plan_settings)
    kernels = list(p.kernels)
    print(f"# plan: {len(kernels)} kernels", file=file)
    for k in kernels:
        print(str(k), file=file)
    for k in kernels:
        if not impl.generates(k):
            print(f"\n# {k.name}: library call ({k.node.op}) run by the runtime with torch", file=file)
            continue
        src = impl.render(k)
        print(f"\n# ---- {k.name} ({backend}, {k.kind}) ----\n{src}", file=file)


__all__ = [
    "BACKENDS",
    "CompiledGraph",
    "CompiledModule",
    "FixedCall",
    "compile_graph",
    "default_device",
    "print_kernels",
    "run_graph",
]
