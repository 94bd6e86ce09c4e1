"""Which code generator runs hub layers: device type -> backend (policy as data), overridable per thread.

``cpu`` -> the C++ backend; ``cuda``/``rocm``/``xpu`` -> Triton (``KERNELIZE_CUDA_BACKEND=cuda`` picks the
NVRTC backend on CUDA). ``KERNELIZE_HUB_BACKEND`` (or :func:`use_backend`) forces one backend everywhere,
e.g. ``reference`` for f64 gradient checks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

import torch

__all__ = ["DEVICE_BACKENDS", "backend_for", "require_float", "use_backend"]

# device type -> backend (policy as data); cuda may be switched to NVRTC by KERNELIZE_CUDA_BACKEND=cuda
DEVICE_BACKENDS: Mapping[str, str] = {
    "cpu": "cpu",
    "cuda": "triton",
    "rocm": "triton",
    "hip": "triton",
    "xpu": "triton",
}
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

# (perf) `os.environ.get` of an unset variable runs Python-level mapping code and raises and catches a
# KeyError: ~19 us on every hub-layer call when a training step's other work has evicted the caches (2048 x
# 2048 layers, 2 threads). On POSIX, os.environ keeps the variables in a plain dict of bytes that every
# assignment to os.environ updates (monkeypatch.setenv too): one C lookup, ~1 us.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _env(name: str) -> str:
    """``os.environ.get(name, "").strip()``, without the Python-level lookup where the platform allows."""
    if _ENV_DATA is None:
        return os.environ.get(name, "").strip()
    raw = _ENV_DATA.get(name.encode())
    return "" if raw is None else os.fsdecode(raw).strip()


_env._dynamo_marked_constant = True  # type: ignore[attr-defined]


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
    forced = _env("KERNELIZE_HUB_BACKEND")
    if forced:
        return forced
    if device.type == "cuda" and torch.version.hip is None:
        choice = _env("KERNELIZE_CUDA_BACKEND") or "triton"
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
