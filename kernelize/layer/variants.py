"""Build variants of a kernel repository: parse their names, keep those this system can load, rank them.

A kernel repository holds one folder per build under `build/`. Arch builds are named
`torch{MAJOR}{MINOR}[-cxx11|-cxx98]-{backend}-{cpu}-{os}` (e.g. `torch213-cxx11-cu128-x86_64-linux`), or
`torch-stable-abi{MAJOR}{MINOR}-...` / `tvm-ffi{MAJOR}{MINOR}-...`. Noarch builds are `torch-{backend}` (e.g.
`torch-cpu`, `torch-cuda`) and `torch-universal`. The acceptance rules and the preference order are those of
Hugging Face `kernels` 0.17.2; ties are broken by name so the choice is deterministic.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kernelize._compat import StrEnum

__all__ = [
    "Backend",
    "Decision",
    "Framework",
    "SystemInfo",
    "Variant",
    "format_decisions",
    "parse_variant",
    "rank_variants",
]

# Backends whose variant names carry a version: name prefix -> backend name. The version is
# "all digits but the last" . "last digit" (cu128 is CUDA 12.8), as in `kernels`.
_VERSIONED_BACKENDS = {"cu": "cuda", "rocm": "rocm", "xpu": "xpu", "cann": "cann"}
_PLAIN_BACKENDS = frozenset({"cpu", "metal", "neuron", "tpu"})
_VERSION_SUFFIX = re.compile(r"(\d+)(\d)")


@dataclass(frozen=True, order=True)
class Backend:
    """A compute backend, as named in build variants (`cu128`, `rocm63`, `cpu`, `metal`, ...)."""

    name: str
    version: tuple[int, int] | None = None

    @property
    def variant_str(self) -> str:
        if self.version is None:
            return self.name
        prefix = "cu" if self.name == "cuda" else self.name
        return f"{prefix}{self.version[0]}{self.version[1]}"

    @staticmethod
    def parse(text: str) -> Backend:
        """Parse a backend as written in a variant name.

        Example:
            >>> Backend.parse("cu128")
            Backend(name='cuda', version=(12, 8))
        """
        if text in _PLAIN_BACKENDS:
            return Backend(text)
        for prefix, name in _VERSIONED_BACKENDS.items():
            if text.startswith(prefix) and (m := _VERSION_SUFFIX.fullmatch(text[len(prefix) :])):
                return Backend(name, (int(m.group(1)), int(m.group(2))))
        raise ValueError(f"unknown backend {text!r}")


class Framework(StrEnum):
    """What a build links against."""

    TORCH = "torch"  # torch213-cxx11-...: exactly that torch minor version (and C++ ABI if tagged)
    TORCH_STABLE_ABI = "torch-stable-abi"  # torch-stable-abi29-...: that torch version or newer
    TVM_FFI = "tvm-ffi"
    NOARCH = "noarch"  # torch-universal, torch-cpu, ...: pure Python


@dataclass(frozen=True)
class Variant:
    """A parsed build variant name."""

    name: str
    framework: Framework
    version: tuple[int, int] | None = None  # of the framework (torch / stable ABI / tvm-ffi)
    cxx11_abi: bool | None = None
    backend: Backend | None = None  # arch builds
    noarch_backend: str | None = None  # noarch builds: "universal", "cpu", "cuda", ...
    cpu: str | None = None
    os: str | None = None


_TORCH = re.compile(r"torch(\d)(\d+)")
_STABLE_ABI = re.compile(r"torch-stable-abi(\d)(\d+)")
_TVM_FFI = re.compile(r"tvm-ffi(\d)(\d+)")


def parse_variant(name: str) -> Variant:
    """Parse a build variant folder name; raises `ValueError` for anything else.

    Example:
        >>> v = parse_variant("torch213-cxx11-cu128-x86_64-linux")
        >>> v.version, v.cxx11_abi, v.backend.variant_str, v.cpu, v.os
        ((2, 13), True, 'cu128', 'x86_64', 'linux')
        >>> parse_variant("torch-universal").noarch_backend
        'universal'
    """
    parts = name.split("-")
    if name.startswith("torch-stable-abi"):
        framework, version_text, arch = Framework.TORCH_STABLE_ABI, "-".join(parts[:3]), parts[3:]
        m, abi = _STABLE_ABI.fullmatch(version_text), None
    elif name.startswith("tvm-ffi"):
        framework, version_text, arch = Framework.TVM_FFI, "-".join(parts[:2]), parts[2:]
        m, abi = _TVM_FFI.fullmatch(version_text), None
    elif parts[0] == "torch":
        if len(parts) < 2:
            raise ValueError(f"invalid build variant {name!r}")
        return Variant(name, Framework.NOARCH, noarch_backend="-".join(parts[1:]))
    elif parts[0].startswith("torch"):
        framework, m = Framework.TORCH, _TORCH.fullmatch(parts[0])
        tagged = len(parts) > 1 and parts[1] in ("cxx11", "cxx98")
        abi = (parts[1] == "cxx11") if tagged else None
        arch = parts[2:] if tagged else parts[1:]
    else:
        raise ValueError(f"unknown framework in build variant {name!r}")
    if m is None or len(arch) != 3:
        raise ValueError(f"invalid build variant {name!r}")
    try:
        backend = Backend.parse(arch[0])
    except ValueError as exc:
        raise ValueError(f"invalid build variant {name!r}: {exc}") from None
    version = (int(m.group(1)), int(m.group(2)))
    return Variant(name, framework, version, abi, backend, cpu=arch[1], os=arch[2])


@dataclass(frozen=True)
class SystemInfo:
    """What this process can load: torch version and ABI, backend, CPU and OS."""

    torch_version: tuple[int, int] | None
    cxx11_abi: bool | None
    backend: Backend
    cpu: str
    os: str
    tvm_ffi_version: tuple[int, int] | None = None
    note: str = ""  # why the backend is not the one torch was built for (a CUDA build with no usable GPU)

    @staticmethod
    def detect(backend: str | None = None) -> SystemInfo:
        """Describe this system; `backend` may force `"cpu"` (or name the backend torch was built for).

        Example:
            >>> SystemInfo.detect("cpu").backend
            Backend(name='cpu', version=None)
        """
        cpu, os_name = platform.machine(), platform.system().lower()
        if os_name == "darwin" and cpu == "arm64":
            cpu = "aarch64"
        elif os_name == "windows" and cpu == "AMD64":
            cpu = "x86_64"
        torch_version, abi, system_backend = None, None, Backend("cpu")
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            torch = None
        if torch is not None:
            major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
            torch_version = (major, minor)
            abi = bool(torch.compiled_with_cxx11_abi()) if os_name == "linux" else None
            system_backend, note = _usable_backend(torch)
        else:
            note = ""
        if backend is not None and backend not in ("cpu", system_backend.name):
            raise ValueError(
                f"Backend {backend!r} is not available; "
                f"this system supports 'cpu' and {system_backend.name!r}."
            )
        chosen = Backend("cpu") if backend == "cpu" else system_backend
        return SystemInfo(torch_version, abi, chosen, cpu, os_name, note=note if backend != "cpu" else "")

    def __str__(self) -> str:
        torch_text = "no torch" if self.torch_version is None else "torch {}.{}".format(*self.torch_version)
        note = f" ({self.note})" if self.note else ""
        return f"{torch_text}, {self.backend.variant_str}{note}, {self.cpu}-{self.os}"


def _usable_backend(torch: Any) -> tuple[Backend, str]:
    """The backend torch was built for, if a device of it is usable here; else CPU, and why.

    Laptops, CI runners and containers often have a CUDA (or ROCm) wheel and no GPU: a build for the GPU
    would import and fail there, so the CPU and universal variants are the ones that fit.
    """
    built = _torch_backend(torch)
    if built.name in ("cuda", "rocm") and not torch.cuda.is_available():
        return Backend("cpu"), f"torch is a {built.variant_str} build, but no GPU is usable: CPU variants"
    return built, ""


def _torch_backend(torch: Any) -> Backend:
    def version_of(text: str) -> tuple[int, int]:
        numbers = [int(x) for x in re.findall(r"\d+", text)[:2]] + [0]
        return numbers[0], numbers[1]

    if torch.version.cuda is not None:
        return Backend("cuda", version_of(torch.version.cuda))
    if torch.version.hip is not None:
        return Backend("rocm", version_of(torch.version.hip))
    if torch.backends.mps.is_available():
        return Backend("metal")
    xpu = getattr(torch.version, "xpu", None)
    if xpu:
        return Backend("xpu", (int(xpu[0:4]), int(xpu[5:6] or 0)))
    return Backend("cpu")


@dataclass(frozen=True)
class Decision:
    """Whether a variant fits this system, and why not."""

    variant: str
    accepted: bool
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.variant}: {'compatible' if self.accepted else self.reason}"


def _fmt(version: tuple[int, int] | None) -> str:
    return "none" if version is None else f"{version[0]}.{version[1]}"


def _rejection(v: Variant, system: SystemInfo) -> str | None:
    """Why `v` cannot run on `system`, or `None` if it can."""
    if v.framework == Framework.NOARCH:
        wanted = "npu" if system.backend.name == "cann" else system.backend.name
        if v.noarch_backend not in (wanted, "universal"):
            return f"backend ({v.noarch_backend}) is neither this system's ({wanted}) nor universal"
        return None
    assert v.backend is not None and v.version is not None
    if v.cpu != system.cpu:
        return f"CPU ({v.cpu}) does not match this system's CPU ({system.cpu})"
    if v.os != system.os:
        return f"OS ({v.os}) does not match this system's OS ({system.os})"
    if v.framework == Framework.TORCH:
        if v.version != system.torch_version:
            return f"built for torch {_fmt(v.version)}, this is torch {_fmt(system.torch_version)}"
        if v.cxx11_abi is not None and v.cxx11_abi != system.cxx11_abi:
            return f"C++11 ABI ({v.cxx11_abi}) does not match torch's ({system.cxx11_abi})"
    elif v.framework == Framework.TORCH_STABLE_ABI:
        if system.torch_version is None or v.version > system.torch_version:
            return f"stable ABI {_fmt(v.version)} is newer than torch {_fmt(system.torch_version)}"
    elif v.framework == Framework.TVM_FFI and v.version != system.tvm_ffi_version:
        return f"built for tvm-ffi {_fmt(v.version)}, installed: {_fmt(system.tvm_ffi_version)}"
    ours = system.backend
    if v.backend.name == "cuda" and ours.name == "cuda":
        # A build for CUDA x.z runs on a CUDA x.y runtime when z <= y.
        assert v.backend.version is not None and ours.version is not None
        if v.backend.version[0] != ours.version[0] or v.backend.version[1] > ours.version[1]:
            return f"CUDA {_fmt(v.backend.version)} does not run on this system's CUDA {_fmt(ours.version)}"
    elif v.backend.variant_str != ours.variant_str:
        return f"backend ({v.backend.variant_str}) does not match this system's ({ours.variant_str})"
    return None


def _preference(v: Variant) -> tuple:
    """Sort key, best first: stable-ABI arch builds (newest ABI), torch arch builds (untagged before
    ABI-tagged), tvm-ffi builds, backend-specific noarch builds, `torch-universal`; within each, the newest
    backend version; then the name, for determinism."""
    if v.framework == Framework.NOARCH:
        return (3, 0, 0, 0, 0, v.noarch_backend == "universal", v.name)
    backend_version = v.backend.version if v.backend and v.backend.version else (0, 0)
    if v.framework == Framework.TORCH_STABLE_ABI:
        rank, abi_order = (0, (-v.version[0], -v.version[1]))
    elif v.framework == Framework.TORCH:
        rank, abi_order = (1, (0, v.cxx11_abi is not None))
    else:
        rank, abi_order = (2, (0, 0))
    return (rank, *abi_order, -backend_version[0], -backend_version[1], False, v.name)


def rank_variants(names: Iterable[str], system: SystemInfo) -> tuple[list[str], list[Decision]]:
    """Return the variants `system` can load, best first, and a decision for every name.

    Names that are not variants (e.g. stray files) are reported as rejected.

    Example:
        >>> system = SystemInfo((2, 13), True, Backend("cpu"), "x86_64", "linux")
        >>> rank_variants(["torch-universal", "torch-cpu", "torch-cuda"], system)[0]
        ['torch-cpu', 'torch-universal']
    """
    parsed: list[Variant] = []
    decisions: list[Decision] = []
    for name in sorted(set(names)):
        try:
            parsed.append(parse_variant(name))
        except ValueError as exc:
            decisions.append(Decision(name, False, str(exc)))
    accepted: list[Variant] = []
    for variant in parsed:
        reason = _rejection(variant, system)
        if reason is None:
            accepted.append(variant)
        else:
            decisions.append(Decision(variant.name, False, reason))
    accepted.sort(key=_preference)
    accepted_names = [v.name for v in accepted]
    decisions = [Decision(name, True) for name in accepted_names] + sorted(decisions, key=lambda d: d.variant)
    return accepted_names, decisions


def format_decisions(decisions: Iterable[Decision]) -> str:
    """One line per variant, for error messages."""
    lines = [f"  - {d}" for d in decisions]
    return "\n".join(lines) if lines else "  (no build variants found)"
