"""CPU layers: eager PyTorch vs torch.compile (Inductor) vs kernelize's CPU kernels vs the bandwidth floor.

Each layer is plain torch code; kernelize runs it through
``trace -> optimize -> compile_graph(backend="cpu")``.
With 2 threads, every configuration is timed with interleaved repetitions (each repetition times every
implementation once, plus a same-size tensor copy) and the median is reported. The floor is the bytes the
op must move divided by the copy bandwidth measured in the same repetitions. Outputs are allocated per
call, as a caller gets them.

Also measured: cold compile time per kernel (empty cache), warm-cache load in a fresh process, per-call
overhead on a 1x64 input, and what a fresh 64 MiB output costs in page faults.

Run: ``python benchmarks/cpu_layers.py`` (``--quick`` for f32 4096x4096 only). Writes
``benchmarks/results/cpu_layers.json`` and ``cpu_layers.png``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"


# ---- the layers, as a user writes them -------------------------------------------------------------------
def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def add_rmsnorm(x, r, w):
    h = x + r
    return h, rmsnorm(h, w)


def layernorm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def softmax(x):
    return torch.softmax(x, dim=-1)


def rotary_neox(x, cos, sin):
    t, hidden = x.shape
    d = cos.shape[-1]
    xh = x.view(t, hidden // d, d)
    rot = torch.cat((-xh[..., d // 2 :], xh[..., : d // 2]), dim=-1)
    return (xh * cos[:, None, :] + rot * sin[:, None, :]).view(t, hidden)


HEAD = 128


def _inputs(name, rows, cols, dtype):
    x = torch.randn(rows, cols, dtype=dtype)
    vec = lambda: torch.randn(cols, dtype=dtype)  # noqa: E731
    return {
        "RMSNorm": lambda: [x, vec()],
        "add+RMSNorm": lambda: [x, torch.randn(rows, cols, dtype=dtype), vec()],
        "LayerNorm": lambda: [x, vec(), vec()],
        "SiluAndMul": lambda: [x],
        "GeluAndMul": lambda: [x],
        "softmax": lambda: [x],
        "rotary": lambda: [x, torch.randn(rows, HEAD, dtype=dtype), torch.randn(rows, HEAD, dtype=dtype)],
    }[name]()


LAYERS = {
    "RMSNorm": (rmsnorm, 2.0),  # (fn, bytes moved in units of one rows x cols tensor)
    "add+RMSNorm": (add_rmsnorm, 4.0),
    "LayerNorm": (layernorm, 2.0),
    "SiluAndMul": (silu_and_mul, 1.5),
    "GeluAndMul": (gelu_and_mul, 1.5),
    "softmax": (softmax, 2.0),
    "rotary": (rotary_neox, 2.0),
}


def kernelized(fn, inputs, cache=True):
    from kernelize.ir import optimize, trace
    from kernelize.runtime.compiled import compile_graph

    cg = compile_graph(optimize(trace(fn, *inputs)), backend="cpu", cache=cache)

    def run(*xs):
        out = cg(*xs)
        return out[0] if len(out) == 1 else tuple(out)

    run.cg = cg
    return run


def kept_outputs(impl):
    """A caller that still holds the previous output: every call gets freshly allocated (faulted) memory."""
    last = []

    def run(*xs):
        out = impl(*xs)
        last[:] = [out]
        return out

    return run


def kernelized_out(cg, inputs):
    """The graph's single generated kernel launched into caller-owned output buffers (an ``out=`` path):
    what a caller that keeps its output buffers pays, with no page faults for fresh memory."""
    from kernelize.ir.reference import bind_inputs
    from kernelize.ir.shapes import bind

    (step,) = [s for s in cg._steps if s.compiled is not None]
    k, ck = step.kernel, step.compiled
    env = bind_inputs(cg.graph, inputs)
    by_node = {**cg._consts, **dict(zip(cg.graph.inputs, inputs))}
    reads = [by_node[b] for b in k.reads]
    writes = [torch.empty(bind(b.shape, env), dtype=b.dtype.torch) for b in k.writes]
    sizes = {s: env[s] for s in k.symbols}

    def run(*xs):
        ck.launch(reads, writes, sizes)
        return writes[0] if len(writes) == 1 else tuple(writes)

    return run


def _close(a, b, dtype):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    errs = [(x.float().reshape(-1) - y.float().reshape(-1)).abs().max().item() for x, y in zip(a, b)]
    return max(errs, default=0.0), tol


def bench_config(name, rows, cols, dtype, reps):
    fn, units = LAYERS[name]
    inputs = _inputs(name, rows, cols, dtype)
    impls = {
        "eager": fn,
        "torch.compile": torch.compile(fn, dynamic=False),
        "kernelize": kernelized(fn, inputs),
    }
    impls["kernelize out="] = kernelized_out(impls["kernelize"].cg, inputs)
    # its own CompiledGraph (and so its own output pool), holding its previous output
    impls["kernelize fresh"] = kept_outputs(kernelized(fn, inputs, cache=False))
    ref = fn(*inputs)
    for key, impl in impls.items():  # warm up (compiles) and check
        out = impl(*inputs)
        impl(*inputs)
        err, tol = _close(out, ref, dtype)
        if err > tol * 10 * (
            1 + max(r.float().abs().max().item() for r in (ref if isinstance(ref, tuple) else (ref,)))
        ):
            raise AssertionError(f"{name} {key}: max error {err} vs eager")
    src = torch.randn(rows, cols, dtype=dtype)
    dst = torch.empty_like(src)
    times = {k: [] for k in impls}
    copy = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - t0)
        for key, impl in impls.items():
            t0 = time.perf_counter()
            out = impl(*inputs)
            times[key].append(time.perf_counter() - t0)
            del out
    nbytes = rows * cols * src.element_size()
    bw = 2 * nbytes / statistics.median(copy)
    row = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    row["floor"] = units * nbytes / bw * 1e3
    row.update(
        op=name,
        shape=f"{rows}x{cols}",
        dtype=str(dtype).replace("torch.", ""),
        copy_GBps=bw / 1e9,
        kernels=len(impls["kernelize"].cg.kernels),
    )
    return row


# ---- compile, load, overhead, allocation -----------------------------------------------------------------
def _rms_kernel():
    from kernelize.autokernel.plan import plan
    from kernelize.ir import optimize, trace

    g = optimize(trace(rmsnorm, torch.randn(8, 4096), torch.randn(4096)))
    return plan(g).kernels[0]


def compile_and_load_times():
    from kernelize.codegen.cpu_backend import CpuBackend

    kernel = _rms_kernel()
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "KERNELIZE_CACHE_DIR": d}
        os.environ["KERNELIZE_CACHE_DIR"], old = d, os.environ.get("KERNELIZE_CACHE_DIR")
        try:
            t0 = time.perf_counter()
            CpuBackend().compile(kernel)
            cold = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("KERNELIZE_CACHE_DIR")
            else:
                os.environ["KERNELIZE_CACHE_DIR"] = old
        here = str(Path(__file__).resolve().parent)
        code = (
            f"import time, torch, sys; sys.path.insert(0, {here!r})\n"
            "from cpu_layers import _rms_kernel\nfrom kernelize.codegen.cpu_backend import CpuBackend\n"
            "k = _rms_kernel(); t0 = time.perf_counter(); CpuBackend().compile(k)\n"
            "print(time.perf_counter() - t0)"
        )
        warm = [
            float(
                subprocess.run(
                    [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
                ).stdout
            )
            for _ in range(3)
        ]
    return {"cold_compile_ms": cold * 1e3, "warm_load_ms": statistics.median(warm) * 1e3}


def _per_call(f, n=2000):
    for _ in range(100):
        f()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best.append((time.perf_counter() - t0) / n)
    return statistics.median(best) * 1e6


def overhead():
    x, w = torch.randn(1, 64), torch.randn(64)
    k = kernelized(rmsnorm, [x, w])
    ck = k.cg.kernels[0]
    y = torch.empty(1, 64)
    return {
        "eager_us": _per_call(lambda: rmsnorm(x, w)),
        "kernelize_graph_us": _per_call(lambda: k.cg(x, w)),
        "kernelize_launch_us": _per_call(lambda: ck.launch([x, w], [y], {})),
    }


def allocation():
    n = 1 << 24  # 64 MiB of f32
    src = torch.randn(n)
    keep = torch.empty(n)
    libc = ctypes.CDLL(None)

    def fresh():
        torch.empty(n).copy_(src)

    def fresh_huge():
        t = torch.empty(n)
        start = t.data_ptr()
        lo, hi = (start + (1 << 21) - 1) & ~((1 << 21) - 1), (start + 4 * n) & ~((1 << 21) - 1)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 14)
        t.copy_(src)

    res = {}
    for key, f in {
        "reused_ms": lambda: keep.copy_(src),
        "fresh_ms": fresh,
        "fresh_hugepage_ms": fresh_huge,
    }.items():
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        res[key] = statistics.median(ts) * 1e3
    return res


# ---- report ------------------------------------------------------------------------------------------
def table(rows):
    head = (
        f"{'op':<12} {'shape':<10} {'dtype':<9} {'eager':>7} {'compile':>8} {'kernelize':>9} "
        f"{'fresh':>6} {'out=':>6} {'floor':>6} {'vs compile':>10} {'vs floor':>8} {'fresh/floor':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['op']:<12} {r['shape']:<10} {r['dtype']:<9} {r['eager']:7.2f} {r['torch.compile']:8.2f} "
            f"{r['kernelize']:9.2f} {r['kernelize fresh']:6.2f} {r['kernelize out=']:6.2f} {r['floor']:6.2f} "
            f"{r['torch.compile'] / r['kernelize']:9.2f}x {r['kernelize'] / r['floor']:7.2f}x "
            f"{r['kernelize fresh'] / r['floor']:10.2f}x"
        )
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['op']}\n{r['shape']} {r['dtype']}" for r in rows]
    keys = ["eager", "torch.compile", "kernelize", "kernelize out=", "floor"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 5))
    width = 0.16
    for i, k in enumerate(keys):
        ax.bar([j + (i - 2) * width for j in range(len(rows))], [r[k] for r in rows], width, label=k)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("median ms (2 threads)")
    ax.set_title("CPU layers: eager vs torch.compile vs kernelize vs bandwidth floor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="f32 4096x4096 only")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ops", nargs="*", default=list(LAYERS))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (8192, 2048)]
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    rows = []
    for rc in shapes:
        for dt in dtypes:
            for op in args.ops:
                rows.append(bench_config(op, *rc, dt, args.reps))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    extra = {"compile": compile_and_load_times(), "overhead": overhead(), "allocation": allocation()}
    print()
    print(table(rows))
    print()
    for k, v in extra.items():
        print(k, {a: round(b, 2) for a, b in v.items()})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_layers.json").write_text(
        json.dumps({"rows": rows, **extra, "threads": 2, "reps": args.reps}, indent=1)
    )
    plot(rows, RESULTS / "cpu_layers.png")
    print(f"wrote {RESULTS / 'cpu_layers.json'} and {RESULTS / 'cpu_layers.png'}")


if __name__ == "__main__":
    main()
