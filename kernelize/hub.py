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

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from kernelize import hub_autograd
from kernelize.layer.record import record_choice, recorded_choice

__all__ = [
    "KernelRecord",
    "SIGNATURES",
    "backend_for",
    "clear_cache",
    "compiled_count",
    "compiled_ran",
    "default_mapping",
    "kernels_ran",
    "note_kernels",
    "require_float",
    "run",
    "use_backend",
]

logger = logging.getLogger(__name__)

# device type -> backend (policy as data); cuda may be switched to NVRTC by KERNELIZE_CUDA_BACKEND=cuda
DEVICE_BACKENDS: Mapping[str, str] = {
    "cpu": "cpu",
    "cuda": "triton",
    "rocm": "triton",
    "hip": "triton",
    "xpu": "triton",
}
# repo -> layers it provides, for default_mapping(); the name a model marks its layer with is the key
HUB_LAYERS: Mapping[str, Mapping[str, str]] = {
    "activation": {
        "SiluAndMul": "SiluAndMul",
        "GeluAndMul": "GeluAndMul",
        "GeluTanhAndMul": "GeluTanhAndMul",
        "FastGELU": "FastGELU",
        "QuickGELU": "QuickGELU",
        "NewGELU": "NewGELU",
        "GatedMLP": "GatedMLP",
        "LlamaMLP": "GatedMLP",
        "FusedGatedMLP": "FusedGatedMLP",
    },
    "layer_norm": {
        "RMSNorm": "RMSNorm",
        "LlamaRMSNorm": "RMSNorm",
        "GemmaRMSNorm": "GemmaRMSNorm",
        "LayerNorm": "LayerNorm",
        "FusedAddRMSNorm": "FusedAddRMSNorm",
    },
    "rotary": {"RotaryEmbedding": "RotaryEmbedding", "rotary_pos_emb": "ApplyRotaryPosEmb"},
    "softmax": {"Softmax": "Softmax", "ScaledMaskedSoftmax": "ScaledMaskedSoftmax"},
    "attention": {"ScaledDotProductAttention": "ScaledDotProductAttention"},
    "llm": {"CausalSelfAttention": "CausalSelfAttention", "PreNormDecoderLayer": "PreNormDecoderLayer"},
    "linear": {
        "Linear": "Linear",
        "LinearReLU": "LinearReLU",
        "LinearGELU": "LinearGELU",
        "LinearSiLU": "LinearSiLU",
    },
}
MAPPED_DEVICES = ("cpu", "cuda", "rocm")


@dataclass(frozen=True)
class KernelRecord:
    """What one hub-layer call ran: the backend and the generated kernels (name, source hash)."""

    backend: str
    kernels: tuple[tuple[str, str], ...]
    signature: str

    def __str__(self) -> str:
        names = ", ".join(f"{name}#{digest[:8]}" for name, digest in self.kernels) or "(library calls only)"
        return f"{self.backend}: {names}"


@dataclass(eq=False)
class _Entry:
    """A compiled graph for one signature plus what `kernels_ran` reports for it."""

    compiled: Any  # kernelize.runtime.compiled.CompiledGraph
    record: KernelRecord
    n_outputs: int


@dataclass
class _Ran:
    """Per module: the compiled graphs its forward ran (last few) and the inspect record written for them."""

    entries: list[_Entry] = dataclasses.field(default_factory=list)
    choice: Any = None


_LOCK = threading.RLock()
_CACHE: dict[tuple, _Entry] = {}
_EXACT: dict[tuple, _Entry] = {}  # (fn, backend, exact dtypes / shapes / devices, params) -> entry of _CACHE
_EXACT_MAX = 4096
SIGNATURES: dict[tuple, str] = {}  # key -> readable signature, for logs and the demo
_RAN: weakref.WeakKeyDictionary[torch.nn.Module, _Ran] = weakref.WeakKeyDictionary()
_KEEP_ENTRIES = 4  # signatures remembered per module for kernels_ran / inspect
# use_backend() blocks open in this thread / asyncio task, innermost last, as (entry token, backend). A new
# thread starts with an empty context, so a block never leaks into other threads. Each block removes its own
# token on exit, so blocks left out of order (generators, manual __exit__) restore the right backend.
_FORCED: ContextVar[tuple[tuple[object, str], ...]] = ContextVar("kernelize_hub_backend", default=())


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run every hub layer on backend `name` (``reference``, ``cpu``, ``triton``, ``cuda``) inside the block.

    The setting is private to the current thread (or asyncio task); blocks nest.

    Example:
        >>> with use_backend("reference"):
        ...     backend_for(torch.device("cpu"))
        'reference'
    """
    from kernelize.runtime.compiled import BACKENDS

    known = ("reference", *BACKENDS)
    if name not in known:
        raise ValueError(f"use_backend({name!r}): unknown backend; choose one of {', '.join(known)}.")
    token = object()
    _FORCED.set((*_FORCED.get(), (token, name)))
    try:
        yield
    finally:
        _FORCED.set(tuple(entry for entry in _FORCED.get() if entry[0] is not token))


def _forced_backend() -> str | None:
    forced = _FORCED.get()
    return forced[-1][1] if forced else None


# torch.compile cannot trace ContextVar.get: this marker (what torch.compiler.assume_constant_result sets;
# calling that here would import torch._dynamo, ~4 s) lets Dynamo call the function and use its result as a
# constant, so the backend of a compiled graph is the one in force when it was traced.
_forced_backend._dynamo_marked_constant = True  # type: ignore[attr-defined]


def require_float(layer: str, *tensors: torch.Tensor) -> None:
    """Raise what torch's own kernels raise (``NotImplementedError`` naming the dtype) when a hub layer whose
    math is floating point gets an integer or bool tensor: the generated kernels would round garbage back.

    Example:
        >>> require_float("SiluAndMul", torch.ones(2, dtype=torch.int64))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        NotImplementedError: "SiluAndMul" not implemented for 'Long' (torch.int64): ...
    """
    for t in tensors:
        if not t.is_floating_point():
            name = t.new_empty(()).type().removeprefix("torch.").removesuffix("Tensor")
            raise NotImplementedError(
                f'"{layer}" not implemented for {name!r} ({t.dtype}): the kernelize hub layer computes in '
                "floating point, as torch's own kernel does; pass a float tensor"
            )


def backend_for(device: torch.device) -> str:
    """The code generator used for tensors on `device` (see the module docstring for the rules).

    Example:
        >>> backend_for(torch.device("cpu"))
        'cpu'
    """
    forced = _forced_backend()
    if forced is not None:
        return forced
    forced = os.environ.get("KERNELIZE_HUB_BACKEND", "").strip()
    if forced:
        return forced
    if device.type == "cuda" and torch.version.hip is None:
        choice = os.environ.get("KERNELIZE_CUDA_BACKEND", "triton").strip() or "triton"
        if choice not in ("triton", "cuda"):
            raise ValueError(f"KERNELIZE_CUDA_BACKEND={choice!r}: expected `triton` or `cuda` (NVRTC).")
        return choice
    try:
        return DEVICE_BACKENDS[device.type]
    except KeyError:
        raise ValueError(
            f"Hub layers have no kernel backend for device `{device.type}` (supported: "
            f"{', '.join(DEVICE_BACKENDS)}). Keep this layer's original forward for that device."
        ) from None


def _dim_names(tensors: Sequence[torch.Tensor], dynamic: Sequence[bool]) -> list[dict[int, str]]:
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


def _signature(
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
) -> _Entry:
    """Trace, optimize and compile `fn` for one signature (slow path, once per signature)."""
    from kernelize.ir.torch_frontend import trace
    from kernelize.passes.optimize import optimize
    from kernelize.runtime.compiled import compile_graph

    call = functools.partial(fn, **params) if params else fn
    dynamic_dims = [dict(n) or None for n in names]
    graph = optimize(trace(call, *tensors, dynamic_dims=dynamic_dims, params="input"))
    compiled = compile_graph(graph, backend=backend, device=device)
    kernels = tuple((getattr(k, "name", "kernel"), getattr(k, "source_hash", "")) for k in compiled.kernels)
    shapes = ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}[{', '.join(n.get(a, str(s)) for a, s in enumerate(t.shape))}]"
        for t, n in zip(tensors, names)
    )
    extra = "".join(f", {k}={v}" for k, v in sorted(params.items()))
    record = KernelRecord(backend, kernels, f"{fn.__name__}({shapes}{extra})")
    logger.info("Compiled hub kernel %s on %s: %d kernel(s)", record.signature, backend, len(kernels))
    return _Entry(compiled, record, len(graph.outputs))


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
        entry = _CACHE.get(_key(fn, inputs, weights, params))
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


def _key(
    fn: Callable, inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], params: Mapping
) -> tuple:
    tensors = [*inputs, *weights]
    names = _dim_names(tensors, [True] * len(inputs) + [False] * len(weights))
    return _signature(fn, tensors, names, params, backend_for(tensors[0].device))


def _run_eager(
    owner: torch.nn.Module | None,
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    params: Mapping[str, Any],
) -> Any:
    tensors = [*inputs, *weights]
    device = tensors[0].device
    backend = backend_for(device)
    # (perf) exact shapes -> entry first: the symbolic signature below costs ~10 us per call
    shapes = [(t.dtype, t.shape, t.device) for t in tensors]
    exact = (fn, backend, len(inputs), tuple(params.items()), *shapes)
    entry = _EXACT.get(exact)
    if entry is None:
        names = _dim_names(tensors, [True] * len(inputs) + [False] * len(weights))
        key = _signature(fn, tensors, names, params, backend)
        entry = _CACHE.get(key)
        if entry is None:
            with _LOCK:
                entry = _CACHE.get(key)
                if entry is None:
                    entry = _build(fn, tensors, names, params, backend, device)
                    _CACHE[key] = entry
                    SIGNATURES[key] = entry.record.signature
        with _LOCK:
            if len(_EXACT) >= _EXACT_MAX:
                _EXACT.clear()
            _EXACT[exact] = entry
    if owner is not None:
        _note_ran(owner, entry)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outs = hub_autograd.apply(entry.compiled, tensors)
    else:  # not tracing and no gradients: the checks of `CompiledGraph.__call__` are done
        outs = entry.compiled.run(tensors)
    return outs[0] if entry.n_outputs == 1 else tuple(outs)


@functools.cache
def _run_outside_graph() -> Callable:
    """Under torch.compile with a cold cache, or with gradients: build, record and run outside the graph.

    Made on first use: ``torch.compiler.disable`` imports torch._dynamo (and Triton), ~1 s at import time.
    """
    return torch.compiler.disable(_run_eager)


def _note_ran(owner: torch.nn.Module, entry: _Entry) -> None:
    """Remember what `owner` ran, and add it to the module's `kernelize.inspect` record.

    A forward may run several compiled graphs (rotary: one for q, one for k) and a module sees several
    signatures (prefill and one-token decode): the record lists the kernels of the last few, deduplicated.
    """
    ran = _RAN.get(owner)
    choice = recorded_choice(owner)
    if ran is not None and entry in ran.entries and choice is ran.choice:
        return  # the common case: nothing new since the last call
    if ran is None:
        ran = _RAN[owner] = _Ran()
    if entry not in ran.entries:
        ran.entries = [*ran.entries[-(_KEEP_ENTRIES - 1) :], entry]
    if choice is not None:
        rec = _merged(ran.entries)
        if (choice.backend, choice.kernels) != (rec.backend, rec.kernels):
            choice = dataclasses.replace(choice, backend=rec.backend, kernels=rec.kernels)
            record_choice(owner, choice)
    ran.choice = choice


_NOTED: dict[KernelRecord, _Entry] = {}


def note_kernels(owner: torch.nn.Module, record: KernelRecord) -> None:
    """Record that `owner`'s forward ran kernels compiled outside :func:`run` (the attention kernels of
    :mod:`kernelize.attention`), so :func:`kernels_ran` and ``kernelize.inspect`` list them."""
    entry = _NOTED.get(record)
    if entry is None:
        entry = _NOTED.setdefault(record, _Entry(None, record, 1))
    _note_ran(owner, entry)


def _merged(entries: Sequence[_Entry]) -> KernelRecord:
    kernels = tuple(dict.fromkeys(k for e in entries for k in e.record.kernels))
    backends = dict.fromkeys(e.record.backend for e in entries)
    return KernelRecord("+".join(backends), kernels, "; ".join(e.record.signature for e in entries))


def kernels_ran(module: torch.nn.Module) -> KernelRecord | None:
    """What `module`'s forward ran through hub kernels (its last few signatures), or ``None`` if nothing."""
    ran = _RAN.get(module)
    return None if ran is None else _merged(ran.entries)


def compiled_ran(module: torch.nn.Module) -> Any:
    """The CompiledGraph (``.graph``, ``.plan``, ``.kernels``) of `module`'s last hub-kernel call, or None."""
    ran = _RAN.get(module)
    return None if ran is None else ran.entries[-1].compiled


def compiled_count() -> int:
    """How many signatures have been compiled in this process."""
    return len(_CACHE)


def clear_cache() -> None:
    """Forget every compiled graph in memory (the runtime's disk cache stays)."""
    with _LOCK:
        _CACHE.clear()
        _EXACT.clear()
        SIGNATURES.clear()


def default_mapping(devices: Sequence[str] = MAPPED_DEVICES, version: int = 1) -> dict[str, dict[str, Any]]:
    """A kernel mapping from the common layer names to the bundled hub, for ``use_kernel_mapping``.

    Every name in :data:`HUB_LAYERS` maps, for each of `devices`, to
    ``LayerRepository("kernelize/<repo>", layer_name=..., version=version)``.

    Example:
        >>> from kernelize import kernelize, use_kernel_mapping, Mode  # doctest: +SKIP
        >>> with use_kernel_mapping(default_mapping()):  # doctest: +SKIP
        ...     model = kernelize(model, device="cpu", mode=Mode.INFERENCE)
    """
    from kernelize.layer.repos import LayerRepository

    mapping: dict[str, dict[str, Any]] = {}
    for repo, layers in HUB_LAYERS.items():
        for name, layer in layers.items():
            repository = LayerRepository(repo_id=f"kernelize/{repo}", layer_name=layer, version=version)
            mapping[name] = {device: repository for device in devices}
    return mapping
