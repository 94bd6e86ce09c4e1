"""What each module's hub calls ran (backend, generated kernels), for kernels_ran and kernelize.inspect."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernelize.layer.record import record_choice, recorded_choice

__all__ = ["RAN", "Entry", "KernelRecord", "compiled_ran", "kernels_ran", "note_kernels", "note_ran"]


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
class Entry:
    """A compiled graph for one signature plus what `kernels_ran` reports for it."""

    compiled: Any  # kernelize.runtime.compiled.CompiledGraph
    record: KernelRecord
    n_outputs: int


@dataclass
class _Ran:
    """Per module: the compiled graphs its forward ran (last few) and the inspect record written for them."""

    entries: list[Entry] = dataclasses.field(default_factory=list)
    choice: Any = None


RAN: weakref.WeakKeyDictionary[torch.nn.Module, _Ran] = weakref.WeakKeyDictionary()
_KEEP_ENTRIES = 4  # signatures remembered per module for kernels_ran / inspect


def note_ran(owner: torch.nn.Module, entry: Entry) -> None:
    """Remember what `owner` ran, and add it to the module's `kernelize.inspect` record.

    A forward may run several compiled graphs (rotary: one for q, one for k) and a module sees several
    signatures (prefill and one-token decode): the record lists the kernels of the last few, deduplicated.
    """
    ran = RAN.get(owner)
    choice = recorded_choice(owner)
    if ran is not None and entry in ran.entries and choice is ran.choice:
        return  # the common case: nothing new since the last call
    if ran is None:
        ran = RAN[owner] = _Ran()
    if entry not in ran.entries:
        ran.entries = [*ran.entries[-(_KEEP_ENTRIES - 1) :], entry]
    if choice is not None:
        rec = _merged(ran.entries)
        if (choice.backend, choice.kernels) != (rec.backend, rec.kernels):
            choice = dataclasses.replace(choice, backend=rec.backend, kernels=rec.kernels)
            record_choice(owner, choice)
    ran.choice = choice


_NOTED: dict[KernelRecord, Entry] = {}


def note_kernels(owner: torch.nn.Module, record: KernelRecord) -> None:
    """Record that `owner`'s forward ran kernels compiled outside :func:`run` (the attention kernels of
    :mod:`kernelize.attention`), so :func:`kernels_ran` and ``kernelize.inspect`` list them."""
    entry = _NOTED.get(record)
    if entry is None:
        entry = _NOTED.setdefault(record, Entry(None, record, 1))
    note_ran(owner, entry)


def _merged(entries: Sequence[Entry]) -> KernelRecord:
    kernels = tuple(dict.fromkeys(k for e in entries for k in e.record.kernels))
    backends = dict.fromkeys(e.record.backend for e in entries)
    return KernelRecord("+".join(backends), kernels, "; ".join(e.record.signature for e in entries))


def kernels_ran(module: torch.nn.Module) -> KernelRecord | None:
    """What `module`'s forward ran through hub kernels (its last few signatures), or ``None`` if nothing."""
    ran = RAN.get(module)
    return None if ran is None else _merged(ran.entries)


def compiled_ran(module: torch.nn.Module) -> Any:
    """The CompiledGraph (``.graph``, ``.plan``, ``.kernels``) of `module`'s last hub-kernel call, or None."""
    ran = RAN.get(module)
    return None if ran is None else ran.entries[-1].compiled
