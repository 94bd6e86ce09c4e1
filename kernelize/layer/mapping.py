"""Kernel mappings: which repository serves a layer name, per device type, capability range and mode.

A mapping is an immutable value; registering builds a new one (copy-on-write), so a snapshot handed out
never changes. There are two places a mapping lives:

* the process-wide mapping, which `register_kernel_mapping` updates when called outside any scope;
* a `ContextVar` set by `use_kernel_mapping` for the duration of a `with` block. It is private to the
  thread (or asyncio task) that entered the block; `register_kernel_mapping` inside the block only
  changes the scoped mapping, which is discarded on exit.

Example:
    >>> from kernelize.layer.repos import LayerRepository
    >>> mapping = {"SiluAndMul": {"cuda": LayerRepository("org/act", layer_name="SiluAndMul", version=1)}}
    >>> with use_kernel_mapping(mapping, inherit_mapping=False):
    ...     sorted(current_mapping()["SiluAndMul"])
    [<DeviceType.CUDA: 'cuda'>]
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .device import Device, DeviceType
from .mode import REGISTRABLE_MODES, Mode
from .repos import RepositoryProtocol

__all__ = [
    "CapabilityEntry",
    "DeviceRepos",
    "Registry",
    "current_mapping",
    "register_kernel_mapping",
    "use_kernel_mapping",
]

logger = logging.getLogger(__name__)

ModeRepos = Mapping[Mode, RepositoryProtocol]
FULL_RANGE = (0, sys.maxsize)


@dataclass(frozen=True)
class CapabilityEntry:
    """Repositories (per mode) registered for one inclusive capability range."""

    min_capability: int
    max_capability: int
    repos: ModeRepos

    @property
    def unrestricted(self) -> bool:
        return (self.min_capability, self.max_capability) == FULL_RANGE

    def __str__(self) -> str:
        if self.unrestricted:
            return "any capability"
        upper = "max" if self.max_capability == sys.maxsize else self.max_capability
        return f"{self.min_capability}..{upper}"


@dataclass(frozen=True)
class DeviceRepos:
    """Everything registered for one layer on one device type, one entry per capability range.

    Device types without capabilities (and registrations without properties) use the full range.
    """

    entries: tuple[CapabilityEntry, ...] = ()

    def with_entry(self, entry: CapabilityEntry) -> DeviceRepos:
        """A copy with `entry` added; an entry for the same range is replaced."""
        same = (entry.min_capability, entry.max_capability)
        kept = tuple(e for e in self.entries if (e.min_capability, e.max_capability) != same)
        return DeviceRepos((*kept, entry))

    def select(self, capability: int | None) -> ModeRepos | None:
        """The repositories of the smallest range containing `capability`.

        Ties (equal widths) go to the later registration. An unknown capability (`None`) only matches
        registrations without capability properties.

        Example:
            >>> old = CapabilityEntry(75, 89, {Mode.FALLBACK: "old"})
            >>> new = CapabilityEntry(80, 89, {Mode.FALLBACK: "new"})
            >>> repos = DeviceRepos((old, new))
            >>> repos.select(86)[Mode.FALLBACK], repos.select(75)[Mode.FALLBACK]
            ('new', 'old')
        """
        best: tuple[int, int] | None = None
        chosen: ModeRepos | None = None
        for position, entry in enumerate(self.entries):
            if capability is None:
                fits = entry.unrestricted
            else:
                fits = entry.min_capability <= capability <= entry.max_capability
            key = (entry.max_capability - entry.min_capability, -position)
            if fits and (best is None or key < best):
                best, chosen = key, entry.repos
        return chosen


Registry = Mapping[str, Mapping[DeviceType, DeviceRepos]]
_EMPTY: Registry = MappingProxyType({})

_global: Registry = _EMPTY  # replaced, never mutated
_global_lock = threading.Lock()
# Set only inside `use_kernel_mapping`; no default, so unscoped code reads the process-wide mapping.
_scoped: ContextVar[Registry] = ContextVar("kernelize_kernel_mapping")


def current_mapping() -> Registry:
    """The mapping `kernelize` uses here: the innermost `use_kernel_mapping` scope, else the global one."""
    return _scoped.get(_global)


def _entries(mapping: Any) -> list[tuple[str, Device, ModeRepos]]:
    """Validate a user mapping and flatten it to (layer name, device, repositories per mode)."""
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"A kernel mapping must be a dict of layer name -> {{device: repository}}, got {mapping!r}."
        )
    entries = []
    for layer_name, devices in mapping.items():
        if not isinstance(layer_name, str) or not layer_name:
            raise TypeError(f"Kernel mapping keys must be layer names (strings), got {layer_name!r}.")
        if not isinstance(devices, Mapping):
            raise TypeError(
                f"The kernel mapping for `{layer_name}` must map devices to repositories, "
                f"e.g. {{'cuda': LayerRepository(...)}}, got {devices!r}."
            )
        for device_key, value in devices.items():
            device = device_key if isinstance(device_key, Device) else Device(device_key)
            repos = dict(value) if isinstance(value, Mapping) else {Mode.FALLBACK: value}
            for mode, repo in repos.items():
                where = f"The kernel mapping for `{layer_name}` on `{device}`"
                if not isinstance(mode, Mode):
                    raise TypeError(
                        f"{where} has mode key {mode!r}; use kernelize.Mode values, e.g. Mode.INFERENCE."
                    )
                if mode not in REGISTRABLE_MODES:
                    logger.warning("%s registers mode %s, which kernelize never selects.", where, mode)
                if isinstance(repo, type):  # the class has a load() too, but no repo_id or layer_name
                    raise TypeError(
                        f"{where} (mode {mode}) is the class `{repo.__name__}` itself, not a repository; "
                        f'create one, e.g. {repo.__name__}("org/name", layer_name=..., version=1).'
                    )
                if not callable(getattr(repo, "load", None)):
                    raise TypeError(
                        f"{where} (mode {mode}) is {repo!r}, not a repository; use LayerRepository, "
                        "LocalLayerRepository, FuncRepository, ... (anything with a load() method)."
                    )
            entries.append((layer_name, device, MappingProxyType(repos)))
    return entries


def _merge(base: Registry, entries: list[tuple[str, Device, ModeRepos]]) -> Registry:
    merged = dict(base)
    for layer_name, device, repos in entries:
        per_device = dict(merged.get(layer_name, {}))
        props = device.properties
        low, high = FULL_RANGE if props is None else (props.min_capability, props.max_capability)
        per_device[device.type] = per_device.get(device.type, DeviceRepos()).with_entry(
            CapabilityEntry(low, high, repos)
        )
        merged[layer_name] = MappingProxyType(per_device)
    return MappingProxyType(merged)


def register_kernel_mapping(mapping: Mapping[str, Mapping[Any, Any]], inherit_mapping: bool = True) -> None:
    """Register kernels for layer names, for all code that is not inside a `use_kernel_mapping` block.

    Inside a `use_kernel_mapping` block it changes that block's mapping only.

    Args:
        mapping: `{layer_name: {device: repository or {Mode: repository}}}`; a device is a string
            (`"cuda"`, `"metal"`, ...) or a `Device` with capability properties.
        inherit_mapping: `False` drops what was registered before.

    Example:
        >>> from kernelize.layer.repos import LayerRepository
        >>> silu = LayerRepository("org/act", layer_name="Silu", version=1)
        >>> register_kernel_mapping({"SiluAndMul": {"cuda": {Mode.INFERENCE: silu}}})
    """
    global _global
    entries = _entries(mapping)  # validate before changing any state
    scoped = _scoped.get(None)
    if scoped is not None:
        _scoped.set(_merge(scoped if inherit_mapping else _EMPTY, entries))
        return
    with _global_lock:
        _global = _merge(_global if inherit_mapping else _EMPTY, entries)


@contextlib.contextmanager
def use_kernel_mapping(
    mapping: Mapping[str, Mapping[Any, Any]], *, inherit_mapping: bool = True
) -> Iterator[None]:
    """Use `mapping` (on top of the current one, unless `inherit_mapping=False`) inside a `with` block.

    The scope is private to the current thread or asyncio task.

    Example:
        >>> from kernelize.layer.repos import LocalLayerRepository
        >>> with use_kernel_mapping({"SiluAndMul": {"cpu": LocalLayerRepository("/k", layer_name="Silu")}}):
        ...     "SiluAndMul" in current_mapping()
        True
    """
    entries = _entries(mapping)
    token = _scoped.set(_merge(current_mapping() if inherit_mapping else _EMPTY, entries))
    try:
        yield
    finally:
        _scoped.reset(token)
