"""Layer substitution: mark layers, map them to kernel repositories, `kernelize` a model.

Compatible with Hugging Face `kernels` 0.17.2: code written against `kernels` works after changing
`from kernels import ...` to `from kernelize import ...`.
"""

from __future__ import annotations

from .decorators import (
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub,
    use_kernelized_func,
)
from .device import CUDAProperties, Device, DeviceType, ROCMProperties
from .hub import get_kernel, get_local_kernel, has_kernel
from .kernelize import KernelizeFallback, kernelize
from .lockfile import get_locked_kernel
from .mapping import register_kernel_mapping, use_kernel_mapping
from .mode import Mode
from .record import FallbackReason, KernelChoice, inspect
from .repos import (
    FuncRepository,
    LayerRepository,
    LocalFuncRepository,
    LocalLayerRepository,
    LockedFuncRepository,
    LockedLayerRepository,
    RepositoryProtocol,
)

__all__ = [
    "CUDAProperties",
    "Device",
    "DeviceType",
    "FallbackReason",
    "FuncRepository",
    "KernelChoice",
    "KernelizeFallback",
    "LayerRepository",
    "LocalFuncRepository",
    "LocalLayerRepository",
    "LockedFuncRepository",
    "LockedLayerRepository",
    "Mode",
    "ROCMProperties",
    "RepositoryProtocol",
    "get_kernel",
    "get_local_kernel",
    "get_locked_kernel",
    "has_kernel",
    "inspect",
    "kernelize",
    "register_kernel_mapping",
    "replace_kernel_forward_from_hub",
    "use_kernel_forward_from_hub",
    "use_kernel_func_from_hub",
    "use_kernel_mapping",
    "use_kernelized_func",
]
