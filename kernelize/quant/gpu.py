"""Packed-weight matmuls on CUDA devices: the generated Triton (:mod:`kernelize.codegen.triton_quant`) or CUDA
C (:mod:`kernelize.codegen.cuda_quant`, NVRTC) kernel, picked as the other generated kernels are
(:func:`kernelize.hub.backend_for`: ``KERNELIZE_CUDA_BACKEND=triton`` (default) or ``cuda``) and built once
per (backend, format, x dtype, device). Both read the packed bytes and dequantize in registers.

Example:
    >>> out = torch.empty(1, 16, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
    >>> run(x.cuda(), packed_on_cuda, None, out)  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kernelize.quant.formats import PackedWeight, dequantize

Launch = Callable[[torch.Tensor, PackedWeight, "torch.Tensor | None", torch.Tensor], None]


def _triton(fmt: str, dtype: torch.dtype, device: torch.device) -> Launch:
    from kernelize.codegen.triton_quant import compile_quant

    return compile_quant(fmt, dtype, interpret=device.type == "cpu")


def _cuda(fmt: str, dtype: torch.dtype, device: torch.device) -> Launch:
    from kernelize.codegen.cuda_quant import compile_quant
    from kernelize.codegen.nvrtc import device_arch

    if device.type != "cuda":
        raise ValueError(f"the cuda (NVRTC) backend runs on CUDA tensors, not on {device}")
    return compile_quant(fmt, dtype, device_arch(device.index or 0))


def _reference(fmt: str, dtype: torch.dtype, device: torch.device) -> Launch:
    """torch on the dequantized weight (a float copy: only where the reference backend is forced)."""

    def launch(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        y = x.double() @ dequantize(packed).double().T
        out.copy_(y if bias is None else y + bias)

    return launch


# backend -> builder of a launch(x, packed, bias, out) for (format, x dtype, device)
BUILDERS: dict[str, Callable[[str, torch.dtype, torch.device], Launch]] = {
    "triton": _triton,
    "cuda": _cuda,
    "reference": _reference,
}
_LAUNCHERS: dict[tuple, Launch] = {}
_LOCK = threading.Lock()


GPU_FORMATS = ("q8_0", "q4_0", "int8")  # the formats the Triton and CUDA C kernels read


def launcher(backend: str, fmt: str, dtype: torch.dtype, device: torch.device) -> Launch:
    """The launch of ``backend`` for format ``fmt``, x of ``dtype`` on ``device`` (built once)."""
    key = (backend, fmt, dtype, device)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        if backend not in BUILDERS:
            raise ValueError(
                f"quant.linear: backend {backend!r} has no packed-weight kernels on {device}; choose one of "
                f"{sorted(BUILDERS)} (KERNELIZE_CUDA_BACKEND=triton|cuda)"
            )
        with _LOCK:
            fn = _LAUNCHERS.get(key)
            if fn is None:
                fn = _LAUNCHERS[key] = BUILDERS[backend](fmt, dtype, device)
    return fn


def run(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = x @ W.T (+ bias)`` on x's CUDA device: x ``[M, K]`` contiguous, bias f32 ``[N]`` or None,
    out ``[M, N]`` in x's dtype, the packed tensors on the same device (checked by the caller)."""
    from kernelize.hub import backend_for

    if packed.format.name not in GPU_FORMATS:
        raise ValueError(
            f"quant.linear: format {packed.format.name!r} has no GPU kernels yet (the GPU kernels take "
            f"{', '.join(GPU_FORMATS)}); run this layer on the CPU, or quantize it to one of those"
        )
    fn = launcher(backend_for(x.device), packed.format.name, x.dtype, x.device)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        fn(x, packed, bias, out)


__all__ = ["BUILDERS", "GPU_FORMATS", "launcher", "run"]
