"""What `kernelize` chose for each marked module, kept on the module and returned by `inspect(model)`.

Extension point: later issues add what ran (backend, compiled kernels) as new fields of `KernelChoice` with
defaults, and fill them in where the choice is made or where the kernel runs (`dataclasses.replace` plus
`record_choice`). `inspect` returns whatever is stored, so it needs no change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernelize._compat import StrEnum

from .mode import Mode

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FallbackReason", "KernelChoice", "inspect", "marked_modules", "record_choice", "recorded_choice"]

_RECORD_ATTR = "_kernelize_choice"


class FallbackReason(StrEnum):
    """Why a marked module kept its original forward."""

    NO_LAYER = "no_layer"  # no mapping for the layer name
    NO_DEVICE = "no_device"  # no mapping for the device type
    NO_COMPATIBLE_PROPERTIES = "no_compatible_properties"  # no capability range contains the device's
    NO_COMPATIBLE_MODE = "no_compatible_mode"  # nothing registered for the mode chain, or kernel lacks it
    CANNOT_LOAD = "cannot_load"  # the repository could not be resolved, downloaded or imported
    CONDITION = "condition"  # the layer's condition returned False for this instance
    DISABLED = "disabled"  # DISABLE_KERNEL_MAPPING=1
    NOT_KERNELIZED = "not_kernelized"  # kernelize has not visited this module yet
    INCOMPATIBLE = "incompatible"  # the kernel layer's forward cannot stand in for this class's (signature)
    VERIFY = "verify"  # on a probe, the kernel forward raised or its output differed from the module's own


@dataclass(frozen=True)
class KernelChoice:
    """The outcome of `kernelize` for one marked module.

    Attributes:
        module_path: Path in `model.named_modules()` (`parent.name` for functions attached with
            `use_kernelized_func`).
        layer_name: The name the layer was marked with.
        replaced_class: Qualified name of the module's class.
        device: Device type kernelize ran for (with capability, if known).
        mode: The mode kernelize was asked for.
        repository: The repository selected from the mapping, if any.
        registered_mode: The mapping mode that repository was registered for.
        kernel_layer: Qualified name of the kernel layer whose forward now runs, if any.
        fallback: Why the original forward was kept; `None` when a kernel layer is used.
        reason: Human-readable detail of the fallback.
        notes: Eager paths taken inside a replaced forward, with the reason (one per distinct reason).
    """

    module_path: str
    layer_name: str
    replaced_class: str
    device: str | None = None
    mode: Mode | None = None
    repository: str | None = None
    registered_mode: Mode | None = None
    kernel_layer: str | None = None
    fallback: FallbackReason | None = None
    reason: str = ""
    # Later issues: add fields here (with defaults), e.g. the backend and the kernels that ran.
    # filled in by kernelize.hub when a hub kernel layer's forward runs: the backend and the
    # generated kernels (name, source hash) of the last call.
    backend: str | None = None
    kernels: tuple[tuple[str, str], ...] = ()
    # Calls that kept an eager path inside a replaced forward (e.g. attention the kernel does not support),
    # one line per distinct reason.
    notes: tuple[str, ...] = ()

    @property
    def uses_kernel(self) -> bool:
        return self.fallback is None

    def __str__(self) -> str:
        where = f"`{self.module_path or '<root>'}` ({self.replaced_class}, layer `{self.layer_name}`)"
        context = f"[device {self.device}, mode {self.mode}]"
        if self.fallback is None:
            ran = ""  # what ran, once the kernel layer has run (filled in by kernelize.hub)
            if self.backend is not None:
                ran = f" ran on {self.backend}: " + (
                    ", ".join(f"{n}#{h[:8]}" for n, h in self.kernels) or "-"
                )
            notes = "".join(f"; {note}" for note in self.notes)
            return (
                f"{where} -> kernel layer `{self.kernel_layer}` from {self.repository} "
                f"(registered for {self.registered_mode}){ran}{notes} {context}"
            )
        return f"{where} keeps its original forward ({self.fallback}): {self.reason} {context}"


def record_choice(module: nn.Module, choice: KernelChoice) -> None:
    """Keep `choice` on the module instance (outside nn.Module's parameter/buffer/submodule tables)."""
    module.__dict__[_RECORD_ATTR] = choice


def recorded_choice(module: nn.Module) -> KernelChoice | None:
    """The choice stored by the last `kernelize` of this module, if any."""
    return module.__dict__.get(_RECORD_ATTR)


def marked_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every marked module reachable from `model`, with its path, in `named_modules()` order, and every
    module with a recorded choice (the experts modules served through transformers' experts interface).

    Functions attached with `use_kernelized_func` follow their owner, as `owner.function_name`.
    """
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        for name, func_module in module.__dict__.get("_kernel_funcs", {}).items():
            found.append((f"{path}.{name}" if path else name, func_module))
        if hasattr(type(module), "kernel_layer_name") or _RECORD_ATTR in module.__dict__:
            found.append((path, module))
    return found


def inspect(model: nn.Module) -> dict[str, KernelChoice]:
    """What `kernelize` chose for each marked module of `model`, by module path.

    Marked modules that were never kernelized appear with `fallback=FallbackReason.NOT_KERNELIZED`.

    Example:
        >>> import torch.nn as nn
        >>> from kernelize.layer.decorators import use_kernel_forward_from_hub
        >>> Marked = use_kernel_forward_from_hub("Identity")(type("Marked", (nn.Identity,), {}))
        >>> inspect(nn.Sequential(Marked()))["0"].fallback
        <FallbackReason.NOT_KERNELIZED: 'not_kernelized'>
    """
    choices: dict[str, KernelChoice] = {}
    for path, module in marked_modules(model):
        choice = recorded_choice(module)
        if choice is None:
            choice = KernelChoice(
                path,
                type(module).kernel_layer_name,
                type(module).__qualname__,
                fallback=FallbackReason.NOT_KERNELIZED,
                reason="kernelize has not been called on this module",
            )
        elif choice.module_path != path:  # a shared function module, last kernelized under another owner
            choice = dataclasses.replace(choice, module_path=path)
        choices[path] = choice
    return choices
