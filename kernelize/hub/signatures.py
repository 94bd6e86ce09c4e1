"""The per-signature cache of compiled hub graphs: a signature is the function, dtypes, shapes (activation
dims symbolic), non-tensor parameters, device and backend; the first call of a signature traces, optimizes
and compiles the function (the runtime also caches generated code on disk)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from .records import Entry, KernelRecord

__all__ = ["SIGNATURES", "cached", "clear_cache", "compiled_count", "dim_names", "entry_for", "signature"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_CACHE: dict[tuple, Entry] = {}
_EXACT: dict[tuple, Entry] = {}  # (fn, backend, exact dtypes / shapes / devices, params) -> entry of _CACHE
_EXACT_MAX = 4096
SIGNATURES: dict[tuple, str] = {}  # key -> readable signature, for logs and the demo


def dim_names(tensors: Sequence[torch.Tensor], dynamic: Sequence[bool]) -> list[dict[int, str]]:
    """Symbolic names for the leading dims of the dynamic tensors.

    All dims but the last are symbolic, except size-1 dims (broadcasting). Dims are aligned from the right,
    as broadcasting aligns them: the same position and size share a name (``n2`` is the second-to-last axis,
    ``n3`` the one before...); a different size at the same position gets its own name (``n3_1``), so grouped
    query attention (fewer key heads than query heads) stays two symbols.
    """
    seen: dict[tuple[int, int], str] = {}
    per_pos: dict[int, int] = {}
    names: list[dict[int, str]] = []
    for t, dyn in zip(tensors, dynamic):
        mine: dict[int, str] = {}
        if dyn:
            for axis in range(t.dim() - 1):
                size = t.shape[axis]
                if size < 2:  # broadcast (1) and empty (0) dims stay static: torch specialises them
                    continue
                pos = t.dim() - axis
                key = (pos, size)
                if key not in seen:
                    k = per_pos.get(pos, 0)
                    per_pos[pos] = k + 1
                    seen[key] = f"n{pos}" if k == 0 else f"n{pos}_{k}"
                mine[axis] = seen[key]
        names.append(mine)
    return names


def signature(
    fn: Callable,
    tensors: Sequence[torch.Tensor],
    names: Sequence[dict[int, str]],
    params: Mapping,
    backend: str,
) -> tuple:
    """The cache key: the function, dtypes, shapes (symbolic dims as names), params, device and backend.

    Plain hashable values only (no formatting, no sorting), so torch.compile can trace the lookup; params keep
    the call site's keyword order.
    """
    shapes = tuple(
        (t.dtype, tuple(n.get(ax, s) for ax, s in enumerate(t.shape))) for t, n in zip(tensors, names)
    )
    device = tensors[0].device
    return (fn, shapes, tuple(params.items()), device.type, device.index, backend)


def _build(
    fn: Callable,
    tensors: Sequence[torch.Tensor],
    names: Sequence[dict[int, str]],
    params: Mapping,
    backend: str,
    device: torch.device,
) -> Entry:
    """Trace, optimize and compile `fn` for one signature (slow path, once per signature)."""
    from kernelize.ir.torch_frontend import trace
    from kernelize.passes.optimize import optimize
    from kernelize.runtime.compiled import compile_graph

    call = functools.partial(fn, **params) if params else fn
    dynamic_dims = [dict(n) or None for n in names]
    graph = optimize(trace(call, *tensors, dynamic_dims=dynamic_dims, params="input"))
    compiled = compile_graph(graph, backend=backend, device=device)
    compiled.own_workers = False  # a layer of a torch model: torch's ops run between its calls (runtime.md)
    kernels = tuple((getattr(k, "name", "kernel"), getattr(k, "source_hash", "")) for k in compiled.kernels)
    shapes = ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}[{', '.join(n.get(a, str(s)) for a, s in enumerate(t.shape))}]"
        for t, n in zip(tensors, names)
    )
    extra = "".join(f", {k}={v}" for k, v in sorted(params.items()))
    record = KernelRecord(backend, kernels, f"{fn.__name__}({shapes}{extra})")
    logger.info("Compiled hub kernel %s on %s: %d kernel(s)", record.signature, backend, len(kernels))
    return Entry(compiled, record, len(graph.outputs))


def cached(key: tuple) -> Entry | None:
    """The compiled entry of a signature key, if an eager call has built it."""
    return _CACHE.get(key)


def entry_for(
    fn: Callable,
    tensors: Sequence[torch.Tensor],
    n_inputs: int,
    params: Mapping,
    backend: str,
) -> Entry:
    """The compiled entry for this call: by exact shapes first, else by signature, else built now."""
    # (perf) exact shapes -> entry first: the symbolic signature below costs ~10 us per call
    shapes = [(t.dtype, t.shape, t.device) for t in tensors]
    exact = (fn, backend, n_inputs, tuple(params.items()), *shapes)
    entry = _EXACT.get(exact)
    if entry is not None:
        return entry
    names = dim_names(tensors, [True] * n_inputs + [False] * (len(tensors) - n_inputs))
    key = signature(fn, tensors, names, params, backend)
    entry = _CACHE.get(key)
    if entry is None:
        with _LOCK:
            entry = _CACHE.get(key)
            if entry is None:
                entry = _build(fn, tensors, names, params, backend, tensors[0].device)
                _CACHE[key] = entry
                SIGNATURES[key] = entry.record.signature
    with _LOCK:
        if len(_EXACT) >= _EXACT_MAX:
            _EXACT.clear()
        _EXACT[exact] = entry
    return entry


def compiled_count() -> int:
    """How many signatures have been compiled in this process."""
    return len(_CACHE)


def clear_cache() -> None:
    """Forget every compiled graph in memory (the runtime's disk cache stays)."""
    with _LOCK:
        _CACHE.clear()
        _EXACT.clear()
        SIGNATURES.clear()
