"""Ahead-of-time compilation of generated Triton kernels for NVIDIA GPUs, without a GPU.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))`` lowers a
kernel to PTX and cubin. Constexprs take the values a launch would pick; symbolic sizes are ``i32``.

Example:
    >>> asm = compile_ahead(kernel, arch=90)  # doctest: +SKIP
    >>> asm["cubin"][:4], ".target sm_90" in asm["ptx"]  # doctest: +SKIP
    (b'\\x7fELF', True)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kernelize.autokernel.kernels import Kernel
from kernelize.codegen.render import gathers
from kernelize.codegen.triton import KernelSource, launch_config, render
from kernelize.codegen.triton_base import SIG, interpreting, load_module, module_file
from kernelize.runtime.backend import CompiledKernel, KernelCompileError

if TYPE_CHECKING:
    import torch


def _aot_job(kernel: Kernel, arch: int, sizes: Mapping[str, int] | None) -> dict:
    """What ``triton.compile`` needs for one kernel: module path, function name, signature, constexprs."""
    source = render(kernel)
    path = module_file(source, kernel.name)  # checked folder, exact content: never a stale or planted file
    sizes = dict(sizes or {s: 64 for s in kernel.symbols})
    _, meta = launch_config(kernel, sizes)
    num_warps = meta.pop("num_warps")
    sig = {KernelSource(kernel).ptr[b]: "*" + SIG[b.dtype] for b in kernel.reads}
    sig.update({f"out{i}_ptr": "*" + SIG[b.dtype] for i, b in enumerate(kernel.writes)})
    sig.update({f"s_{s}": "i32" for s in kernel.symbols})
    if gathers(kernel):
        sig["kz_err_ptr"] = "*i32"
    consts = {**meta, "IDX64": False}
    if "UPCAST" in consts:
        consts["UPCAST"] = False  # the GPU path, whatever this process runs
    sig.update({c: "constexpr" for c in consts})
    return {
        "path": str(path),
        "name": kernel.name,
        "signature": sig,
        "constexprs": consts,
        "arch": arch,
        "num_warps": num_warps,
        "source": source,
    }


def _aot_compile(job: dict) -> dict:
    """Compile one job in this process (Triton must not be in interpreter mode here)."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    fn = getattr(load_module(Path(job["path"]).read_text(), job["name"], interpret=False), job["name"])
    src = ASTSource(fn, job["signature"], constexprs=job["constexprs"])
    compiled = triton.compile(
        src, target=GPUTarget("cuda", job["arch"], 32), options={"num_warps": job["num_warps"]}
    )
    return {"ptx": compiled.asm["ptx"], "cubin": compiled.asm["cubin"], "seconds": time.perf_counter() - t0}


def _aot_worker() -> None:
    """Subprocess entry: JSON jobs on stdin, JSON results on stdout (cubin as hex)."""
    import json

    out = []
    for job in json.load(sys.stdin):
        try:
            r = _aot_compile(job)
            out.append({"ptx": r["ptx"], "cubin": r["cubin"].hex(), "seconds": r["seconds"]})
        except Exception as e:  # reported per kernel by the parent, with the source
            out.append({"error": f"{type(e).__name__}: {e}"})
    sys.stdout.write(json.dumps(out))


def compile_ahead_many(
    kernels: Sequence[Kernel | CompiledKernel],
    archs: Sequence[int] = (80, 90),
    sizes: Mapping[str, int] | None = None,
) -> list[dict[int, dict]]:
    """Compile kernels for NVIDIA GPUs without one: per kernel, ``{arch: {"ptx", "cubin", "seconds"}}``.

    Triton's own library functions are bound to the interpreter when ``TRITON_INTERPRET`` was set at import,
    so under the interpreter the compilation runs in one child process with it unset.

    Raises:
        KernelCompileError: a kernel did not lower to PTX / cubin (with its numbered source).

    Example:
        >>> (asm,) = compile_ahead_many([kernel], archs=(90,))  # doctest: +SKIP
        >>> asm[90]["cubin"][:4]  # doctest: +SKIP
        b'\\x7fELF'
    """
    ks = [k.kernel if isinstance(k, CompiledKernel) else k for k in kernels]
    jobs = [_aot_job(k, arch, sizes) for k in ks for arch in archs]
    results = run_jobs(jobs)
    out: list[dict[int, dict]] = [{} for _ in ks]
    for n, (job, r) in enumerate(zip(jobs, results)):
        out[n // len(archs)][job["arch"]] = r
    return out


def run_jobs(jobs: Sequence[dict]) -> list[dict]:
    """Compile ``triton.compile`` jobs (in a child process under the interpreter); raise on the first error.

    Raises:
        KernelCompileError: a kernel did not lower to PTX / cubin (with its numbered source).
    """
    import json
    import subprocess

    if not interpreting():
        results = []
        for job in jobs:
            try:
                results.append(_aot_compile(job))
            except Exception as e:
                results.append({"error": f"{type(e).__name__}: {e}"})
    else:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-c", "from kernelize.codegen.triton_aot import _aot_worker; _aot_worker()"]
        payload = json.dumps([{k: v for k, v in j.items() if k != "source"} for j in jobs])
        proc = subprocess.run(cmd, input=payload, capture_output=True, text=True, env=env, check=False)
        if proc.returncode:
            raise RuntimeError(f"Triton ahead-of-time compile process failed:\n{proc.stderr[-4000:]}")
        results = json.loads(proc.stdout)
        for r in results:
            if "cubin" in r:
                r["cubin"] = bytes.fromhex(r["cubin"])
    for job, r in zip(jobs, results):
        if "error" in r:
            source = job.get("source") or Path(job["path"]).read_text()
            raise KernelCompileError(job["name"], f"sm_{job['arch']}", r["error"], source, "triton")
    return results


def compile_ahead(
    kernel: Kernel | CompiledKernel, arch: int = 90, sizes: Mapping[str, int] | None = None
) -> dict:
    """Compile one kernel for ``sm_<arch>``: ``{"ptx": str, "cubin": bytes, "seconds": float}``.

    Constexprs take the values a launch with ``sizes`` (default: 64 for every symbol) would pick.

    Example:
        >>> compile_ahead(kernel, arch=80)["cubin"][:4]  # doctest: +SKIP
        b'\\x7fELF'
    """
    return compile_ahead_many([kernel], (arch,), sizes)[0][arch]


def compile_attention_ahead(kernel: Kernel, archs: Sequence[int] = (80, 90), nsplit: int = 1) -> list[dict]:
    """PTX and cubin of an ``ATTENTION`` kernel (and its split combine kernel when ``nsplit > 1``), one
    result per (function, arch) in the order of :func:`kernelize.codegen.triton_attention.aot_jobs`."""
    from kernelize.codegen.triton_attention import aot_jobs, render_attention

    path = module_file(render_attention(kernel), kernel.name)  # checked folder, exact content
    jobs = [j for arch in archs for j in aot_jobs(kernel, arch, str(path), nsplit)]
    return [{**r, "name": j["name"], "arch": j["arch"]} for j, r in zip(jobs, run_jobs(jobs))]


def compile_experts_ahead(kernel: Kernel, archs: Sequence[int] = (80, 90), bm: int = 16) -> list[dict]:
    """PTX and cubin of an ``EXPERTS`` kernel's two grouped GEMMs (``<name>_up``, ``<name>_down``) at ``BM =
    bm`` rows per block, one result per (function, arch) in the order of
    :func:`kernelize.codegen.triton_experts.aot_jobs`."""
    from kernelize.codegen.triton_experts import aot_jobs, render_experts

    path = module_file(render_experts(kernel), kernel.name)  # checked folder, exact content
    jobs = [j for arch in archs for j in aot_jobs(kernel, arch, str(path), bm)]
    return [{**r, "name": j["name"], "arch": j["arch"]} for j, r in zip(jobs, run_jobs(jobs))]


def compile_quant_ahead(fmt: str, dtype: torch.dtype, archs: Sequence[int] = (80, 90)) -> list[dict]:
    """PTX and cubin of the packed-weight matmul of format ``fmt`` for x of ``dtype`` (``<name>_gemv`` at one
    row, ``<name>_dot`` at prefill tiles), one result per (function, arch) in the order of
    :func:`kernelize.codegen.triton_quant.aot_jobs`."""
    from kernelize.codegen.triton_quant import aot_jobs, kernel_name, render_quant

    path = module_file(render_quant(fmt, dtype), kernel_name(fmt, dtype))  # checked folder, exact content
    jobs = [j for arch in archs for j in aot_jobs(fmt, dtype, arch, str(path))]
    return [{**r, "name": j["name"], "arch": j["arch"]} for j, r in zip(jobs, run_jobs(jobs))]


__all__ = [
    "compile_ahead",
    "compile_ahead_many",
    "compile_attention_ahead",
    "compile_experts_ahead",
    "compile_quant_ahead",
    "run_jobs",
]
