"""Thread scaling on the CPU (issue #34): ONNX models through ``kernelize.onnx.InferenceSession`` and
onnxruntime at 1, 2 and ``os.cpu_count()`` threads, each thread count in a fresh process.

Per thread count both sessions get ``intra_op_num_threads`` = that count (kernelize then runs torch and its
kernels at that count, see docs/runtime.md "Threads"). Each engine runs its rounds back to back after a
warm-up, and a pause between engines lets the other one's spinning workers go idle. Also recorded: whether
kernelize's late-worker fallback fired (regions then run on one thread for 20 ms; by default only while the
cores are oversubscribed) and the load average before and after.

Usage:
    python benchmarks/threads.py --out threads.json
    python benchmarks/threads.py --threads 1 2 4 8 16 --rounds 30 --model resnet50 squeezenet --out t.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(model: str, batch: int, threads: int, rounds: int) -> dict:
    """ms per run of kernelize and onnxruntime on ``model`` at ``threads`` threads (this process)."""
    import onnxruntime as ort
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(HERE))
    from onnx_models import MODELS, example_input, export

    import kernelize.onnx
    from kernelize.codegen import cpu_build

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    path = str(export(model))
    feed = {"x": example_input(MODELS[model][1], batch, seed=1).numpy()}
    sessions = {
        "kernelize": kernelize.onnx.InferenceSession(path, opts, providers=["CPUExecutionProvider"]),
        "onnxruntime": ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]),
    }
    row: dict = {"threads": threads, "load_before": os.getloadavg()[0]}
    for name, sess in sessions.items():
        for _ in range(3):
            sess.run(None, feed)
        cpu_build.TEAM_DEADLINE.value = 0
        time.sleep(0.2)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sess.run(None, feed)
            times.append((time.perf_counter() - t0) * 1e3)
        row[f"{name}_ms"] = statistics.median(times)
        row[f"{name}_min_ms"] = min(times)
        if name == "kernelize":
            row["kernelize_fallback_fired"] = cpu_build.TEAM_DEADLINE.value > 0
    row["load_after"] = os.getloadavg()[0]
    return row


def machine() -> str:
    """The host in words: cores and CPU model (from /proc/cpuinfo where readable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        name = next(
            line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")
        )
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores, {name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, 2, os.cpu_count() or 1}))
    ap.add_argument("--model", nargs="+", default=["resnet50"], help="models of onnx_models.py")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # one thread count, in this process
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model[0], args.batch, args.worker, args.rounds)))
        return
    sys.path.insert(0, str(HERE))
    from onnx_models import export

    models = {}
    for model in args.model:
        export(model)  # once, before the workers read it
        rows = models[model] = []
        for n in args.threads:
            cmd = [sys.executable, __file__, "--worker", str(n), "--model", model]
            cmd += ["--batch", str(args.batch), "--rounds", str(args.rounds), "--out", str(args.out)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"{model} {n:3d} threads: kernelize {r['kernelize_ms']:.2f} ms, onnxruntime"
                f" {r['onnxruntime_ms']:.2f} ms (fallback fired: {r['kernelize_fallback_fired']},"
                f" load {r['load_before']:.1f})",
                flush=True,
            )
    names = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "KERNELIZE_LATE_WORKERS")
    env = {k: os.environ[k] for k in names if k in os.environ}
    data = {"batch": args.batch, "machine": machine(), "env": env, "models": models}
    args.out.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
