"""bf16 stores through float chunks (``kernelize.codegen.cpu_chunks``): pointwise and row kernels from the
real planner against torch's rounding and the reference executor, with and without AVX512-BF16, over row
lengths around the chunk size and edge values (denormals, NaN, inf, overflow to inf, ties)."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from kernelize.codegen import cpu_build
from kernelize.codegen.cpu_chunks import CHUNK
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph
from kernelize.ir.reference import evaluate
from kernelize.runtime.compiled import compile_graph

LENGTHS = [1, 7, 33, CHUNK, CHUNK + 1, 4097]


def _has_avx512_bf16() -> bool:
    try:
        out = subprocess.run(
            [cpu_build.compiler()[0], "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError, cpu_build.CompilerNotFoundError):
        return False
    return "__AVX512BF16__" in out


@pytest.fixture(params=["native", "no-avx512bf16"])
def flags(request, monkeypatch, tmp_path):
    """The default flags (the chunked path where the CPU has AVX512-BF16) and without AVX512-BF16 (the plain
    path), each with its own kernel cache."""
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path))
    if request.param == "native":
        monkeypatch.delenv("KERNELIZE_CPU_FLAGS", raising=False)
    else:
        monkeypatch.setenv("KERNELIZE_CPU_FLAGS", " ".join([*cpu_build.DEFAULT_FLAGS, "-mno-avx512bf16"]))
    return request.param


def _edge_values(n: int) -> torch.Tensor:
    """Rows of random values with, in some chunks, every kind of value the rounding treats specially."""
    x = torch.randn(3, n) * 10
    special = [
        1e-39,  # f32 denormals: AVX512-BF16 flushes them, the integer path keeps them
        -3e-40,
        1.4e-45,
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        3.4e38,  # rounds to inf in bf16
        1.0 + 2.0**-8,  # a tie: to even (1.0)
        1.0 + 3 * 2.0**-8,  # a tie: to even (1.0 + 2^-6)
    ]
    flat = x.view(-1)
    for i, v in enumerate(special):
        flat[(i * 37) % flat.numel()] = v
    flat[-1] = -1e-39  # the last element: in the plain tail after the chunks
    nan_payloads = [0x7F800001, 0xFFC00001 - 2**32]
    bits = torch.tensor(nan_payloads, dtype=torch.int32).view(torch.float32)
    flat[: min(2, flat.numel())] = bits[: min(2, flat.numel())]
    return x


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, except that a NaN only has to be a NaN (torch makes every NaN 0xffff, the
    kernels keep the sign and top payload bits as quiet NaNs)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), (got, want)


@pytest.mark.parametrize("n", LENGTHS)
def test_pointwise_bf16_stores_round_like_torch(flags, n):
    g = Graph()
    x = g.input("x", ("rows", n), DType.F32)
    g.output(g.cast(x, DType.BF16), g.cast(g.mul(x, g.scalar(0.5, DType.F32)), DType.BF16))
    cg = compile_graph(g, backend="cpu", cache=False)
    assert "kz_st_bf16_row" in cg.kernels[0].source
    xs = _edge_values(n)
    got = cg(xs)
    for a, b in zip(got, [xs.to(torch.bfloat16), (xs * 0.5).to(torch.bfloat16)]):
        _same_bits(a, b)


@pytest.mark.parametrize("n", LENGTHS)
def test_row_kernel_bf16_stores_match_reference(flags, n):
    """add + rmsnorm and layernorm in bf16: row 0 holds NaN and inf (every output of the row NaN but h),
    row 1 denormals (h = x there, stored through the fix-up), row 2 plain values."""
    g = Graph()
    x = g.input("x", ("rows", n), DType.BF16)
    r = g.input("r", ("rows", n), DType.BF16)
    w = g.input("w", (n,), DType.BF16)
    h = g.add(x, r)
    g.output(h, g.rmsnorm(h, w, 1e-6), g.layernorm(x, w, None, 1e-5))
    cg = compile_graph(g, backend="cpu", cache=False)
    assert any("kz_st_bf16_row" in k.source for k in cg.kernels)
    xs, rs = torch.randn(3, n) * 10, torch.randn(3, n)
    xs[0, 0], xs[0, n // 2], xs[0, -1] = math.inf, -math.inf, math.nan
    xs[1, ::2], rs[1] = 1e-39, 0.0
    xs[1, 1::3] = -3e-40
    ins = [xs.to(torch.bfloat16), rs.to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)]
    got, want = cg(*ins), evaluate(g, ins)
    _same_bits(got[0], want[0])  # h is one rounding of the f32 sum in both
    for a, b in zip(got[1:], want[1:]):
        assert torch.isnan(a[0]).all() and torch.isnan(b[0]).all()
        torch.testing.assert_close(a[1:].float(), b[1:].float(), rtol=2e-2, atol=2e-2)


def test_the_chunked_path_runs_where_the_cpu_has_avx512_bf16():
    """Denormals in a chunk make the difference visible: flushed by the instruction, kept by the fix-up."""
    if not _has_avx512_bf16():
        pytest.skip("no AVX512-BF16 here: only the plain path is built")
    g = Graph()
    x = g.input("x", ("rows", 4 * CHUNK), DType.F32)
    g.output(g.cast(x, DType.BF16))
    src = compile_graph(g, backend="cpu", cache=False).kernels[0].source
    assert "#if KZ_BF16_ROWS" in src and "alignas(64) float kz_b0[64];" in src
