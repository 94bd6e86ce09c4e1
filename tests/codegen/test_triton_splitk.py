"""The Triton few-row (split-K) matmul path: under the interpreter against the reference, and to cubin."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from test_cpu_gemv import TOL, inputs_for, linear_graph

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.matmul import epilogue_kernel, splitk_kernel
from kernelize.autokernel.plan import plan
from kernelize.codegen import triton as kt
from kernelize.codegen import triton_aot
from kernelize.ir.dtypes import DType
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import bind
from kernelize.runtime.compiled import compile_graph


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
@pytest.mark.parametrize("epilogue", ["bias_gelu", "residual"])
def test_few_rows_split_k_and_tiled_above(dtype, epilogue):
    gen = torch.Generator().manual_seed(0)
    g = linear_graph(("m",), 300, 7, dtype, epilogue)  # K = 300: two slices of K, one column tile
    cg = compile_graph(g, backend="triton", device="cpu", cache=False)
    for m in (1, 3, 17):
        inputs = inputs_for(g, {"m": m}, gen)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(
            cg(*inputs)[0].float(), evaluate(g, inputs)[0].float(), atol=atol, rtol=rtol, msg=f"{m} rows"
        )


def test_launch_splits_k_when_columns_are_few():
    g = linear_graph(("m",), 4097, 7, DType.F32, "none")
    (k,) = plan(g).kernels
    _, temps = epilogue_kernel(k)
    sk = splitk_kernel(k, 0, temps[0])  # an f32 graph: the temporary is f32 already
    grid, meta = kt.launch_config(sk, {"m": 1})
    assert grid[0] == 1 and grid[1] > 1 and grid[1] * meta["KSPLIT"] >= 4097
    assert bind((sk.body[0].arg,), {})[0] == 4097
    gen = torch.Generator().manual_seed(1)
    inputs = inputs_for(g, {"m": 2}, gen)
    cg = compile_graph(g, backend="triton", device="cpu", cache=False)
    torch.testing.assert_close(cg(*inputs)[0], evaluate(g, inputs)[0], atol=1e-4, rtol=1e-4)


def test_split_k_kernels_compile_to_cubin_for_sm80_and_sm90():
    kernels = []
    for dtype in (DType.F32, DType.BF16):
        (k,) = plan(linear_graph(("m",), 4096, 512, dtype, "bias_gelu")).kernels
        _, temps = epilogue_kernel(k)
        kernels.append(splitk_kernel(k, 0, replace(temps[0], dtype=DType.F32)))
        assert kernels[-1].kind is KernelKind.SPLITK
    for asm in triton_aot.compile_ahead_many(kernels, archs=(80, 90), sizes={"m": 1}):
        for arch in (80, 90):
            assert asm[arch]["cubin"][:4] == b"\x7fELF"
            assert f".target sm_{arch}" in asm[arch]["ptx"]
            ptx = asm[arch]["ptx"]
            assert re.search(r"\b(atom|red)\.[a-z.]*add\.f32", ptx)  # partial sums added in place
            assert "tf32" not in ptx  # f32 products stay exact
