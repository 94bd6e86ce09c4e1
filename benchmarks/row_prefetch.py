"""The next-row prefetch of streamed CPU row kernels, A/B: each training kernel with and without it.

For each layer and dtype (2048 x 2048) the training forward and backward graphs are built as a hub layer
builds them (``kernelize.hub_autograd.training_graphs``); each generated row kernel is compiled twice, as
generated and with ``cpu_row._next_row_prefetch`` returning nothing, and both run on the same tensors with
a 64 MiB write between calls (so every call starts with cold caches, as in a training step where other ops
ran in between), 2 threads, in alternation; medians. A ``copy_`` of each kernel's bytes (its reads and
writes) gives the memory floor.

Usage:
    python benchmarks/row_prefetch.py             # RMSNorm, add+RMSNorm, LayerNorm, softmax; f32 and bf16
    python benchmarks/row_prefetch.py --reps 50 --layers RMSNorm LayerNorm --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_layers import LAYERS, _inputs  # noqa: E402

from kernelize import hub_autograd  # noqa: E402
from kernelize.autokernel.kernels import KernelKind  # noqa: E402
from kernelize.codegen import cpu_row  # noqa: E402
from kernelize.codegen.cpu_backend import CpuBackend  # noqa: E402
from kernelize.hub.signatures import entry_for  # noqa: E402
from kernelize.ir.shapes import bind  # noqa: E402

ACTIVATIONS = {"RMSNorm": 1, "add+RMSNorm": 2, "LayerNorm": 1, "softmax": 1}
ROWS = COLS = 2048


def row_kernels(name: str, dtype: torch.dtype) -> list[tuple[str, object]]:
    """The generated ROW kernels of ``name``'s training forward and backward, as ``(label, kernel)``."""
    fn, _ = LAYERS[name]
    tensors = _inputs(name, ROWS, COLS, dtype)
    entry = entry_for(fn, tensors, ACTIVATIONS[name], {}, "cpu")
    pair = hub_autograd.training_graphs(entry.compiled, range(len(tensors)))  # every input trained
    out = []
    for part, graph in (("forward", pair.forward), ("backward", pair.backward)):
        rows = [c.kernel for c in graph.kernels if c.kernel.kind is KernelKind.ROW]
        out += [(f"{part} {k.name}", k) for k in rows]
    return out


def bench_kernel(kernel, reps: int) -> dict[str, float]:
    """Median ms of the kernel as generated, without the prefetch, and of a copy of its bytes."""
    with_pf = CpuBackend().compile(kernel)
    with mock.patch.object(cpu_row, "_next_row_prefetch", lambda w, split: []):
        without = CpuBackend().compile(kernel)
    assert "__builtin_prefetch" in with_pf.source and "__builtin_prefetch" not in without.source
    env = {s: ROWS for s in kernel.symbols}
    reads = [torch.randn(bind(b.shape, env)).to(b.dtype.torch) for b in kernel.reads]
    writes = [torch.empty(bind(b.shape, env), dtype=b.dtype.torch) for b in kernel.writes]
    nbytes = sum(t.numel() * t.element_size() for t in (*reads, *writes))
    src, dst = torch.empty(nbytes // 2, dtype=torch.uint8), torch.empty(nbytes // 2, dtype=torch.uint8)
    runs = {
        "prefetch": lambda: with_pf.launch(reads, writes, env),
        "no prefetch": lambda: without.launch(reads, writes, env),
        "copy": lambda: dst.copy_(src),
    }
    return cold_medians(runs, reps)


def cold_medians(runs: dict, reps: int) -> dict[str, float]:
    """Median ms of each callable in ``runs``, called in alternation, each call after a 64 MiB write (twice
    the last-level cache here: every call starts with cold caches)."""
    evict = torch.ones(16 << 20)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, f in runs.items():
            evict.add_(1.0)
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=120)
    ap.add_argument("--layers", nargs="+", default=list(ACTIVATIONS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    print("| layer | dtype | kernel | no prefetch ms | prefetch ms | change | copy of its bytes ms |")
    print("|---|---|---|---|---|---|---|")
    for name in args.layers:
        for dtype_name in args.dtypes:
            for label, kernel in row_kernels(name, getattr(torch, dtype_name)):
                m = bench_kernel(kernel, args.reps)
                change = (m["prefetch"] / m["no prefetch"] - 1) * 100
                print(
                    f"| {name} | {dtype_name} | {label} | {m['no prefetch']:.3f} | {m['prefetch']:.3f} | "
                    f"{change:+.0f}% | {m['copy']:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
