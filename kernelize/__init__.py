"""kernelize: swap the forward of marked PyTorch layers for fused kernels.

Layer substitution is compatible with Hugging Face `kernels`: change `from kernels import ...` to
`from kernelize import ...`.
"""

from __future__ import annotations

# layer substitution API: see kernelize.layer
from kernelize.layer import (
    CUDAProperties,
    Device,
    FallbackReason,
    FuncRepository,
    KernelChoice,
    KernelizeFallback,
    LayerRepository,
    LocalFuncRepository,
    LocalLayerRepository,
    LockedFuncRepository,
    LockedLayerRepository,
    Mode,
    ROCMProperties,
    get_kernel,
    get_local_kernel,
    get_locked_kernel,
    has_kernel,
    inspect,
    kernelize,
    register_kernel_mapping,
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub,
    use_kernel_mapping,
    use_kernelized_func,
)

# graph IR / compiler API: see kernelize.ir, kernelize.runtime

__all__ = [
    "CUDAProperties",
    "Device",
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

# issue 7 (bundled hub): the mapping from common layer names to the bundled kernel repositories
from kernelize.hub import default_mapping as default_mapping  # noqa: E402
