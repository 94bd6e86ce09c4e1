"""The fused attention kernel alone vs ``torch.nn.functional.scaled_dot_product_attention`` on the CPU.

Both take the same q / k / v ([B, H, L, D], f32 by default) and allocate their output per call. Every
configuration is timed with interleaved repetitions (each repetition times both once) and the medians are
reported with their ratio (> 1: kernelize is faster). Prefill shapes are causal; the decode shape is one
query against a long key cache (no mask, as transformers calls it for a single new token).

Run: ``python benchmarks/attention.py`` (``--quick`` for seq 2048 only, ``--threads N``, ``--dtype bf16``).
Writes ``benchmarks/results/attention.json``. Other benchmarks import :func:`measure` and :data:`CASES`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernelize.attention import scaled_dot_product_attention

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

# (name, batch, query heads, key heads, query length, key length, head dim, causal)
CASES = [
    ("prefill 512", 1, 8, 8, 512, 512, 64, True),
    ("prefill 1024", 1, 8, 8, 1024, 1024, 64, True),
    ("prefill 2048", 1, 8, 8, 2048, 2048, 64, True),
    ("prefill 2048 gqa 4", 1, 8, 2, 2048, 2048, 64, True),
    ("decode 2048", 1, 8, 8, 1, 2048, 64, False),
    ("decode 2048 gqa 4", 1, 8, 2, 1, 2048, 64, False),
]


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def measure(b, hq, hkv, lq, lk, d, causal, dtype=torch.float32, repeats=15, seed=0) -> dict:
    """Median seconds per call of torch's SDPA and kernelize's kernel, measured interleaved."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    gqa = hq != hkv
    impls = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        "kernelize": lambda: scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
    }
    ref = impls["sdpa"]().float()
    err = (impls["kernelize"]().float() - ref).abs().max().item()  # also compiles the kernel
    once = _time(impls["sdpa"], 1)
    reps = max(1, min(200, int(0.05 / max(once, 1e-6))))  # ~50 ms per timing
    times: dict[str, list[float]] = {n: [] for n in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            times[name].append(_time(fn, reps))
    med = {n: statistics.median(ts) for n, ts in times.items()}
    return {**med, "ratio": med["sdpa"] / med["kernelize"], "max_abs_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cases = [c for c in CASES if "2048" in c[0]] if a.quick else CASES
    print(f"attention, {a.dtype}, {a.threads} threads, torch {torch.__version__}; medians of {a.repeats}")
    print(f"{'case':<22} {'sdpa ms':>9} {'kernelize ms':>13} {'ratio':>7} {'max err':>9}")
    rows = []
    for name, *shape in cases:
        r = measure(*shape, dtype=DTYPES[a.dtype], repeats=a.repeats)
        rows.append({"case": name, "shape": shape, **r})
        print(
            f"{name:<22} {r['sdpa'] * 1e3:9.3f} {r['kernelize'] * 1e3:13.3f} {r['ratio']:6.2f}x "
            f"{r['max_abs_err']:9.1e}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "attention.json"
    out.write_text(json.dumps({"dtype": a.dtype, "threads": a.threads, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
