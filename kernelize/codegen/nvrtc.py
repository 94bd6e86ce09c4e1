"""NVRTC compilation to cubin (cached on disk) and kernel launch through the CUDA driver API.

Both go through ``cuda-python`` (``cuda.bindings.nvrtc`` / ``cuda.bindings.driver``); nothing here is
hand-written ctypes. Compiling needs no GPU: :func:`compile_cubin` works on any machine with the
``cuda`` extra installed (``pip install 'kernelize[cuda]'``). Launching needs the NVIDIA driver;
:func:`driver_error` says once why it is unavailable, and :class:`CubinModule` raises that as a clear
``RuntimeError`` when asked to launch without one.

Example:
    >>> cubin = compile_cubin(src, "kz_k0", "sm_90")  # doctest: +SKIP
    >>> CubinModule(cubin, "kz_k0").launch((4, 1, 1), (256, 1, 1), args)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from functools import cache
from typing import Any

from kernelize.runtime.backend import KernelCompileError
from kernelize.runtime.diskcache import cache_key, get_or_build

logger = logging.getLogger(__name__)

# options every kernel compiles with; no fast-math, so results follow the reference's f32 semantics
NVRTC_OPTIONS = ("-std=c++17",)


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise RuntimeError(
            "the cuda backend needs NVRTC from cuda-python: pip install 'kernelize[cuda]' "
            "(cuda-python, nvidia-cuda-nvrtc, nvidia-cuda-runtime)"
        ) from e
    return nvrtc


def _check(result: Any, what: str) -> None:
    if int(result) != 0:
        raise RuntimeError(f"{what} failed: {result}")


@cache
def nvrtc_version() -> str:
    """``"major.minor"`` of the NVRTC library in use (part of every cubin cache key)."""
    err, major, minor = _nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


@cache
def include_dirs() -> tuple[str, ...]:
    """Folders holding ``cuda_fp16.h`` / ``cuda_bf16.h`` (from the ``nvidia-cuda-runtime`` wheel or a CTK)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return ()
    found = find_nvidia_header_directory("cudart")
    if found is None:
        logger.warning("cuda_fp16.h not found: install nvidia-cuda-runtime (pip) or a CUDA toolkit")
        return ()
    return (str(found),)


def _log(nvrtc: Any, prog: Any) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    buf = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, buf)[0], "nvrtcGetProgramLog")
    return buf.rstrip(b"\x00 ").decode(errors="replace")


def _compile(source: str, name: str, arch: str) -> bytes:
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in NVRTC_OPTIONS)]
        opts += [f"-I{d}".encode() for d in include_dirs()]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(result) != 0:
            raise _CompileFailed(_log(nvrtc, prog))
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class _CompileFailed(Exception):
    pass


def cubin_key(source: str, arch: str) -> str:
    """The disk-cache key of a cubin: source, architecture, NVRTC version and options."""
    return cache_key(_key_parts(source, arch))


def _key_parts(source: str, arch: str) -> tuple[str, ...]:
    return ("cuda-cubin", source, arch, nvrtc_version(), *NVRTC_OPTIONS, *include_dirs())


def compile_cubin(source: str, name: str, arch: str, *, cache: bool = True) -> bytes:
    """Compile CUDA C ``source`` to a cubin for ``arch`` (``"sm_80"``), through the disk cache.

    Raises:
        KernelCompileError: NVRTC rejected the source; the message holds its log and the numbered source.
    """

    def build(path: Any) -> None:
        try:
            path.write_bytes(_compile(source, name, arch))
        except _CompileFailed as e:
            raise KernelCompileError(name, cubin_key(source, arch), str(e), source, "cuda") from None

    if not cache:
        import pathlib
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            p = pathlib.Path(d) / "k.cubin"
            build(p)
            return p.read_bytes()
    return get_or_build(_key_parts(source, arch), build, ".cubin").read_bytes()


# -- driver -------------------------------------------------------------------------------------------------


@cache
def driver_error() -> str | None:
    """Why kernels cannot be launched here (no driver library, no device), or None when they can."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        return f"cuda-python is not installed ({e})"
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # the bindings raise when libcuda.so itself is missing
        return f"{type(e).__name__}: {e}"
    if int(err) != 0:
        return f"cuInit failed: {err}"
    return None


def require_driver() -> None:
    """Raise a clear RuntimeError when kernels cannot be launched on this machine."""
    why = driver_error()
    if why is not None:
        raise RuntimeError(
            f"no CUDA driver: compiled kernels can be inspected but not launched ({why}); "
            "run on a machine with an NVIDIA GPU and driver, or use backend='cpu' / 'reference'"
        )


def device_arch(device_index: int = 0) -> str:
    """``"sm_XY"`` of a visible GPU (through torch, which owns the context)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


class CubinModule:
    """A cubin loaded into torch's CUDA context (lazily, per device) with one kernel function."""

    def __init__(self, cubin: bytes, name: str) -> None:
        self.cubin, self.name = cubin, name
        self._functions: dict[int, Any] = {}

    def _function(self, device_index: int) -> Any:
        fn = self._functions.get(device_index)
        if fn is None:
            import torch
            from cuda.bindings import driver

            torch.cuda.init()
            with torch.cuda.device(device_index):
                torch.cuda.current_stream()  # makes torch's primary context current on this thread
                err, ctx = driver.cuCtxGetCurrent()
                _check(err, "cuCtxGetCurrent")
                if not int(ctx):
                    err, dev = driver.cuDeviceGet(device_index)
                    _check(err, "cuDeviceGet")
                    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
                    _check(err, "cuDevicePrimaryCtxRetain")
                    _check(driver.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
                err, module = driver.cuModuleLoadData(self.cubin)
                _check(err, f"cuModuleLoadData({self.name})")
                err, fn = driver.cuModuleGetFunction(module, self.name.encode())
                _check(err, f"cuModuleGetFunction({self.name})")
            self._functions[device_index] = fn
        return fn

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[tuple[int, type]],
        device_index: int = 0,
    ) -> None:
        """Launch on torch's current stream; ``args``: ``(value, ctypes type)`` per parameter."""
        require_driver()
        import torch
        from cuda.bindings import driver

        fn = self._function(device_index)
        stream = torch.cuda.current_stream(device_index).cuda_stream
        values = tuple(v for v, _ in args)
        types = tuple(t for _, t in args)
        (err,) = driver.cuLaunchKernel(fn, *grid, *block, 0, driver.CUstream(stream), (values, types), 0)
        _check(err, f"cuLaunchKernel({self.name})")


@cache
def sm_count(device_index: int = 0) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


C_INT64 = ctypes.c_int64
C_PTR = ctypes.c_void_p

__all__ = [
    "CubinModule",
    "compile_cubin",
    "cubin_key",
    "device_arch",
    "driver_error",
    "include_dirs",
    "nvrtc_version",
]
