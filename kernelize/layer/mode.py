"""Kernelize modes and the order in which registered modes are tried.

A mapping can register a different repository per mode; `kernelize` asks for one mode and walks the
fallback chain below until it finds a registered one. The chain is data, not code, so it reads exactly as
the documentation states it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Flag
from types import MappingProxyType
from typing import TypeVar

__all__ = ["MODE_FALLBACK_ORDER", "REGISTRABLE_MODES", "Mode", "check_kernelize_mode", "select_repository"]

_T = TypeVar("_T")


class Mode(Flag):
    """What a kernelized model will be used for.

    `INFERENCE` and `TRAINING` exclude each other; either can be combined with `TORCH_COMPILE`.
    `FALLBACK` is only used as a key in kernel mappings: the repository used when no other mode matches
    (a repository registered without a mode dict is registered as `FALLBACK`).

    Example:
        >>> str(Mode.INFERENCE | Mode.TORCH_COMPILE)
        'INFERENCE | TORCH_COMPILE'
        >>> Mode.INFERENCE | Mode.TRAINING
        Traceback (most recent call last):
        ...
        ValueError: Mode.INFERENCE and Mode.TRAINING are mutually exclusive.
    """

    # Same values as Hugging Face `kernels`, so dumps and pickles read the same.
    FALLBACK = 1
    TRAINING = 2
    INFERENCE = 4
    TORCH_COMPILE = 8

    def __or__(self, other: object) -> Mode:
        union = super().__or__(other)
        if union is NotImplemented:
            return union
        if Mode.INFERENCE in union and Mode.TRAINING in union:
            raise ValueError("Mode.INFERENCE and Mode.TRAINING are mutually exclusive.")
        if Mode.FALLBACK in union and union != Mode.FALLBACK:
            raise ValueError("Mode.FALLBACK cannot be combined with other modes.")
        return union

    __ror__ = __or__

    def __str__(self) -> str:
        return " | ".join(member.name for member in Mode if member in self and member.name) or "NONE"


# For each mode kernelize can be asked for: the registered modes to try, best first. A kernel registered for
# TRAINING also serves INFERENCE (it has a backward it does not need), never the other way around; a kernel
# registered for TORCH_COMPILE also serves eager use, never the other way around.
MODE_FALLBACK_ORDER: Mapping[Mode, tuple[Mode, ...]] = MappingProxyType(
    {
        Mode.INFERENCE: (
            Mode.INFERENCE,
            Mode.INFERENCE | Mode.TORCH_COMPILE,
            Mode.TRAINING,
            Mode.TRAINING | Mode.TORCH_COMPILE,
            Mode.FALLBACK,
        ),
        Mode.INFERENCE | Mode.TORCH_COMPILE: (
            Mode.INFERENCE | Mode.TORCH_COMPILE,
            Mode.TRAINING | Mode.TORCH_COMPILE,
            Mode.FALLBACK,
        ),
        Mode.TRAINING: (
            Mode.TRAINING,
            Mode.TRAINING | Mode.TORCH_COMPILE,
            Mode.FALLBACK,
        ),
        Mode.TRAINING | Mode.TORCH_COMPILE: (
            Mode.TRAINING | Mode.TORCH_COMPILE,
            Mode.FALLBACK,
        ),
    }
)

# Modes a mapping may register a repository for; any other key can never be selected.
REGISTRABLE_MODES: frozenset[Mode] = frozenset(MODE_FALLBACK_ORDER) | {Mode.FALLBACK}


def check_kernelize_mode(mode: object) -> Mode:
    """Return `mode` if `kernelize` can be asked for it, else raise naming the valid modes.

    Example:
        >>> str(check_kernelize_mode(Mode.TRAINING | Mode.TORCH_COMPILE))
        'TRAINING | TORCH_COMPILE'
    """
    if not isinstance(mode, Mode):
        raise TypeError(
            f"kernelize: `mode` must be a kernelize.Mode, got {mode!r}; e.g. mode=Mode.INFERENCE."
        )
    if mode == Mode.FALLBACK:
        raise ValueError("kernelize: Mode.FALLBACK can only be used to register kernel mappings.")
    if mode not in MODE_FALLBACK_ORDER:
        raise ValueError(
            f"kernelize: mode {mode} must contain Mode.INFERENCE or Mode.TRAINING "
            "(optionally combined with Mode.TORCH_COMPILE)."
        )
    return mode


def select_repository(repositories: Mapping[Mode, _T], mode: Mode) -> tuple[_T, Mode] | None:
    """Pick the repository registered for `mode`, following `MODE_FALLBACK_ORDER`.

    Returns the repository and the mode it was registered for, or `None` if no mode in the chain is
    registered.

    Example:
        >>> select_repository({Mode.TRAINING: "train", Mode.FALLBACK: "any"}, Mode.INFERENCE)
        ('train', <Mode.TRAINING: 2>)
        >>> select_repository({Mode.INFERENCE: "infer"}, Mode.TRAINING) is None
        True
    """
    for candidate in MODE_FALLBACK_ORDER[check_kernelize_mode(mode)]:
        if candidate in repositories:
            return repositories[candidate], candidate
    return None
