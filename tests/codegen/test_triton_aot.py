"""Every generated Triton kernel of the corpus lowers to PTX and cubin for sm_80 and sm_90 (no GPU needed).

A kernel that only runs in the interpreter is not done: this compiles the real thing with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` (in a child process, since this one
runs Triton in interpreter mode).
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from test_triton import REDUCES, _row_graph
from triton_layers import corpus
from triton_specs import contiguous

from kernelize.autokernel.kernels import (
    Compute,
    Indirect,
    Kernel,
    KernelKind,
    Load,
    PointwiseKernel,
    RowKernel,
    Store,
)
from kernelize.autokernel.plan import plan
from kernelize.codegen import triton as kt
from kernelize.codegen import triton_aot
from kernelize.codegen.triton_base import cache_dir
from kernelize.ir import optimize, trace
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Op
from kernelize.ir.shapes import Sym
from kernelize.runtime.backend import KernelCompileError


def _corpus_kernels() -> list[Kernel]:
    ks: list[Kernel] = []
    for dtype in (torch.float32, torch.bfloat16):
        for _name, module, inputs in corpus(dtype):
            g = optimize(trace(module, *inputs, dynamic_dims={0: "batch"}))
            ks += [k for k in plan(g).kernels if k.kind not in (KernelKind.LIBRARY, KernelKind.CONV)]
    # the loop form of row kernels (symbolic and long rows), and reductions over a non-last axis
    ks += [
        _row_graph(kind, n, DType.F16)[1]
        for kind in ("rmsnorm", "layernorm", "softmax")
        for n in (Sym.of("seq"), 70000)
    ]
    for op in REDUCES:
        g = Graph()
        x = g.input("x", (5, Sym.of("seq"), 3), "f32")
        y = g.reduce(op, x, 1, keepdim=True)
        ks.append(
            RowKernel(
                f"red_{op}",
                (5, 3, Sym.of("seq")),
                (Load(x, (Sym(("seq",), 3), 1, 3)), Compute(op, y.dtype, (0,), (2,))),
                (Store(1, y, (3, 1, 0)),),
                row_rank=1,
            )
        )
    g = Graph()
    table, idx = g.input("table", (100, 16), "bf16"), g.input("idx", ("n",), "i32")
    a = g.input("a", ("n", 16), "i32")
    y = g.gather(table, idx, 0)
    ks.append(
        PointwiseKernel(
            "gather_int_ops",
            (Sym.of("n"), 16),
            (
                Load(idx, (1, 0)),
                Load(table, (0, 1), indirect=(Indirect(0, 16, 100),)),
                Load(a, (16, 1)),
                Compute(Op.MOD, DType.I32, (2, 0)),
                Compute(Op.DIV, DType.I32, (2, 0)),
                Compute(Op.CAST, DType.BF16, (3,)),
                Compute(Op.ADD, DType.BF16, (1, 5)),
                Compute(Op.POW, DType.BF16, (6, 6)),
                Compute(Op.ROUND, DType.BF16, (7,)),
            ),
            (Store(8, y, contiguous(y.shape)),),
        )
    )
    return ks


def test_every_corpus_kernel_compiles_to_cubin_for_sm80_and_sm90():
    kernels = _corpus_kernels()
    assert len(kernels) >= 30
    t0 = time.perf_counter()
    results = triton_aot.compile_ahead_many(kernels, archs=(80, 90))
    elapsed = time.perf_counter() - t0
    for k, per_arch in zip(kernels, results):
        for arch, asm in per_arch.items():
            assert asm["cubin"][:4] == b"\x7fELF", (k.name, arch)
            assert f".target sm_{arch}" in asm["ptx"], (k.name, arch)
            assert f".entry {k.name}" in asm["ptx"] or k.name in asm["ptx"]
    print(f"\n{len(kernels)} kernels x 2 archs compiled ahead of time in {elapsed:.1f} s")


def test_compile_errors_carry_numbered_source(monkeypatch):
    g, k = _row_graph("softmax", 64, DType.F32)
    monkeypatch.setattr(kt, "render", lambda kernel: "import triton\ndef broken(:\n")
    with pytest.raises(KernelCompileError) as err:
        kt.TritonBackend().compile(k)
    assert "   2 | def broken(:" in str(err.value) and "triton kernel k0" in str(err.value)


def test_a_different_module_file_under_the_kernel_name_is_rewritten_not_compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path / "cache"))
    _, k = _row_graph("softmax", 64, DType.F32)
    source = kt.render(k)
    path = cache_dir() / f"{k.name}_{hashlib.sha256(source.encode()).hexdigest()[:16]}.py"
    marker = tmp_path / "marker"
    path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n{source}")  # stale, corrupt or planted
    asm = triton_aot.compile_ahead(k, arch=90)
    assert not marker.exists(), "the compile imported a module file it did not write"
    assert asm["cubin"][:4] == b"\x7fELF" and path.read_text() == source
