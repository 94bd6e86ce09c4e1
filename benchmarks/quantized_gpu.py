"""Packed-weight linears on a CUDA GPU: ``quant.linear`` (Triton and CUDA C backends) against torch's bf16
``F.linear`` on the float weight, decode (1 row) and prefill rows, kernel time from CUDA-graph replays.

    python benchmarks/quantized_gpu.py [--n 4096 --k 4096 --rows 1 16 512 --out results.json]

Prints one line per (backend, format, rows): microseconds per call and, for decode, the packed bytes read
per second. Needs a GPU (exits with a message otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from kernelize.quant import ops
from kernelize.quant.formats import quantize
from kernelize.quant.gpu import GPU_FORMATS


def graph_us(fn, reps: int = 5, calls: int = 50) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("quantized_gpu: no CUDA GPU here")
    torch.manual_seed(0)
    w = torch.randn(a.n, a.k, device="cuda") / a.k**0.5
    wb = w.bfloat16()
    rows = []
    print(f"{torch.cuda.get_device_name()}  N={a.n} K={a.k}  x bf16")
    for m in a.rows:
        x = torch.randn(m, a.k, device="cuda", dtype=torch.bfloat16)
        t = graph_us(lambda: torch.nn.functional.linear(x, wb))  # noqa: B023
        rows.append({"backend": "torch", "format": "bf16", "rows": m, "us": t, "bytes": wb.numel() * 2})
        for backend in ("triton", "cuda"):
            os.environ["KERNELIZE_CUDA_BACKEND"] = backend
            for fmt in sorted(GPU_FORMATS):
                p = quantize(w, fmt)
                t = graph_us(lambda: ops.linear(x, p))  # noqa: B023
                rows.append({"backend": backend, "format": fmt, "rows": m, "us": t, "bytes": p.nbytes})
    for r in rows:
        gbs = r["bytes"] / r["us"] / 1e3
        head = f"{r['backend']:7s} {r['format']:5s} rows={r['rows']:4d}"
        print(f"{head} {r['us']:9.2f} us  {gbs:7.0f} GB/s of weight")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "n": a.n, "k": a.k, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
