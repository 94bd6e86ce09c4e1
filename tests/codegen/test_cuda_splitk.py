"""The CUDA C few-row (split-K) matmul path: host emulation against the reference, and NVRTC cubins.

Up to FEW_ROWS rows a weight matmul runs as one SPLITK kernel per matmul (partial sums added to a zeroed f32
temporary) and the epilogue as a pointwise kernel; this runs both the way `kernelize.codegen.few_rows`
launches them, with the generated .cu compiled by g++ against the host-emulation header.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from cuda_emu import emulate
from test_cpu_gemv import TOL, inputs_for, linear_graph

from kernelize.autokernel.kernels import KernelKind
from kernelize.autokernel.matmul import epilogue_kernel, splitk_kernel
from kernelize.autokernel.plan import PlanSettings, plan
from kernelize.codegen.cuda import render
from kernelize.codegen.few_rows import retype
from kernelize.ir.dtypes import DType
from kernelize.ir.reference import bind_inputs, evaluate
from kernelize.ir.shapes import bind

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="host emulation needs g++")


def run_few_rows(g, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Emulate the split-K kernels and the epilogue of the graph's one MATMUL kernel (gate and up matmuls
    merged into one kernel: one split-K kernel each, one epilogue)."""
    (k,) = plan(g, PlanSettings(merge_matmuls=True)).kernels
    assert k.kind is KernelKind.MATMUL
    env = bind_inputs(g, inputs)
    sizes = {s: env[s] for s in k.symbols}
    vals = dict(zip(g.inputs, inputs))
    epi, temps = epilogue_kernel(k)
    f32 = [replace(t, dtype=DType.F32) for t in temps]
    dom = bind(k.domain, env)
    for j, t in enumerate(f32):
        sk = splitk_kernel(k, j, t)
        vals[t] = torch.zeros(dom, dtype=torch.float32)
        emulate(sk, [vals[b] for b in sk.reads], [vals[t]], {s: env[s] for s in sk.symbols})
    epi = retype(epi, dict(zip(temps, f32)))
    out = torch.empty(bind(k.writes[0].shape, env), dtype=k.writes[0].dtype.torch)
    emulate(epi, [vals[b] for b in epi.reads], [out], sizes)
    return out


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
@pytest.mark.parametrize("epilogue", ["none", "bias_gelu", "residual", "gated_silu"])
def test_split_k_matches_reference(dtype: DType, epilogue: str) -> None:
    gen = torch.Generator().manual_seed(0)
    g = linear_graph(("m",), 300, 7, dtype, epilogue)  # K = 300: two slices of K, one column block
    for m in (1, 3, 16):
        inputs = inputs_for(g, {"m": m}, gen)
        atol, rtol = TOL[dtype]
        want = evaluate(g, inputs)[0].float()
        torch.testing.assert_close(
            run_few_rows(g, inputs).float(), want, atol=atol, rtol=rtol, msg=f"{m} rows"
        )


def test_row_axes_decompose_and_awkward_sizes() -> None:
    """Two row axes (batch x seq) and K, N that fit no block: 7 columns, K = 1 and 4097."""
    gen = torch.Generator().manual_seed(1)
    for kdim, n in ((1, 7), (4097, 70), (64, 1)):
        g = linear_graph(("b", "s"), kdim, n, DType.F32, "bias")
        inputs = inputs_for(g, {"b": 2, "s": 3}, gen)
        torch.testing.assert_close(run_few_rows(g, inputs), evaluate(g, inputs)[0], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_split_k_compiles_to_cubin_for_sm80_and_sm90(dtype: DType) -> None:
    nvrtc = pytest.importorskip("kernelize.codegen.nvrtc", reason="needs cuda-python")
    pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda backend needs cuda-python")
    (k,) = plan(linear_graph(("m",), 4096, 512, dtype, "bias_gelu")).kernels
    _, temps = epilogue_kernel(k)
    src = render(splitk_kernel(k, 0, replace(temps[0], dtype=DType.F32)))
    assert "atomicAdd" in src.source and src.grid({"m": 1}, 1 << 16)[1] > 1  # K is split for one row
    for arch in ("sm_80", "sm_90"):
        assert nvrtc.compile_cubin(src.source, src.name, arch)[:4] == b"\x7fELF"
