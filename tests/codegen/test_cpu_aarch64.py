"""The generated CPU sources compile for aarch64 (Graviton, Ampere, Apple silicon), as the CUDA C compiles
for sm_80 / sm_90 in test_cuda_nvrtc.py: a cross compiler (``aarch64-linux-gnu-g++``, ``make`` installs it)
builds each kernel's source as the CPU backend renders it, with the flags :func:`cpu_build.platform_flags`
gives an aarch64 host (``-mcpu=native`` means nothing to a cross compiler: ``-march=armv8.2-a`` instead),
plus one unit without OpenMP (Apple clang's flags). The kernels are a pointwise, row (RMSNorm, LayerNorm,
softmax), few-row matmul with its epilogue, convolution (dense, depthwise, chain) and attention kernel, in
f32 and bf16, and together they hold every CPU template. The flag table itself is unit-tested here.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from importlib import resources

import pytest
from test_attention_kernels import _kernel as attention_kernel
from test_block_kernels import graph as block_graph
from test_cpu_conv import _chain_graph as conv_chain_graph
from test_cpu_conv import _graph as conv_graph
from test_cpu_gemv import linear_graph
from test_cpu_pipeline import build as row_graph

from kernelize.autokernel.plan import plan
from kernelize.codegen import cpu, cpu_backend, cpu_build, cpu_gemv, cpu_pool
from kernelize.codegen.template import load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Op
from kernelize.quant import kernels as quant_kernels

CROSS = "aarch64-linux-gnu-g++"
needs_cross = pytest.mark.skipif(
    shutil.which(CROSS) is None,
    reason=f"needs the aarch64 cross compiler {CROSS} on PATH (apt-get install g++-aarch64-linux-gnu)",
)
X86_FLAGS = (  # the flags of every build on x86 before there was a table: they stay exactly these
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-w",
)


# ---- the flag table --------------------------------------------------------------------------------------
def _host(monkeypatch, machine: str, system: str) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(platform, "system", lambda: system)


@pytest.mark.parametrize(
    "machine, system, version, native, openmp",
    [
        (
            "x86_64",
            "Linux",
            "g++ (Debian 12.2.0-14) 12.2.0",
            ("-march=native", "-mprefer-vector-width=512"),
            True,
        ),
        ("AMD64", "Windows", "clang version 18.1.8", ("-march=native", "-mprefer-vector-width=512"), True),
        ("aarch64", "Linux", "g++ (Ubuntu 13.2.0) 13.2.0", ("-mcpu=native",), True),
        ("arm64", "Darwin", "Apple clang version 15.0.0 (clang-1500.3.9.4)", ("-mcpu=native",), False),
        ("arm64", "Darwin", "g++-14 (Homebrew GCC 14.2.0) 14.2.0", ("-mcpu=native",), True),
        (
            "x86_64",
            "Darwin",
            "Apple clang version 14.0.0",
            ("-march=native", "-mprefer-vector-width=512"),
            False,
        ),
        ("riscv64", "Linux", "g++ 13.2.0", (), True),
    ],
)
def test_platform_flags_per_machine_system_and_compiler(
    monkeypatch, machine, system, version, native, openmp
):
    _host(monkeypatch, machine, system)
    got = cpu_build.platform_flags(compiler_version=version)
    assert got == cpu_build.platform_flags(machine, system, version)
    arch = [f for f in got if f.startswith(("-march", "-mcpu", "-mprefer"))]
    assert tuple(arch) == native
    assert ("-fopenmp" in got) is openmp
    rest = [f for f in X86_FLAGS if f not in ("-march=native", "-mprefer-vector-width=512", "-fopenmp")]
    assert [f for f in got if f in rest] == rest  # the rest as on x86, in the same order


def test_x86_linux_flags_are_unchanged(monkeypatch):
    _host(monkeypatch, "x86_64", "Linux")
    assert cpu_build.platform_flags(compiler_version="g++ 12.2.0") == X86_FLAGS
    if platform.machine() == "x86_64" and platform.system() == "Linux":
        assert cpu_build.DEFAULT_FLAGS == X86_FLAGS


def test_flags_follow_the_host_and_compiler_unless_set(monkeypatch):
    monkeypatch.delenv("KERNELIZE_CPU_FLAGS", raising=False)
    monkeypatch.setattr(cpu_build, "compiler", lambda: ("/usr/bin/c++", "Apple clang version 15.0.0"))
    _host(monkeypatch, "arm64", "Darwin")
    assert "-fopenmp" not in cpu_build.flags() and "-mcpu=native" in cpu_build.flags()
    _host(monkeypatch, "aarch64", "Linux")
    assert "-fopenmp" in cpu_build.flags() and "-mprefer-vector-width=512" not in cpu_build.flags()
    monkeypatch.setenv("KERNELIZE_CPU_FLAGS", "-O1 -shared")
    assert cpu_build.flags() == ("-O1", "-shared")


# ---- the cross compile -----------------------------------------------------------------------------------
def aarch64_flags(openmp: bool = True) -> list[str]:
    """An aarch64 Linux host's flags (an Apple clang one's without OpenMP) for the cross compiler: -O2 and
    armv8.2-a (Graviton 2, Ampere Altra, Apple M1) where the host build says -O3 and -mcpu=native."""
    host = ("aarch64", "Linux", "g++") if openmp else ("arm64", "Darwin", "Apple clang version 15.0.0")
    swap = {"-O3": "-O2", "-mcpu=native": "-march=armv8.2-a"}
    return [swap.get(f, f) for f in cpu_build.platform_flags(*host)]


def _planned(g) -> list:
    backend = cpu_backend.CpuBackend()
    return [k for k in plan(g, backend.plan_settings).kernels if backend.generates(k)]


def experts_graph(dtype: DType):
    """A gated SiLU experts layer: 8 experts of intermediate 24 over hidden 40, top-2."""
    g = Graph()
    x = g.input("x", ("tokens", 40), dtype)
    index, weights = g.input("index", ("tokens", 2), "i64"), g.input("weights", ("tokens", 2), "f32")
    up, down = g.input("up", (8, 48, 40), dtype), g.input("down", (8, 40, 24), dtype)
    g.output(g.experts(x, index, weights, up, down, act="silu"))
    return g


def router_graph(dtype: DType):
    """A softmax router over 60 experts, top-8, renormalised, with weights in the logits' dtype, and a
    sigmoid router with a choice bias (the two template branches)."""
    g = Graph()
    x = g.input("x", ("tokens", 60), dtype)
    w, i = g.route(x, 8, renorm="sum", dtype=dtype)
    v, j = g.route(x, 4, g.input("bias", (60,), "f32"), score="sigmoid", scale=2.5)
    g.output(w, i, v, j)
    return g


@functools.cache
def sources() -> dict[str, str]:
    """{name: C++ source} of the representative kernels: each function a kernel compiles to (a matmul: its
    few-row function and its epilogue, as the backend builds them), and the replay template."""
    graphs = {}
    for dt in (DType.F32, DType.BF16):
        d = dt.name.lower()
        graphs[f"block_pre_attention_{d}"] = block_graph("pre_attention", dt.torch)  # rmsnorm, q|k|v, rotary
        graphs[f"block_mlp_{d}"] = block_graph("mlp", dt.torch)  # gate|up matmul + silu * up, down + residual
        graphs[f"layernorm_softmax_{d}"] = row_graph([("layernorm", None), ("softmax", None)], dt, 96)
        graphs[f"pointwise_{d}"] = row_graph(
            [("unary", Op.SIGMOID), ("binary", Op.MUL), ("bias", None)], dt, 40
        )
    # more than FEW_ROWS static rows: only the epilogue after torch's GEMM is built
    graphs["linear_bias_gelu_f16"] = linear_graph((32,), 64, 48, DType.F16, "bias_gelu")
    graphs["conv_dense_residual_swish"] = conv_graph(
        (1, 16, 8, 8), 32, 3, pad=(1, 1, 1, 1), res=True, act="swish"
    )
    graphs["conv_1x1_tanh"] = conv_graph((1, 16, 8, 8), 24, 1, act="tanh")  # scalar epilogue
    graphs["conv_depthwise"] = conv_graph((1, 32, 8, 8), 32, 3, pad=(1, 1, 1, 1), groups=32, act="relu6")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kernelize.autokernel.conv.CHAIN_MIN_BYTES", 0)
        graphs["conv_chain"] = conv_chain_graph(1, 9, 8, 48, 8, 3, 1, residual=True)
        kernels = {name: _planned(g) for name, g in graphs.items()}
    for dt in (DType.F32, DType.BF16):  # the grouped-expert kernel (few-pair path)
        kernels[f"experts_{dt.name.lower()}"] = _planned(experts_graph(dt))
        kernels[f"router_{dt.name.lower()}"] = _planned(router_graph(dt))
    kernels["attention_causal_gqa_f32"] = [attention_kernel(4, 1, 64, 64, DType.F32, causal=True)]
    kernels["attention_bool_mask_bf16"] = [attention_kernel(2, 2, 64, 64, DType.BF16, mask="bool")]
    out = {"replay": load_template("cpu_replay.cpp"), "pool": cpu_pool.source()}
    out["shm_allreduce"] = load_template("cpu_shm_allreduce.cpp")  # kernelize.shm_collective
    out["workers"] = load_template("cpu_workers.cpp")  # the kernels' pool (cpu_build.workers)
    out["gemm"] = cpu_gemv.gemm_source()  # the GEMM tiles' library (cpu_gemv.GeneratedGemm)
    out.update({f"quant_{fmt}": quant_kernels.source(fmt) for fmt in ("q8_0", "q4_0", "int8")})
    for name, ks in kernels.items():
        assert ks, f"{name}: no generated kernel"
        for k in ks:
            k = replace(k, name=f"{name}_{k.name}")  # names unique across graphs: one unit can hold them all
            for part, _ in cpu_backend.kernel_parts(k):
                out[f"{part.name}-{k.kind.name.lower()}"] = cpu.render(part)[0]
    return out


def test_the_kernels_cover_every_kind_and_cpu_template():
    kinds = {name.rpartition("-")[2] for name in sources()}
    assert {"pointwise", "row", "matmul", "conv", "conv_chain", "attention", "experts", "router"} <= kinds
    matmuls = [name for name in sources() if name.endswith("-matmul")]
    assert any(n.endswith("_epilogue-matmul") for n in matmuls)  # the epilogue after torch's GEMM ...
    assert any(not n.endswith("_epilogue-matmul") for n in matmuls)  # ... and the few-row function
    templates = resources.files("kernelize.codegen").joinpath("templates")
    for t in sorted(p.name for p in templates.iterdir() if p.name.startswith("cpu_")):
        piece = max(re.split(r"\$[A-Z][A-Z0-9_]*\$", load_template(t)), key=len)  # its longest literal text
        assert any(piece in src for src in sources().values()), f"no kernel here uses templates/{t}"


def _compile(job: tuple[str, str, list[str]], out_dir) -> str | None:
    """None when the source compiles, else the command and the compiler's log."""
    name, source, opts = job
    path = out_dir / f"{name}.cpp"
    path.write_text(source)
    # --no-undefined: a reference nothing defines fails here, not when the library is loaded
    cmd = [CROSS, *opts, "-Wl,--no-undefined", "-x", "c++", str(path), "-o", str(path.with_suffix(".so"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return None
    log = "\n".join(proc.stderr.splitlines()[:60])
    return f"---- {name}: exit {proc.returncode}\n$ {' '.join(cmd)}\n{log}"


@needs_cross
def test_generated_sources_compile_for_aarch64(tmp_path):
    srcs = sources()
    jobs = [(name, src, aarch64_flags()) for name, src in srcs.items()]
    # one unit of them all without OpenMP, as Apple clang builds them (the prelude's one-thread stand-ins),
    # where <omp.h> does not exist; attention and experts kernels build alone (CpuBackend.compile_many),
    # and each packed-weight format is a library of its own (kernelize.quant.kernels)
    alone = [name for name in srcs if name.endswith(("-attention", "-experts")) or name.startswith("quant_")]
    alone += ["pool", "shm_allreduce"]  # libraries of their own (cpu_pool, kernelize.shm_collective)
    kernels = [src for name, src in srcs.items() if name != "replay" and name not in alone]
    shared = [load_template(t) for t in ("cpu_prelude.h", "cpu_gemv.h", "cpu_conv.h")]
    (tmp_path / "no_openmp").mkdir()
    (tmp_path / "no_openmp" / "omp.h").write_text('#error "no <omp.h>: Apple clang has no OpenMP"\n')
    no_omp = [*aarch64_flags(openmp=False), "-I", str(tmp_path / "no_openmp")]
    jobs.append(("all_kernels_no_openmp", cpu_build.unit_source(kernels, shared), no_omp))
    jobs += [(f"{name}_no_openmp", srcs[name], no_omp) for name in alone]
    assert all("-fopenmp" not in job[2] for job in jobs[len(srcs) :]) and "-fopenmp" in jobs[0][2]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        failed = [log for log in pool.map(lambda job: _compile(job, tmp_path), jobs) if log]
    assert not failed, f"{len(failed)} of {len(jobs)} sources fail to compile for aarch64:\n" + "\n".join(
        failed
    )
    machines = {(tmp_path / f"{name}.so").read_bytes()[18:20] for name, _, _ in jobs}  # ELF e_machine
    assert machines == {b"\xb7\x00"}  # EM_AARCH64
