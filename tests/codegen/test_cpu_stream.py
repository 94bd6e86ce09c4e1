"""Non-temporal stores of large outputs (``kz_streams`` in cpu_prelude.h,
``kernelize.codegen.cpu_build.NT_BYTES``): pointwise and row kernels from the real planner give the same
bits streamed and not, over row lengths around the chunk size, f32 and bf16, with column sums, and into an
output that is not 64-byte aligned."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from kernelize.codegen import cpu_build
from kernelize.codegen.cpu_chunks import CHUNK
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph
from kernelize.ir.reference import evaluate
from kernelize.runtime.compiled import compile_graph

LENGTHS = [7, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
NEVER = 2**62


@pytest.fixture
def threshold():
    """Sets ``cpu_build.NT_BYTES`` (shared by every loaded kernel library) for a test and restores it. Late
    workers do not count meanwhile: a late one between two calls would run the second on one thread, and
    column sums then add in another order."""
    b = cpu_build
    old, policy, deadline = b.NT_BYTES.value, b.LATE_POLICY.value, b.TEAM_DEADLINE.value
    b.LATE_POLICY.value, b.TEAM_DEADLINE.value = 2, 0

    def set_to(value: int) -> None:
        cpu_build.NT_BYTES.value = value

    yield set_to
    b.NT_BYTES.value, b.LATE_POLICY.value, b.TEAM_DEADLINE.value = old, policy, deadline


def _both_ways(cg, inputs, threshold) -> list[torch.Tensor]:
    threshold(NEVER)
    plain = cg(*inputs)
    threshold(1)
    streamed = cg(*inputs)
    for a, b in zip(streamed, plain):
        assert torch.equal(a.view(-1).view(torch.int8), b.view(-1).view(torch.int8))
    return streamed


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
@pytest.mark.parametrize("n", LENGTHS)
def test_pointwise_streamed_equals_plain_and_reference(threshold, dtype, n):
    g = Graph()
    x = g.input("x", ("rows", n), dtype)
    g.output(g.mul(g.sigmoid(x), x), g.cast(g.add(x, g.scalar(1.0, dtype)), DType.F32))
    cg = compile_graph(g, backend="cpu", cache=False)
    src = cg.kernels[0].source
    moved = dtype.itemsize + 4 + dtype.itemsize  # bytes per element: the two outputs and the input read
    assert "kz_stream_row(" in src and f"kz_streams(kz_outer * kz_inner * {moved})" in src
    xs = [(torch.randn(5, n) * 3).to(dtype.torch)]
    for a, b in zip(_both_ways(cg, xs, threshold), evaluate(g, xs)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
@pytest.mark.parametrize("n", LENGTHS)
def test_row_kernels_streamed_equal_plain_and_reference(threshold, dtype, n):
    """add + rmsnorm (two full outputs) and layernorm with its statistics (per-row outputs, not streamed)."""
    g = Graph()
    x, r = g.input("x", ("rows", n), dtype), g.input("r", ("rows", n), dtype)
    w = g.input("w", (n,), dtype)
    h = g.add(x, r)
    g.output(h, g.rmsnorm(h, w, 1e-6), g.softmax(x))
    cg = compile_graph(g, backend="cpu", cache=False)
    streamed = [k.source for k in cg.kernels if "kz_stream_row(" in k.source]
    assert streamed
    # each streamed chunk prefetches the same chunk of the next row of x and r (not of w: every row reads it)
    for src in streamed:
        per_line = 64 // dtype.itemsize
        want = {f"kz_nx * {n} + kz_ch + {j}, 0, 3);" for j in range(0, CHUNK, per_line)}
        lines = [line.strip() for line in src.splitlines() if "__builtin_prefetch(" in line]
        assert len(lines) == 2 * len(want) and {line.split(" + ", 2)[2] for line in lines} == want, lines
    ins = [torch.randn(shape).to(dtype.torch) for shape in ((9, n), (9, n), (n,))]
    for a, b in zip(_both_ways(cg, ins, threshold), evaluate(g, ins)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)


def test_layernorm_backward_with_column_sums_streams_its_input_gradient(threshold):
    """The generated backward of a layernorm: dx streamed, dweight / dbias as column sums beside it."""
    from kernelize import hub

    n = 3 * CHUNK + 5
    x = torch.randn(33, n, requires_grad=True)
    w, b = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
    seed = torch.randn(33, n)

    def grads():
        return torch.autograd.grad(hub.run(None, _layer_norm, [x], [w, b]), (x, w, b), seed)

    threshold(NEVER)
    plain = grads()
    threshold(1)
    streamed = grads()
    want = torch.autograd.grad(_layer_norm(x, w, b), (x, w, b), seed)
    for s, p, e in zip(streamed, plain, want):
        assert torch.equal(s, p)
        torch.testing.assert_close(s, e, rtol=1e-4, atol=1e-4)


def test_an_output_off_64_byte_alignment_is_stored_plainly(threshold):
    g = Graph()
    x = g.input("x", ("rows", 4 * CHUNK), DType.F32)
    g.output(g.mul(x, g.scalar(2.0, DType.F32)))
    cg = compile_graph(g, backend="cpu", cache=False)
    xs = torch.randn(6, 4 * CHUNK)
    out = torch.zeros(6 * 4 * CHUNK + 1)[1:].view(6, 4 * CHUNK)  # 4 bytes past an aligned start
    threshold(1)
    (got,) = cg.run_into([xs], [out])
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, xs * 2)


def test_one_threshold_for_every_loaded_library(threshold):
    """``NT_BYTES`` is bound into each library: changing it changes what every kernel decides."""
    g = Graph()
    g.output(g.neg(g.input("x", ("rows", 16), DType.F32)))
    compile_graph(g, backend="cpu", cache=False)(torch.randn(2, 16))
    libs = list(cpu_build._LOADED.values())
    asked = [lib.kz_streams_bytes for lib in libs if hasattr(lib, "kz_streams_bytes")]
    assert asked
    for fn in asked:
        fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_int
    threshold(1000)
    # non-temporal row stores exist in AVX-512 builds only (KZ_NT_ROWS); elsewhere nothing ever streams
    streams = int("avx512f" in Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").exists() else 0
    assert [fn(999) for fn in asked] == [0] * len(asked)
    assert [fn(1000) for fn in asked] == [streams] * len(asked)
    threshold(NEVER)
    assert [fn(1 << 40) for fn in asked] == [0] * len(asked)
    assert [fn(0) for fn in asked] == [0] * len(asked)


def test_threshold_from_the_environment(monkeypatch):
    monkeypatch.setenv("KERNELIZE_CPU_NT_BYTES", "off")
    assert cpu_build.stream_threshold() == 2**63 - 1
    monkeypatch.setenv("KERNELIZE_CPU_NT_BYTES", "4096")
    assert cpu_build.stream_threshold() == 4096
    monkeypatch.setenv("KERNELIZE_CPU_NT_BYTES", "lots")
    with pytest.raises(ValueError, match="KERNELIZE_CPU_NT_BYTES='lots'"):
        cpu_build.stream_threshold()
    monkeypatch.delenv("KERNELIZE_CPU_NT_BYTES")
    assert cpu_build.stream_threshold() == cpu_build.last_level_cache() // 2 > 0


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_a_row_kernel_is_asked_about_the_bytes_it_moves_and_widens_16_bit_weights(dtype):
    """rmsnorm(x, w): the threshold is compared with the output written plus x read (w, the same for every
    row, is not counted); a bf16 w is widened to a float row once per thread, an f32 one read as it is."""
    g = Graph()
    x, w = g.input("x", ("rows", 2048), dtype), g.input("w", (2048,), dtype)
    g.output(g.rmsnorm(x, w, 1e-6))
    (kernel,) = compile_graph(g, backend="cpu", cache=False).kernels
    assert f"kz_streams(kz_outer * kz_rowlen * {2 * dtype.itemsize})" in kernel.source
    assert ("alignas(64) float kz_h" in kernel.source) == (dtype is DType.BF16)
