"""`kernelize(model, mode=...)`: give each marked module the forward of the kernel layer its mapping selects.

For every marked module, in `named_modules()` order, the choice is made without touching any module. Only
when every choice is made (and none raised) are they applied, so an error leaves the whole model as it was.
Applying sets the kernel layer's `forward`, bound to the module, on the instance (the class is untouched
and hooks still run), or restores the original forward. The choice is recorded on the module for
`inspect` and logged at INFO, one line per module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Flag, auto
from types import MappingProxyType, MethodType
from typing import TYPE_CHECKING, Any

from kernelize._compat import add_note

from .device import (
    CAPABILITY_ENV,
    Device,
    DeviceType,
    device_capability,
    device_type_of,
    infer_device,
    parse_device_type,
)
from .mapping import Registry, current_mapping
from .mode import MODE_FALLBACK_ORDER, Mode, check_kernelize_mode, select_repository
from .record import FallbackReason, KernelChoice, marked_modules, record_choice, recorded_choice
from .validate import validate_kernel_layer

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .repos import RepositoryProtocol

__all__ = ["KernelizeFallback", "keep_original_forward", "kernelize", "original_forward"]

logger = logging.getLogger(__name__)

_ORIGINAL_ATTR = "_kernelize_original_forward"  # (had an instance forward, that forward)
_INSTALLED_ATTR = "_kernelize_installed_forward"  # the instance forward kernelize left in place
_TRUE = frozenset({"1", "true", "yes", "on"})


class KernelizeFallback(Flag):
    """Cases in which `kernelize` keeps a module's original forward instead of raising.

    `use_fallback=True` means `DEFAULT`, `False` means `NONE`.
    """

    NONE = 0
    NO_LAYER = auto()  # no mapping for the layer name
    NO_DEVICE = auto()  # no mapping for the device type
    NO_COMPATIBLE_PROPERTIES = auto()  # no capability range contains the device's capability
    NO_COMPATIBLE_MODE = auto()  # nothing registered for the mode chain, or the kernel lacks backward/compile
    CANNOT_LOAD = auto()  # resolving, downloading or importing the repository failed
    INCOMPATIBLE = auto()  # the kernel layer cannot replace the class (its forward's signature differs)

    DEFAULT = NO_LAYER | NO_DEVICE | NO_COMPATIBLE_PROPERTIES | NO_COMPATIBLE_MODE
    ALL = DEFAULT | CANNOT_LOAD | INCOMPATIBLE


# Policy: the flag that permits each fallback, and what to do instead. CONDITION and DISABLED are absent:
# they are the user's explicit wish and always keep the original forward.
_PERMITTED_BY: Mapping[FallbackReason, KernelizeFallback] = MappingProxyType(
    {
        FallbackReason.NO_LAYER: KernelizeFallback.NO_LAYER,
        FallbackReason.NO_DEVICE: KernelizeFallback.NO_DEVICE,
        FallbackReason.NO_COMPATIBLE_PROPERTIES: KernelizeFallback.NO_COMPATIBLE_PROPERTIES,
        FallbackReason.NO_COMPATIBLE_MODE: KernelizeFallback.NO_COMPATIBLE_MODE,
        FallbackReason.CANNOT_LOAD: KernelizeFallback.CANNOT_LOAD,
    }
)
_REMEDY: Mapping[FallbackReason, str] = MappingProxyType(
    {
        FallbackReason.NO_LAYER: (
            "Register a kernel for it with register_kernel_mapping() or use_kernel_mapping()"
        ),
        FallbackReason.NO_DEVICE: "Register a kernel for this device type in the mapping",
        FallbackReason.NO_COMPATIBLE_PROPERTIES: (
            "Register a kernel whose capability range contains this device's, or one without properties"
        ),
        FallbackReason.NO_COMPATIBLE_MODE: (
            "Register a kernel that supports this mode, or kernelize for a mode the kernel supports"
        ),
    }
)


@dataclass(frozen=True)
class _Context:
    mode: Mode
    device_type: DeviceType
    capability: int | None
    registry: Registry
    permitted: KernelizeFallback
    disabled: bool
    # (id(repo), kernel layer, replaced class) validated in this call -> why the layer cannot replace the
    # class ("" when it can); instances of one class share the check.
    checked: dict[tuple[int, type, type], str] = field(default_factory=dict, compare=False)

    @property
    def device_text(self) -> str:
        if self.capability is None:
            return str(self.device_type)
        return f"{self.device_type} (capability {self.capability})"


def _as_fallback(use_fallback: object) -> KernelizeFallback:
    if isinstance(use_fallback, bool):
        return KernelizeFallback.DEFAULT if use_fallback else KernelizeFallback.NONE
    if isinstance(use_fallback, KernelizeFallback):
        return use_fallback
    raise TypeError(
        f"kernelize: use_fallback must be a bool or KernelizeFallback flags, got {use_fallback!r}."
    )


def _resolve_device(
    model: nn.Module, device: str | torch.device | Device | None
) -> tuple[DeviceType, int | None]:
    import torch

    if device is None:
        return infer_device(model)
    if isinstance(device, Device):
        return device.type, None
    if isinstance(device, str):
        # A string is taken literally (`"cuda"` stays CUDA on a HIP build, as in `kernels`).
        index = device.partition(":")[2]
        return parse_device_type(device), int(index) if index.isdigit() else None
    if isinstance(device, torch.device):
        return device_type_of(device, torch.version.hip), device.index
    raise TypeError(f"kernelize: device must be a string such as 'cuda' or a torch.device, got {device!r}.")


def _lacking(layer: type, mode: Mode) -> str:
    """What the kernel layer lacks for `mode` ("" if nothing)."""
    lacks = []
    if Mode.TRAINING in mode and not getattr(layer, "has_backward", True):
        lacks.append("has no backward (has_backward = False), which Mode.TRAINING needs")
    if Mode.TORCH_COMPILE in mode and not getattr(layer, "can_torch_compile", False):
        lacks.append("does not declare can_torch_compile = True, which Mode.TORCH_COMPILE needs")
    return " and ".join(lacks)


def _decide(path: str, module: nn.Module, ctx: _Context) -> tuple[KernelChoice, type | None]:
    """The choice for one module and the kernel layer to install (`None`: keep the original forward)."""
    cls = type(module)
    layer_name = str(cls.kernel_layer_name)
    choice = KernelChoice(path, layer_name, cls.__qualname__, ctx.device_text, ctx.mode)

    def keep(reason: FallbackReason, detail: str) -> tuple[KernelChoice, None]:
        return dataclasses.replace(choice, fallback=reason, reason=detail), None

    if ctx.disabled:
        return keep(FallbackReason.DISABLED, "DISABLE_KERNEL_MAPPING is set")
    condition = getattr(cls, "kernel_condition", None)
    if condition is not None and not condition(module):
        return keep(FallbackReason.CONDITION, "the layer's condition returned False for this instance")
    selected = _find_repository(layer_name, ctx)
    if isinstance(selected[0], FallbackReason):
        return keep(*selected)
    repo, repo_mode = selected
    choice = dataclasses.replace(choice, repository=str(repo), registered_mode=repo_mode)
    try:
        layer = repo.load()
    except Exception as exc:
        if KernelizeFallback.CANNOT_LOAD not in ctx.permitted:
            add_note(
                exc,
                f"kernelize: while loading {repo} for `{path}` (layer `{layer_name}`, "
                f"device {ctx.device_text}, mode {ctx.mode}); "
                "use_fallback=KernelizeFallback.ALL keeps the original forward instead.",
            )
            raise
        return keep(FallbackReason.CANNOT_LOAD, f"{type(exc).__name__}: {exc}")
    first_of_class = (id(repo), layer, cls) not in ctx.checked
    if first_of_class:
        ctx.checked[(id(repo), layer, cls)] = _incompatibility(layer, cls, repo, ctx)
    incompatible = ctx.checked[(id(repo), layer, cls)]
    if incompatible:
        return keep(FallbackReason.INCOMPATIBLE, incompatible)
    lacks = _lacking(layer, ctx.mode)
    if lacks:
        return keep(FallbackReason.NO_COMPATIBLE_MODE, f"kernel layer `{layer.__qualname__}` {lacks}")
    mislabelled = _lacking(layer, repo_mode) if first_of_class else ""
    if mislabelled:  # once per call, not once per instance
        logger.warning(
            "The mapping registers %s for %s, but that kernel layer %s.", repo, repo_mode, mislabelled
        )
    return dataclasses.replace(choice, kernel_layer=layer.__qualname__), layer


def _incompatibility(layer: type, cls: type, repo: RepositoryProtocol, ctx: _Context) -> str:
    """Why `layer` cannot replace `cls` ("" if it can); raises unless `use_fallback` permits INCOMPATIBLE."""
    try:
        validate_kernel_layer(layer, cls, repo)
    except TypeError as exc:
        if KernelizeFallback.INCOMPATIBLE not in ctx.permitted:
            raise
        return str(exc)
    return ""


def _find_repository(
    layer_name: str, ctx: _Context
) -> tuple[RepositoryProtocol, Mode] | tuple[FallbackReason, str]:
    """The repository and the mode it is registered for that serve ``layer_name`` on ``ctx``'s device
    and mode, or why none does."""
    per_device = ctx.registry.get(layer_name)
    if per_device is None:
        return FallbackReason.NO_LAYER, f"no kernel mapping for layer `{layer_name}`"
    device_repos = per_device.get(ctx.device_type)
    if device_repos is None:
        registered = ", ".join(sorted(per_device))
        return FallbackReason.NO_DEVICE, f"kernels are registered for {registered}, not {ctx.device_type}"
    repos = device_repos.select(ctx.capability)
    if repos is None:
        ranges = ", ".join(str(entry) for entry in device_repos.entries)
        if ctx.capability is None:
            detail = (
                f"the {ctx.device_type} capability is unknown (no such GPU visible to torch) and every "
                f"kernel registered needs a capability range ({ranges}); "
                f"set {CAPABILITY_ENV[ctx.device_type]}"
            )
        else:
            detail = f"no registered capability range ({ranges}) contains capability {ctx.capability}"
        return FallbackReason.NO_COMPATIBLE_PROPERTIES, detail
    selected = select_repository(repos, ctx.mode)
    if selected is None:
        chain = " -> ".join(str(m) for m in MODE_FALLBACK_ORDER[ctx.mode])
        registered = ", ".join(str(m) for m in repos)
        return (
            FallbackReason.NO_COMPATIBLE_MODE,
            f"no kernel registered for the mode chain {chain} (registered: {registered})",
        )
    return selected


def _check_permitted(choice: KernelChoice, ctx: _Context) -> None:
    """Raise if `choice` keeps the original forward for a reason `use_fallback` does not permit."""
    reason = choice.fallback
    if reason in _PERMITTED_BY and _PERMITTED_BY[reason] not in ctx.permitted:
        flag = _PERMITTED_BY[reason]
        raise ValueError(
            f"kernelize cannot replace the forward of `{choice.module_path}` ({choice.replaced_class}, layer "
            f"`{choice.layer_name}`) on device {ctx.device_text} in mode {ctx.mode}: {choice.reason}. "
            f"{_REMEDY[reason]}, or pass use_fallback=KernelizeFallback.{flag.name} (or True) to keep "
            "the original forward."
        )


def _apply(module: nn.Module, choice: KernelChoice, layer: type | None) -> None:
    """Install the kernel forward on the instance, or restore the forward it had before kernelize."""
    state = module.__dict__
    if _ORIGINAL_ATTR not in state or state.get("forward") is not state.get(_INSTALLED_ATTR):
        # First visit, or someone replaced the forward since our last visit: that forward is the original.
        state[_ORIGINAL_ATTR] = ("forward" in state, state.get("forward"))
    had_forward, original = state[_ORIGINAL_ATTR]
    if layer is not None:
        state["forward"] = MethodType(layer.forward, module)
    elif had_forward:
        state["forward"] = original
    else:
        state.pop("forward", None)
    state[_INSTALLED_ATTR] = state.get("forward")
    record_choice(module, choice)


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward `module` had before `kernelize` replaced it (bound to the module)."""
    had_forward, original = module.__dict__.get(_ORIGINAL_ATTR, (False, None))
    return original if had_forward else MethodType(type(module).forward, module)


def keep_original_forward(module: nn.Module, reason: FallbackReason, detail: str) -> None:
    """Put back the forward `module` had before `kernelize` and record why (a later check refused the kernel).

    Example:
        >>> keep_original_forward(module, FallbackReason.VERIFY, "output differs")  # doctest: +SKIP
    """
    choice = recorded_choice(module)
    assert choice is not None, "keep_original_forward: kernelize has not visited this module"
    choice = dataclasses.replace(choice, kernel_layer=None, fallback=reason, reason=detail)
    _apply(module, choice, None)
    logger.info("%s", choice)


def _context(
    model: nn.Module, mode: Mode, device: str | torch.device | None, use_fallback: bool | KernelizeFallback
) -> _Context:
    """What every decision of one `kernelize` call reads: mode, device and its capability, the mapping."""
    device_type, index = _resolve_device(model, device)
    return _Context(
        mode=mode,
        device_type=device_type,
        capability=device_capability(device_type, index),
        registry=current_mapping(),
        permitted=_as_fallback(use_fallback),
        disabled=os.environ.get("DISABLE_KERNEL_MAPPING", "").strip().lower() in _TRUE,
    )


def kernelize(
    model: nn.Module,
    *,
    mode: Mode,
    device: str | torch.device | None = None,
    use_fallback: bool | KernelizeFallback = True,
) -> nn.Module:
    """Replace the forward of each marked module with the kernel layer its mapping selects (in place).

    Args:
        model: The model; every marked module in `model.named_modules()` (and every function attached
            with `use_kernelized_func`) is visited.
        mode: `Mode.INFERENCE` or `Mode.TRAINING`, optionally `| Mode.TORCH_COMPILE`.
        device: Device type to select kernels for (`"cuda"`, `"rocm"`, `"mps"`/`"metal"`, `"cpu"`, ...).
            Default: the device of the first parameter (a CUDA device on a HIP build is `rocm`).
        use_fallback: Which cases keep the original forward instead of raising: `True` (=
            `KernelizeFallback.DEFAULT`), `False` (= `NONE`) or `KernelizeFallback` flags
            (`INCOMPATIBLE`: a kernel layer whose forward cannot replace the class's is skipped, with the
            reason, instead of raising `TypeError`).

    Returns:
        `model`, for convenience.

    Raises:
        ValueError: a fallback that `use_fallback` does not permit, an invalid mode or an unknown device.
        TypeError: a kernel layer that cannot replace the marked layer.

    Example:
        >>> import torch.nn as nn
        >>> from kernelize.layer.decorators import use_kernel_forward_from_hub
        >>> @use_kernel_forward_from_hub("Identity")
        ... class Identity(nn.Module):
        ...     def forward(self, x): return x
        >>> model = kernelize(nn.Sequential(nn.Linear(2, 2), Identity()), mode=Mode.INFERENCE)
    """
    check_kernelize_mode(mode)
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize: model must be a torch.nn.Module, got {type(model).__name__}.")
    ctx = _context(model, mode, device, use_fallback)
    # Decide for every module first (loading and validating kernels, raising on a fallback that is not
    # permitted), and only then swap forwards: an error leaves every module exactly as it was.
    decided: list[tuple[nn.Module, KernelChoice, type | None]] = []
    seen: set[int] = set()
    for path, module in marked_modules(model):
        if id(module) in seen:  # a function module shared by several owners
            continue
        seen.add(id(module))
        choice, layer = _decide(path, module, ctx)
        _check_permitted(choice, ctx)
        decided.append((module, choice, layer))
    for module, choice, layer in decided:
        _apply(module, choice, layer)
        level = logging.WARNING if choice.fallback == FallbackReason.CANNOT_LOAD else logging.INFO
        logger.log(level, "%s", choice)
    return model
