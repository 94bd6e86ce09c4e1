"""The autograd glue of the hub layers: generated forward and backward kernels from one traced graph.

When a hub layer runs with gradients, :func:`apply` takes the layer's optimized forward graph (the one
:mod:`kernelize.hub` compiled for inference), differentiates it on the IR (:func:`kernelize.ir.autodiff.vjp`)
and cuts the joint graph in two (:func:`kernelize.ir.autodiff.split`): a forward graph that also writes the
values backward needs (per-row statistics such as ``rstd``; the rule compares bytes saved with bytes
recomputed) and a backward graph from saved values and cotangents to gradients. Both are optimized by the
same passes, planned and generated for the layer's backend (C++, Triton, CUDA C or the reference
executor) and cached per forward graph and per set of inputs that require grad. No torch-autograd
recomputation runs.

Each training signature gets its own ``torch.autograd.Function`` subclass whose forward and backward call
compiled graphs; under ``torch.compile`` those calls are the ``kernelize::run_graph`` custom op, so dynamo
traces forward and backward without a graph break.

Example:
    >>> with torch.enable_grad():  # doctest: +SKIP
    ...     y = rms_norm_layer(x)  # the forward kernel also writes rstd
    ...     y.sum().backward()  # the generated backward kernels run
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernelize.ir.autodiff import split, vjp
from kernelize.passes.optimize import optimize

__all__ = ["TrainingGraphs", "apply", "apply_traced", "clear_cache", "training_graphs"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TrainingGraphs:
    """The compiled forward (outputs + saved values) and backward (gradients) of one hub-layer signature.

    Attributes:
        forward: CompiledGraph over all the layer's tensors: n_outputs outputs, then the saved values that
            are not outputs.
        backward: CompiledGraph over ``primals_read`` tensors, the saved values and one cotangent per output.
        wrt: Indices of the layer's tensors that get gradients (the backward's outputs, in order).
        function: The ``autograd.Function`` subclass that runs the two.
    """

    forward: Any
    backward: Any
    n_outputs: int
    n_saved: int
    primals_read: tuple[int, ...]
    wrt: tuple[int, ...]
    function: type[torch.autograd.Function]
    saved_index: tuple[int, ...] = ()  # per saved value, its position in the forward's outputs
    label: str = "?"  # the layer's signature, for error messages


_LOCK = threading.RLock()
_TRAINING: dict[tuple[Any, tuple[int, ...]], TrainingGraphs] = {}


def training_graphs(compiled: Any, wrt: Sequence[int], label: str = "?") -> TrainingGraphs:
    """The forward/backward pair for the inference CompiledGraph `compiled`, differentiated for `wrt`;
    `label` names the layer in errors (its signature).

    Built once per (forward graph, backend, device, `wrt`), then cached in memory.
    """
    key = (compiled, tuple(wrt))
    found = _TRAINING.get(key)
    if found is not None:
        return found
    with _LOCK:
        found = _TRAINING.get(key)
        if found is None:
            found = _TRAINING[key] = _build(compiled, tuple(wrt), label)
    return found


def _build(compiled: Any, wrt: tuple[int, ...], label: str) -> TrainingGraphs:
    from kernelize.runtime.compiled import compile_graph

    graph = compiled.graph
    cut = split(vjp(graph, wrt))
    forward = compile_graph(optimize(cut.forward), backend=compiled.backend, device=compiled.device)
    # gradients are fresh tensors: autograd's AccumulateGrad copies a gradient the output pool still holds
    backward = compile_graph(
        optimize(cut.backward), backend=compiled.backend, device=compiled.device, pool_outputs=False
    )
    forward.own_workers = backward.own_workers = False  # a layer's: see hub.signatures
    logger.info(
        "Generated backward for %s on %s: forward %d kernel(s) saving %d value(s), backward %d kernel(s)",
        ", ".join(str(i.arg) for i in graph.inputs),
        compiled.backend,
        len(forward.kernels),
        cut.n_saved,
        len(backward.kernels),
    )
    n_outputs = len(graph.outputs)
    pair = TrainingGraphs(
        forward,
        backward,
        n_outputs,
        cut.n_saved,
        cut.primals_read,
        wrt,
        torch.autograd.Function,
        cut.saved_index,
        label,
    )
    pair.function = _function(pair, len(graph.inputs))
    return pair


def _function(pair: TrainingGraphs, n_tensors: int) -> type[torch.autograd.Function]:
    """An autograd.Function bound to `pair` (a class per signature, so its apply takes tensors only).

    (perf) The two methods do no more than the compiled graphs need: a layer's call is ~10 Python-level
    steps, each costing microseconds when other work has evicted the caches between training steps.
    Gradients of unused outputs arrive as zeros (autograd materialises them by default).
    """
    read, n_out, saved = pair.primals_read, pair.n_outputs, pair.saved_index
    holes = [None] * n_tensors  # the backward's result: gradients at the `wrt` positions, None elsewhere
    scatter = [(slot, i) for slot, i in enumerate(pair.wrt)]
    wrt_all = list(pair.wrt) == list(range(n_tensors))

    def forward(ctx, *tensors: torch.Tensor):  # type: ignore[no-untyped-def]
        outs = pair.forward(*tensors)
        ctx.save_for_backward(*[tensors[i] for i in read], *[outs[i] for i in saved])
        return tuple(outs[:n_out])

    def backward(ctx, *grads: torch.Tensor):  # type: ignore[no-untyped-def]
        saved = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True
            with torch.no_grad():
                got = pair.backward(*saved, *grads)
            got = _no_derivative(got, [*saved, *grads], pair.label)
        else:
            got = pair.backward(*saved, *grads)
        if wrt_all:
            return tuple(got)
        out = list(holes)
        for slot, i in scatter:
            out[i] = got[slot]
        return tuple(out)

    return type(
        "HubKernelFunction",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "backward": staticmethod(backward),
        },
    )


def _no_derivative(
    grads: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], label: str
) -> list[torch.Tensor]:
    """``grads`` as tensors whose derivative raises: kernels made them, and without this node a second
    derivative through them (``create_graph=True`` and a second ``autograd.grad``) would silently be zero. The
    node also takes the ``sources`` that require grad (the inputs and upstream gradients the kernels read),
    so differentiating a gradient with respect to them reaches it (``once_differentiable`` links only the
    upstream gradients, and then ``autograd.grad`` reports the input unused)."""
    message = (
        f"kernelize: the gradient of hub layer {label} comes from generated backward kernels, which have "
        "no derivative, so it cannot be differentiated again (create_graph=True / double backward). For "
        "higher-order gradients run that layer's own forward: leave it out of the kernel mapping, or use "
        "the model without kernelize."
    )
    linked = [t for t in sources if t.requires_grad]
    err = torch._C._functions.DelayedError(message, len(grads) + len(linked))
    return list(err(*[g.detach() for g in grads], *linked)[: len(grads)])


def apply(compiled: Any, tensors: Sequence[torch.Tensor], label: str = "?") -> list[torch.Tensor]:
    """Run `compiled` (a hub layer's inference graph) on `tensors` with generated backward kernels.

    Gradients flow to the tensors that require grad; the others are constants of the backward graph.
    `label` names the layer in errors.
    """
    wrt = tuple(i for i, t in enumerate(tensors) if t.requires_grad)
    pair = training_graphs(compiled, wrt, label)
    return list(pair.function.apply(*tensors))


def apply_traced(compiled: Any, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Like :func:`apply` under ``torch.compile``, for a pair an eager call built already (else ``None``:
    building runs outside the traced graph)."""
    wrt = tuple(i for i, t in enumerate(tensors) if t.requires_grad)
    pair = _TRAINING.get((compiled, wrt))
    return None if pair is None else list(pair.function.apply(*tensors))


def clear_cache() -> None:
    """Forget every compiled training pair (the runtime's disk cache stays)."""
    with _LOCK:
        _TRAINING.clear()
