"""Shared machinery of the bundled hub layers: run a layer's plain-torch math as generated kernels.

A hub layer (``hub_kernels/<repo>/build/torch-universal/<package>/layers.py``) writes its math once, as a
plain torch function, and its ``forward`` calls :func:`run` with that function and the call's tensors.
:func:`run` traces the function once per *signature* (dtypes, static dims, device, non-tensor parameters
such as ``eps``) with the leading dims of activations symbolic (so one kernel serves every batch and
sequence length), optimizes the graph, compiles it for the tensor's device, caches the compiled graph in
memory (the runtime also caches generated code on disk), runs it, and records what ran so
:func:`kernelize.inspect` can list the backend and kernels per module.

Backend by device: ``cpu`` -> the C++ backend; ``cuda``/``rocm``/``xpu`` -> Triton
(``KERNELIZE_CUDA_BACKEND=cuda`` picks the NVRTC backend on CUDA). ``KERNELIZE_HUB_BACKEND`` (or
:func:`use_backend`) forces one backend everywhere, e.g. ``reference`` for f64 gradient checks.

Gradients: when a tensor requires grad, :mod:`kernelize.hub_autograd` differentiates the layer's graph on the
IR and runs a generated forward (which also writes what backward needs) and a generated backward, so every
hub layer has a kernel backward without a second definition.

Example:
    >>> import torch
    >>> def scale_add(x, y, *, alpha):
    ...     return x * alpha + y
    >>> x, y = torch.randn(3, 8), torch.randn(3, 8)
    >>> out = run(None, scale_add, (x, y), alpha=2.0)  # doctest: +SKIP
    >>> torch.testing.assert_close(out, x * 2.0 + y)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kernelize import hub_autograd

from .embedding import train_embedding
from .names import HUB_LAYERS, MAPPED_DEVICES, default_mapping
from .policy import DEVICE_BACKENDS, backend_for, require_float, use_backend
from .project import project, train_linear
from .records import KernelRecord, compiled_ran, kernels_ran, note_kernels, note_ran
from .signatures import SIGNATURES, cached, clear_cache, compiled_count, dim_names, entry_for, signature

__all__ = [
    "DEVICE_BACKENDS",
    "HUB_LAYERS",
    "MAPPED_DEVICES",
    "SIGNATURES",
    "KernelRecord",
    "backend_for",
    "clear_cache",
    "compiled_count",
    "compiled_ran",
    "default_mapping",
    "kernels_ran",
    "note_kernels",
    "project",
    "require_float",
    "run",
    "run_into",
    "train_embedding",
    "train_linear",
    "use_backend",
]


def run(
    owner: torch.nn.Module | None,
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor] = (),
    **params: Any,
) -> Any:
    """Run ``fn(*inputs, *weights, **params)`` as generated kernels and return what ``fn`` returns.

    Args:
        owner: The module whose forward this is (recorded for :func:`kernels_ran`); ``None`` records nothing.
        fn: Plain torch math; a module-level function (its qualified name is part of the cache key).
        inputs: Activations: every dim but the last is symbolic (one kernel for every batch/sequence).
        weights: Parameters: all dims static.
        **params: Non-tensor parameters (``eps``, ``scale``...): part of the signature; kernel constants.

    Returns:
        A tensor, or a tuple of tensors when ``fn`` returns several.

    Under ``torch.compile`` (signature already compiled by an eager call, and for training its backward too)
    the call traces to the runtime's ``kernelize::run_graph`` custom op, inside an autograd.Function when
    gradients are needed, so no graph break; otherwise the lookup, build and bookkeeping run outside the
    compiled graph (one graph break).

    Example:
        >>> def silu_and_mul(x):
        ...     d = x.shape[-1] // 2
        ...     return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
        >>> y = run(None, silu_and_mul, [torch.randn(7, 64)])  # doctest: +SKIP
    """
    if torch.compiler.is_compiling():
        entry = cached(_key(fn, inputs, weights, params))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *weights))
        if entry is not None and grad:  # traced: an autograd.Function whose halves are the custom op
            outs = hub_autograd.apply_traced(entry.compiled, [*inputs, *weights])
            if outs is not None:
                return outs[0] if entry.n_outputs == 1 else tuple(outs)
        elif entry is not None:  # traced: `entry.compiled(...)` is the custom op with a fake implementation
            outs = entry.compiled(*inputs, *weights)
            return outs[0] if entry.n_outputs == 1 else tuple(outs)
        return _run_outside_graph()(owner, fn, inputs, weights, params)
    return _run_eager(owner, fn, inputs, weights, params)


def run_into(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor | None],
    weights: Sequence[torch.Tensor] = (),
    **params: Any,
) -> Any:
    """:func:`run` without gradients for math that compiles to one generated kernel, writing output ``i``
    into ``outs[i]`` (None: a new buffer); an out may be an input's memory when the kernel reads that input
    only at the element it writes (see :meth:`~kernelize.runtime.compiled.CompiledGraph.run_into`).

    Raises:
        ValueError: an input requires grad with grad mode on, or the math is not one generated kernel.

    Example:
        >>> def scaled(x):
        ...     return x * 2.0
        >>> x = torch.randn(4, 64)
        >>> y = run_into(scaled, [x], [x])  # doctest: +SKIP
    """
    tensors = [*inputs, *weights]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(f"run_into({fn.__qualname__}): inputs require grad; call it under torch.no_grad()")
    entry = entry_for(fn, tensors, len(inputs), params, backend_for(tensors[0].device))
    got = entry.compiled.run_into(tensors, outs)
    return got[0] if entry.n_outputs == 1 else tuple(got)


def _key(
    fn: Callable, inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], params: Mapping
) -> tuple:
    tensors = [*inputs, *weights]
    names = dim_names(tensors, [True] * len(inputs) + [False] * len(weights))
    return signature(fn, tensors, names, params, backend_for(tensors[0].device))


def _run_eager(
    owner: torch.nn.Module | None,
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    params: Mapping[str, Any],
) -> Any:
    tensors = [*inputs, *weights]
    entry = entry_for(fn, tensors, len(inputs), params, backend_for(tensors[0].device))
    if owner is not None:
        note_ran(owner, entry)
    try:
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            outs = hub_autograd.apply(entry.compiled, tensors, entry.record.signature)
        else:  # not tracing and no gradients: the checks of `CompiledGraph.__call__` are done
            outs = entry.compiled.run(tensors)
    except IndexError as e:  # a gather index out of range: say which layer's math read it
        where = fn.__qualname__ if owner is None else f"{type(owner).__name__} ({fn.__qualname__})"
        raise IndexError(f"{where}: {e}") from e
    return outs[0] if entry.n_outputs == 1 else tuple(outs)


@functools.cache
def _run_outside_graph() -> Callable:
    """Under torch.compile with a cold cache, or with gradients: build, record and run outside the graph.

    Made on first use: ``torch.compiler.disable`` imports torch._dynamo (and Triton), ~1 s at import time.
    """
    return torch.compiler.disable(_run_eager)
