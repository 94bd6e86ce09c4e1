"""Building the CPU backend's kernels: compiler discovery and flags, compiling C++ to shared objects through
the disk cache, loading them (binding the values every kernel library shares), and batching kernels into
translation units.

Shared objects go through the disk cache (:mod:`kernelize.runtime.diskcache`), keyed by source, compiler
version, flags and host CPU. Every loaded library is bound to :data:`TEAM_DEADLINE` and :data:`NT_BYTES`
(the thread-team deadline and the non-temporal store threshold, probed from sysfs), so changing one changes
what every kernel decides.

Example:
    >>> lib = load(build_shared_object(source, "kz_exp"))  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from kernelize.autokernel.kernels import Kernel
from kernelize.runtime.backend import KernelCompileError
from kernelize.runtime.diskcache import get_or_build

T = TypeVar("T")

# The flags naming this CPU's instructions, by ``platform.machine()``: ``-march=native`` on x86 (with zmm
# registers for gcc's vector loops), ``-mcpu=native`` on Arm (Linux says aarch64, macOS arm64); an unknown
# machine gets neither (baseline instructions). Arm compilers reject the x86 flags.
NATIVE_FLAGS = {
    "x86_64": ("-march=native", "-mprefer-vector-width=512"),
    "AMD64": ("-march=native", "-mprefer-vector-width=512"),
    "aarch64": ("-mcpu=native",),
    "arm64": ("-mcpu=native",),
}


def platform_flags(
    machine: str | None = None, system: str | None = None, compiler_version: str = ""
) -> tuple[str, ...]:
    """The compiler flags for a host (``platform.machine()`` / ``platform.system()`` unless given) and a
    compiler (its ``--version`` line): :data:`NATIVE_FLAGS`, and ``-fopenmp`` except for Apple clang on
    macOS, which has no OpenMP (kernels then run on the calling thread; cpu_prelude.h stubs the calls).

    Example:
        >>> platform_flags("aarch64", "Linux")[:3]
        ('-O3', '-mcpu=native', '-fopenmp')
    """
    machine = platform.machine() if machine is None else machine
    system = platform.system() if system is None else system
    apple_clang = system == "Darwin" and "Apple clang" in compiler_version
    return (
        "-O3",
        *NATIVE_FLAGS.get(machine, ()),
        *(() if apple_clang else ("-fopenmp",)),
        "-fno-math-errno",
        "-fno-trapping-math",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
    )


DEFAULT_FLAGS = platform_flags()  # this host's, for a compiler with OpenMP


class CompilerNotFoundError(RuntimeError):
    """No C++ compiler was found for the CPU backend."""


# ---- compiler and building ------------------------------------------------------------------------------
@functools.cache
def compiler() -> tuple[str, str]:
    """The C++ compiler (``$KERNELIZE_CXX``, else ``$CXX``, else g++ / c++ / clang++) and its version."""
    names = [os.environ.get("KERNELIZE_CXX"), os.environ.get("CXX"), "g++", "c++", "clang++"]
    for name in filter(None, names):
        path = shutil.which(name)
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
            return path, out.stdout.splitlines()[0] if out.stdout else name
    raise CompilerNotFoundError(
        "the cpu backend needs a C++ compiler with OpenMP and none was found (looked for $KERNELIZE_CXX, "
        "$CXX, g++, c++, clang++); install one (e.g. `apt-get install g++`) or set KERNELIZE_CXX to its path"
    )


@functools.cache
def _host_id() -> str:
    """What -march / -mcpu=native depends on: machine and CPU flags (x86: model name and flags; Arm: Features
    and the CPU's implementer and part), so a cache shared by different hosts stays safe."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name", "Features", "CPU implementer", "CPU part")):
                flags += line
                if line.startswith(("flags", "CPU part")):
                    break
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def flags() -> tuple[str, ...]:
    """Compiler flags: ``$KERNELIZE_CPU_FLAGS`` (shell syntax) or :func:`platform_flags` for this host and
    :func:`compiler`."""
    env = os.environ.get("KERNELIZE_CPU_FLAGS")
    return tuple(shlex.split(env)) if env else platform_flags(compiler_version=compiler()[1])


def macros() -> frozenset[str]:
    """The macros the compiler predefines under :func:`flags` (``__AVX2__``, ``__AVX512F__``...): what the
    templates' ``#if`` see, for Python that must agree with them (the conv packer's panel width)."""
    return _macros(os.environ.get("KERNELIZE_CXX"), os.environ.get("CXX"), flags())


@functools.cache
def _macros(cxx: str | None, cc: str | None, flags: tuple[str, ...]) -> frozenset[str]:
    args = [f for f in flags if f not in ("-shared", "-fPIC")]
    out = subprocess.run(
        [compiler()[0], *args, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True
    )
    if out.returncode:
        raise KernelCompileError("<predefined macros>", "", out.stderr, "", "cpu")
    return frozenset(line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define "))


_LOADED: dict[str, ctypes.CDLL] = {}
_LOCK = threading.Lock()


def build_shared_object(source: str, kernel_name: str = "kernel", idle: bool = False) -> Path:
    """Compile ``source`` to a shared object through the disk cache; returns its path. ``idle``: the
    compiler runs at the lowest CPU priority (``nice 19``), for a library built ahead of need, which then
    takes only the cores the builds a graph waits for leave (``cpu_backend.warm_libraries``)."""
    cxx, version = compiler()
    opts = flags()
    parts = (source, version, " ".join(opts), _host_id())
    nice = shutil.which("nice") if idle else None

    def build(out: Path) -> None:
        cmd = [*([nice, "-n", "19"] if nice else []), cxx, *opts, "-x", "c++", "-", "-o", str(out)]
        proc = subprocess.run(cmd, input=source, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            from kernelize.runtime.diskcache import cache_key

            log = f"$ {' '.join(cmd)}\n{proc.stderr}"
            raise KernelCompileError(kernel_name, cache_key(parts), log, source, "cpu")

    return get_or_build(parts, build, ".so")


# ---- loading: the values every kernel library shares ----------------------------------------------------
# One deadline for every kernel library: after a parallel region whose workers started late (other processes
# hold the cores), regions run on one thread until then (see "thread teams under load" in cpu_prelude.h).
TEAM_DEADLINE = ctypes.c_int64(0)
_LATE_POLICIES = {"auto": 0, "always": 1, "never": 2}


def late_worker_policy() -> int:
    """When a late region sends the kernels to one thread (``$KERNELIZE_LATE_WORKERS``): ``auto`` (default)
    after every late start of a two-thread team, and of a larger team only while more threads are runnable
    than the machine has cores; ``always`` after every late start; ``never``. Measured on a quiet 16-core
    VM, ResNet-50 at 16 threads: 34.9 ms with ``always``, 21.2 ms with ``never``, 16.7 ms with ``auto``."""
    env = os.environ.get("KERNELIZE_LATE_WORKERS", "auto").strip().lower()
    if env not in _LATE_POLICIES:
        raise ValueError(f"KERNELIZE_LATE_WORKERS={env!r}: expected one of {', '.join(_LATE_POLICIES)}")
    return _LATE_POLICIES[env]


# Shared by every kernel library like the deadline (tests set it to 1 to make a late report count).
LATE_POLICY = ctypes.c_int64(late_worker_policy())


def stream_threshold() -> int:
    """Bytes moved (outputs written plus inputs read at full size, :func:`cpu_chunks.moved_bytes`) from which
    a pointwise or row kernel writes its contiguous outputs with non-temporal stores (see "non-temporal
    stores" in cpu_prelude.h): ``$KERNELIZE_CPU_NT_BYTES`` (a byte count, or ``off``), else half the
    last-level cache (from sysfs; 16 MiB when unreadable). Measured on LayerNorm's forward, 2048 x 2048 f32
    (16 MiB out; 32 MiB L3), 2 threads: 1.0 -> 0.8 ms; a small output, which the cache keeps for the next op,
    was slower streamed (2 MiB: 0.25 -> 0.31 ms)."""
    env = os.environ.get("KERNELIZE_CPU_NT_BYTES", "").strip().lower()
    if env == "off":
        return 2**63 - 1
    if env:
        try:
            return max(int(env), 1)
        except ValueError:
            raise ValueError(f"KERNELIZE_CPU_NT_BYTES={env!r}: expected a byte count or `off`") from None
    return last_level_cache() // 2


def last_level_cache() -> int:
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KkMm")
        if digits.isdigit():
            sizes[level] = int(digits) * scale
    return sizes[max(sizes)] if sizes else 32 << 20


# Shared by every kernel library, like the deadline: tests and tools may change it at run time.
NT_BYTES = ctypes.c_int64(stream_threshold())


_WORKER_POLICIES = ("auto", "kernelize", "openmp")


def workers_policy() -> str:
    """Which pool runs kernel regions (``$KERNELIZE_CPU_WORKERS``, docs/runtime.md "Threads"): ``auto``
    (default) kernelize's workers (``templates/cpu_workers.cpp``) while a compiled graph that calls none of
    torch's parallel GEMMs or convs runs, OpenMP's (torch's) otherwise; ``kernelize`` or ``openmp`` always."""
    env = os.environ.get("KERNELIZE_CPU_WORKERS", "auto").strip().lower()
    if env not in _WORKER_POLICIES:
        raise ValueError(f"KERNELIZE_CPU_WORKERS={env!r}: expected one of {', '.join(_WORKER_POLICIES)}")
    return env


# 1 while regions run on kernelize's workers, 0 on OpenMP: shared by every kernel library like the deadline
# (compiled graphs switch it around their runs under `auto`; tests and benchmarks set it)
WORKERS = ctypes.c_int64(int(workers_policy() == "kernelize"))
_WORKERS_LIB: list[ctypes.CDLL] = []
_WORKERS_LOCK = threading.Lock()


_RUN = threading.local()  # .threads: the team size kernels take inside a run on kernelize's workers


def threads() -> int:
    """The team size a kernel call passes: ``torch.get_num_threads()``, or inside :func:`with_workers` (where
    torch runs on one thread) the count torch had when the run began."""
    return getattr(_RUN, "threads", 0) or torch.get_num_threads()


def with_workers(call: Callable[[], T]) -> T:
    """``call()`` with kernel regions on kernelize's workers (the `auto` policy's switch around a compiled
    graph's run that calls no long torch op; under `kernelize` the switch is on already), the switch
    restored after. torch runs on the calling thread
    alone meanwhile, so none of the run's torch ops (a layout copy, a global mean) wakes torch's OpenMP pool,
    whose workers would then spin for milliseconds beside kernelize's (docs/runtime.md "Threads"); kernels
    take the count torch had (:func:`threads`)."""
    if getattr(_RUN, "threads", 0):  # inside a run already
        return call()
    team, switch = torch.get_num_threads(), WORKERS.value
    WORKERS.value, _RUN.threads = 1, team
    if team > 1:
        workers().kz_workers_wake(team)  # a sleeping worker is spinning by the first region (cpu_workers.cpp)
        torch.set_num_threads(1)
    try:
        return call()
    finally:
        WORKERS.value, _RUN.threads = switch, 0
        if team > 1:
            torch.set_num_threads(team)


def openmp_away(threads: int) -> None:
    """Keep the calling thread's OpenMP pool (torch's, a team of ``threads``) off its core before a run whose
    torch ops use that pool (``templates/cpu_workers.cpp``, kz_openmp_away; docs/runtime.md "Threads")."""
    if threads > 1:
        workers().kz_openmp_away(threads)


def workers() -> ctypes.CDLL:
    """The process's one pool of kernel workers (``templates/cpu_workers.cpp``), built and loaded once (a
    backend starts the build in the background with its kernels' units: every unit binds to it)."""
    with _WORKERS_LOCK:
        return _workers()


def _workers() -> ctypes.CDLL:
    if not _WORKERS_LIB:
        from kernelize.codegen.template import load_template

        path = build_shared_object(load_template("cpu_workers.cpp"), "kz_workers")
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
        lib.kz_workers_hold.argtypes, lib.kz_workers_started.restype = [ctypes.c_int], ctypes.c_int
        lib.kz_workers_shares.restype = ctypes.c_int64
        lib.kz_openmp_away.argtypes = lib.kz_workers_wake.argtypes = [ctypes.c_int]
        _WORKERS_LIB.append(lib)
    return _WORKERS_LIB[0]


def load(path: Path) -> ctypes.CDLL:
    with _LOCK:
        lib = _LOADED.get(str(path))
        if lib is None:
            lib = _LOADED[str(path)] = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
            bind = getattr(lib, "kz_bind_workers", None)
            if bind is not None:
                pool = workers()
                address = [
                    ctypes.cast(getattr(pool, f), ctypes.c_void_p)
                    for f in ("kz_workers_region", "kz_workers_wait", "kz_openmp_away")
                ]
                bind.argtypes = [ctypes.c_void_p] * 3 + [ctypes.POINTER(ctypes.c_int64)]
                bind(*address, ctypes.byref(WORKERS))
            binders = (
                ("kz_bind_team_state", TEAM_DEADLINE),
                ("kz_bind_late_policy", LATE_POLICY),
                ("kz_bind_nt_bytes", NT_BYTES),
            )
            for name, value in binders:
                bind = getattr(lib, name, None)
                if bind is not None:
                    bind.argtypes = [ctypes.POINTER(ctypes.c_int64)]
                    bind(ctypes.byref(value))
        return lib


# ---- translation units ----------------------------------------------------------------------------------
_NAME_HOLE = "KZ_SAME_SOURCE_NAME"


def same_source_groups(
    order: Sequence[int], parts: Mapping[int, list[tuple[Kernel, tuple]]], rendered: Mapping[str, tuple]
) -> dict[int, list[int]]:
    """The kernels of ``order`` grouped by their parts' source with each function's own name blanked
    out: ``{first index: [indices]}``, in order. A kernel's name is in its source only as its entry
    point's C name (``kz_<name>``, an epilogue ``kz_<name>_epilogue``), so two kernels of one group are the
    same text up to that name and any one's compiled function serves them all."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i in order:
        key = tuple(_blank_name(*rendered[k.name]) for k, _ in parts[i])
        groups.setdefault(key, []).append(i)
    return {members[0]: members for members in groups.values()}


def _blank_name(src: str, fn: str) -> str:
    """``src`` with the identifier ``fn`` blanked out; ``src`` itself (a group of its own) when ``fn`` also
    appears inside a longer identifier. A split, not a regex: a transformer's sources are ~6 MB."""
    assert _NAME_HOLE not in src
    pieces = src.split(fn)
    for before, after in zip(pieces, pieces[1:]):
        if (before and (before[-1].isalnum() or before[-1] == "_")) or (after and after[0].isalnum()):
            return src
    return _NAME_HOLE.join(pieces)


def unit_chunks(items: Sequence[int], sizes: Sequence[int], most: int = 4) -> list[list[int]]:
    """``items`` split into up to one unit per core (at most ``most``), balanced by source size (largest
    first, each to the smallest unit); each unit keeps the items' order so its source is deterministic."""
    units = max(1, min(os.cpu_count() or 1, len(items), most))
    loads = [0] * units
    chunks: list[list[int]] = [[] for _ in range(units)]
    for pos in sorted(range(len(items)), key=lambda p: -sizes[p]):
        u = loads.index(min(loads))
        loads[u] += sizes[pos]
        chunks[u].append(pos)
    return [[items[p] for p in sorted(c)] for c in chunks if c]


def unit_source(sources: Sequence[str], shared: Sequence[str]) -> str:
    """One translation unit of ``sources``: each shared header once at the top, not in every kernel."""
    head = "".join(text for text in shared if any(text in src for src in sources))
    body = []
    for src in sources:
        for text in shared:
            src = src.replace(text, "")
        body.append(src)
    return head + "\n".join(body)


__all__ = [
    "DEFAULT_FLAGS",
    "LATE_POLICY",
    "NATIVE_FLAGS",
    "NT_BYTES",
    "TEAM_DEADLINE",
    "CompilerNotFoundError",
    "build_shared_object",
    "compiler",
    "flags",
    "last_level_cache",
    "late_worker_policy",
    "load",
    "macros",
    "platform_flags",
    "same_source_groups",
    "stream_threshold",
    "unit_chunks",
    "unit_source",
]
