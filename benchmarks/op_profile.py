"""Where an ONNX model's time goes: kernelize per step kind against onnxruntime per op, on the CPU.

kernelize runs step by step (``KERNELIZE_REPLAY=0``) and each step's thread CPU time is taken (robust on a
shared machine at one thread; each step also carries ~10-30 us of Python that the replayed run does not
have); steps are grouped by kind, convs by shape class (``1x1``, ``3x3/s2``, ``g3`` groups, ``dw``
depthwise) and by who runs them (``gen``: generated, ``dnnl``: oneDNN). onnxruntime's per-node times come
from its own profiler (``SessionOptions.enable_profiling``; wall time), grouped by op type.

Usage:
    python benchmarks/op_profile.py shufflenet_v1 resnet50 --rounds 5
    python benchmarks/op_profile.py shufflenet_v1 --detail   # every step and every onnxruntime node
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

os.environ["KERNELIZE_REPLAY"] = "0"  # before kernelize is imported: one Python step per kernel

import torch  # noqa: E402
from onnx_models import MODELS, example_input, export, load_kernelize  # noqa: E402

from kernelize.runtime import compiled  # noqa: E402


def step_class(step) -> str:
    """``conv 3x3/s2 g3 gen``, ``pointwise[clamp,concat]``, ``library[pool] lib``..."""
    k = step.kernel
    if step.conv is None:
        ops = ",".join(sorted(str(o) for o in k.ops))
        return f"{k.kind}[{ops}]" + (" lib" if step.library else "")
    co, cig, kh, kw = k.node.src[1].shape
    a = k.node.arg
    shape = (
        f"{kh}x{kw}"
        + (f"/s{a.stride[0]}" if a.stride[0] > 1 else "")
        + (f" g{a.groups}" if a.groups > 1 else "")
    )
    shape = "dw" if cig == 1 and co == a.groups else shape
    who = "gen" if step.conv.generated is not None else ("dnnl-gemm" if step.conv.gemm else "dnnl")
    return f"conv {shape} {who}"


def kernelize_steps(name: str, batch: int, rounds: int) -> tuple[list, dict[int, list[float]]]:
    """The compiled model's steps and each step's thread CPU times (seconds) over ``rounds`` runs."""
    times: dict[int, list[float]] = collections.defaultdict(list)
    run_step = compiled.CompiledGraph._run_step

    def timed(self, i, *args):
        t = time.thread_time()
        run_step(self, i, *args)
        times[i].append(time.thread_time() - t)

    kz = load_kernelize(export(name), batch)
    x = example_input(MODELS[name][1], batch)
    compiled.CompiledGraph._run_step = timed
    try:
        for _ in range(2):
            kz(x)
        times.clear()
        for _ in range(rounds):
            kz(x)
    finally:
        compiled.CompiledGraph._run_step = run_step
    return kz._steps, times


def ort_nodes(name: str, batch: int, rounds: int, threads: int) -> dict[str, tuple[str, str, float]]:
    """onnxruntime's nodes: name -> (op type, input shapes, median seconds) from its profiler."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), name)
    sess = ort.InferenceSession(str(export(name)), opts, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: example_input(MODELS[name][1], batch).numpy()}
    for _ in range(2 + rounds):
        sess.run(None, feed)
    events = json.load(open(sess.end_profiling()))
    runs: dict[str, list] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            runs[e["name"]].append(
                (e["args"].get("op_name"), str(e["args"].get("input_type_shape")), e["dur"])
            )
    return {
        n: (r[0][0], r[0][1], statistics.median(d for *_, d in r[2:] or r) / 1e6) for n, r in runs.items()
    }


def report(name: str, batch: int, rounds: int, threads: int, detail: bool) -> None:
    steps, times = kernelize_steps(name, batch, rounds)
    nodes = ort_nodes(name, batch, rounds, threads)
    kz: dict[str, list[float]] = collections.defaultdict(list)
    for i, ts in times.items():
        kz[step_class(steps[i])].append(statistics.median(ts))
    ort: dict[str, list[float]] = collections.defaultdict(list)
    for op, _, s in nodes.values():
        ort[op].append(s)
    total_kz, total_ort = sum(map(sum, kz.values())), sum(map(sum, ort.values()))
    print(
        f"== {name} batch {batch}, {threads} thread(s): kernelize steps {total_kz * 1e3:.2f} ms "
        f"(thread CPU), onnxruntime nodes {total_ort * 1e3:.2f} ms (wall)"
    )
    for who, table in (("kz ", kz), ("ort", ort)):
        for cls, ts in sorted(table.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {who} {cls:40s} n={len(ts):3d} {sum(ts) * 1e3:8.3f} ms")
    if detail:
        for i in sorted(times):
            node = getattr(steps[i].kernel, "node", None)
            shapes = [tuple(s.shape) for s in node.src] if node is not None else []
            ms = statistics.median(times[i]) * 1e3
            print(f"  kz  step {i:3d} {step_class(steps[i]):32s} {ms:7.3f} {shapes}")
        for op, shapes, s in nodes.values():
            print(f"  ort {op:20s} {s * 1e3:7.3f} {shapes[:100]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--detail", action="store_true", help="every step and every onnxruntime node")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models:
        report(name, args.batch, args.rounds, args.threads, args.detail)


if __name__ == "__main__":
    main()
