"""Device types, capability ranges, and how the device of a model is found.

Capability detection never raises: on a CPU-only torch it returns `None`. `KERNELIZE_CUDA_CAPABILITY=90`
(or `KERNELIZE_ROCM_CAPABILITY`) overrides detection, so capability-based selection can be exercised and
tested on a machine without a GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

from kernelize._compat import StrEnum

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CAPABILITY_ENV",
    "CUDAProperties",
    "Device",
    "DeviceType",
    "ROCMProperties",
    "device_capability",
    "device_type_of",
    "infer_device",
    "parse_device_type",
]

logger = logging.getLogger(__name__)


class DeviceType(StrEnum):
    """Device types a kernel can be registered for (`metal` is accepted as an alias of `mps`)."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    MPS = "mps"
    XPU = "xpu"
    NPU = "npu"
    # Accepted because Hugging Face `kernels` accepts them; kernelize ships no kernels for them.
    NEURON = "neuron"
    TPU = "tpu"


_DEVICE_ALIASES = MappingProxyType({"metal": DeviceType.MPS})

# Environment variables that override capability detection, per device type that has capabilities.
CAPABILITY_ENV = MappingProxyType(
    {DeviceType.CUDA: "KERNELIZE_CUDA_CAPABILITY", DeviceType.ROCM: "KERNELIZE_ROCM_CAPABILITY"}
)


def parse_device_type(name: str | DeviceType) -> DeviceType:
    """Normalise a device name (`"cuda"`, `"cuda:1"`, `"metal"`) to a `DeviceType`.

    Example:
        >>> parse_device_type("metal"), parse_device_type("cuda:1")
        (<DeviceType.MPS: 'mps'>, <DeviceType.CUDA: 'cuda'>)
    """
    if isinstance(name, DeviceType):
        return name
    if not isinstance(name, str):
        raise TypeError(f"Device type must be a string such as 'cuda', got {name!r}.")
    base = name.split(":", 1)[0].strip().lower()
    if base in _DEVICE_ALIASES:
        return _DEVICE_ALIASES[base]
    try:
        return DeviceType(base)
    except ValueError:
        valid = ", ".join(sorted([*DeviceType, *_DEVICE_ALIASES]))
        raise ValueError(f"Unsupported device type {name!r}; supported device types are: {valid}.") from None


@dataclass(frozen=True)
class _CapabilityRange:
    """An inclusive range of compute capabilities, written as `major * 10 + minor` (8.6 is 86)."""

    min_capability: int
    max_capability: int
    device_type: ClassVar[DeviceType]

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("min_capability", "max_capability"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}.{field} must be an int such as 86 (for 8.6), got {value!r}.")
            if value < 0:
                raise ValueError(f"{name}.{field} must be >= 0, got {value}.")
        if self.min_capability > self.max_capability:
            raise ValueError(
                f"{name}: min_capability ({self.min_capability}) must be <= "
                f"max_capability ({self.max_capability})."
            )

    def contains(self, capability: int) -> bool:
        """Whether `capability` lies in the range (both ends included)."""
        return self.min_capability <= capability <= self.max_capability

    def __str__(self) -> str:
        upper = "max" if self.max_capability == sys.maxsize else str(self.max_capability)
        return f"{self.min_capability}..{upper}"


@dataclass(frozen=True)
class CUDAProperties(_CapabilityRange):
    """CUDA compute capabilities a kernel supports, both ends inclusive.

    Example:
        >>> Device("cuda", CUDAProperties(min_capability=80, max_capability=89)).properties.contains(86)
        True
    """

    device_type: ClassVar[DeviceType] = DeviceType.CUDA


@dataclass(frozen=True)
class ROCMProperties(_CapabilityRange):
    """ROCm compute capabilities a kernel supports, both ends inclusive (as torch reports them for HIP).

    Example:
        >>> ROCMProperties(min_capability=90, max_capability=95).contains(94)
        True
    """

    device_type: ClassVar[DeviceType] = DeviceType.ROCM


@dataclass(frozen=True)
class Device:
    """A device type, optionally restricted to a range of capabilities.

    Args:
        type: `cpu`, `cuda`, `rocm`, `mps` (alias `metal`), `xpu`, `npu` (also `neuron`, `tpu`).
        properties: `CUDAProperties` (only for `cuda`) or `ROCMProperties` (only for `rocm`).

    Example:
        >>> Device("metal").type
        <DeviceType.MPS: 'mps'>
        >>> Device("cpu", CUDAProperties(75, 89))
        Traceback (most recent call last):
        ...
        ValueError: CUDAProperties can only be used with a 'cuda' device, not 'cpu'.
    """

    type: DeviceType
    properties: CUDAProperties | ROCMProperties | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", parse_device_type(self.type))
        props = self.properties
        if props is None:
            return
        if not isinstance(props, _CapabilityRange):
            raise TypeError(f"Device properties must be CUDAProperties or ROCMProperties, got {props!r}.")
        if props.device_type != self.type:
            raise ValueError(
                f"{type(props).__name__} can only be used with a '{props.device_type}' device, "
                f"not '{self.type}'."
            )

    def __str__(self) -> str:
        return str(self.type) if self.properties is None else f"{self.type} (capability {self.properties})"


def _parse_capability(raw: str, source: str) -> int:
    """`"90"` -> 90, `"8.6"` -> 86, `"12.0"` -> 120."""
    text = raw.strip()
    # digits only: int() alone would take "-5", "+9" or "8.-6" and selection would then match nothing
    major, _, minor = text.partition(".")
    if not major.isdigit() or ("." in text and not (minor.isdigit() and len(minor) == 1)):
        raise ValueError(f"{source}={raw!r} is not a capability; use e.g. 90 or 8.6.")
    value = int(major) * 10 + int(minor) if minor else int(major)
    if value == 0:
        raise ValueError(f"{source}={raw!r} is not a capability; use e.g. 90 or 8.6.")
    return value


def device_capability(device_type: DeviceType, index: int | None = None) -> int | None:
    """The compute capability of a `cuda`/`rocm` device, or `None` if unknown or not applicable.

    The environment variable in `CAPABILITY_ENV` wins over detection. Detection never raises.

    Example:
        >>> device_capability(DeviceType.CPU) is None
        True
    """
    env = CAPABILITY_ENV.get(device_type)
    if env is None:
        return None
    raw = os.environ.get(env, "")
    if raw.strip():
        return _parse_capability(raw, env)
    return _detect_capability(device_type, index)


@functools.cache
def _detect_capability(device_type: DeviceType, index: int | None) -> int | None:
    try:
        import torch

        runtime = torch.version.cuda if device_type == DeviceType.CUDA else torch.version.hip
        if runtime is None or not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(index)
        return major * 10 + minor
    except Exception as exc:  # a broken driver must not break kernelize: selection just loses ranges
        logger.debug("Could not detect the %s capability: %s", device_type, exc)
        return None


def device_type_of(device: torch.device, hip_version: str | None = None) -> DeviceType:
    """The `DeviceType` of a torch device; a `cuda` device under a HIP build of torch is `rocm`.

    Example:
        >>> import torch
        >>> device_type_of(torch.device("cuda", 0), hip_version="6.2.41133")
        <DeviceType.ROCM: 'rocm'>
    """
    if device.type == "cuda" and hip_version is not None:
        return DeviceType.ROCM
    return parse_device_type(device.type)


def infer_device(model: nn.Module) -> tuple[DeviceType, int | None]:
    """The device type (and index) of the first parameter of `model`.

    Example:
        >>> import torch
        >>> infer_device(torch.nn.Linear(2, 2))
        (<DeviceType.CPU: 'cpu'>, None)
    """
    import torch

    param = next(iter(model.parameters()), None)
    if param is None:
        raise ValueError(
            f"kernelize: cannot infer the device of `{type(model).__name__}` because it has no parameters; "
            'pass it explicitly, e.g. kernelize(model, mode=Mode.INFERENCE, device="cuda").'
        )
    try:
        return device_type_of(param.device, torch.version.hip), param.device.index
    except ValueError as exc:
        raise ValueError(
            f"kernelize: the parameters of `{type(model).__name__}` are on device `{param.device}`, "
            f"which has no kernels ({exc}) Pass device=... explicitly."
        ) from None
