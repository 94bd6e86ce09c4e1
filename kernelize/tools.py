"""Implementations of the ``kernelize inspect`` and ``kernelize run`` subcommands (see ``kernelize.cli``).

Example:
    $ kernelize inspect model.onnx --optimize --svg model.svg
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)


def format_op_counts(counts: Counter) -> str:
    """Op counts as an aligned two-column table, most frequent first."""
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    width = max((len(op) for op, _ in rows), default=2)
    lines = [f"{'op':<{width}}  count", f"{'-' * width}  -----"]
    lines += [f"{op:<{width}}  {n:>5}" for op, n in rows]
    lines.append(f"{'total':<{width}}  {sum(counts.values()):>5}")
    return "\n".join(lines)


def inspect_main(args: argparse.Namespace) -> int:
    """``kernelize inspect model.onnx [--optimize] [--svg out.svg] [--kernels --backend B]``.

    Loads the model, prints its graph and op counts, optionally optimizes it first, writes an SVG and
    prints the fusion plan and generated kernels. Returns the process exit code.
    """
    from kernelize.ir import format_graph, graph_to_svg, op_counts, optimize
    from kernelize.ir.onnx_frontend import load_onnx  # lazily: keeps `kernelize --help` fast

    path = Path(args.model)
    if not path.is_file():
        print(f"kernelize inspect: {path}: no such file", file=sys.stderr)
        return 2
    graph = load_onnx(path)
    if args.optimize:
        before = len(graph)
        graph = optimize(graph)
        print(f"# optimized: {before} -> {len(graph)} nodes")
    print(format_graph(graph))
    print()
    print(format_op_counts(op_counts(graph)))
    if args.svg:
        out = graph_to_svg(args.svg, graph, title=path.name)
        print(f"\nwrote {out}")
    if args.kernels:
        from kernelize.runtime import print_kernels

        print()
        print_kernels(graph, args.backend)
    return 0


# run_main below (`kernelize run`) belongs to the runtime's owner.

__all__ = ["format_op_counts", "inspect_main"]


def run_main(args: argparse.Namespace) -> int:
    """``kernelize run model.onnx --backend B [--inputs file.npz] [--repeat N]``.

    Runs the model through ``compile_graph`` with backend ``B`` and prints each output's shape, the largest
    difference from the reference executor, and the time per run. Random inputs bind every symbolic dim
    to 2. Triton on a machine without a GPU runs under its interpreter (``TRITON_INTERPRET=1``).
    """
    import os
    import time

    import torch

    path = Path(args.model)
    if not path.is_file():
        print(f"kernelize run: {path}: no such file", file=sys.stderr)
        return 2
    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        print("# no GPU: running Triton kernels under the interpreter (slow; TRITON_INTERPRET=1)")
    from kernelize.ir import evaluate, optimize
    from kernelize.ir.onnx_frontend import load_onnx
    from kernelize.runtime.compiled import compile_graph, default_device

    graph = load_onnx(path)
    device = default_device(args.backend)
    inputs = _run_inputs(graph, args.inputs)
    if inputs is None:
        return 2
    want = evaluate(graph, inputs)
    cg = compile_graph(graph if args.backend == "reference" else optimize(graph), args.backend, device)
    xs = [t.to(device) for t in inputs]
    got = cg(*xs)  # warm-up: compiles and loads kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
    repeat = max(1, args.repeat)
    t0 = time.perf_counter()
    for _ in range(repeat):
        got = cg(*xs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / repeat
    print(f"model {path.name}: backend {args.backend} on {device}, {_kernel_counts(cg)}")
    _print_differences(graph, got, want)
    print(f"time: {ms:.3f} ms per run ({repeat} runs)")
    if getattr(args, "compare", None) == "onnxruntime":
        return compare_onnxruntime(path, graph, inputs, got, ms, repeat)
    return 0


def _kernel_counts(cg) -> str:
    """What runs, by plan kernel kind: ``"52 conv + 1 row + 1 matmul kernels"`` (convolutions are
    library calls with a prepacked weight; row, pointwise and matmul epilogues are generated)."""
    from collections import Counter

    kinds = Counter(str(k.kind) for k in (cg.plan.kernels if cg.plan is not None else ()))
    if not kinds:
        return f"{len(cg.kernels)} kernels"
    return " + ".join(f"{n} {kind}" for kind, n in kinds.most_common()) + " kernels"


def _run_inputs(graph, npz: str | None):
    """The inputs of ``kernelize run``: from an ``.npz`` file, or random with every symbolic dim 2 (None
    after printing the error when the file lacks an input)."""
    import numpy as np
    import torch

    from kernelize.ir.shapes import bind

    if npz:
        arrays = np.load(npz)
        missing = [i.arg for i in graph.inputs if i.arg not in arrays]
        if missing:
            print(f"kernelize run: {npz} lacks inputs {missing} (has {list(arrays)})", file=sys.stderr)
            return None
        return [torch.from_numpy(np.ascontiguousarray(arrays[i.arg])).to(i.dtype.torch) for i in graph.inputs]
    gen = torch.Generator().manual_seed(0)
    env = {s: 2 for i in graph.inputs for d in i.shape if not isinstance(d, int) for s in d.names}
    return [_random_input(bind(i.shape, env), i.dtype, gen) for i in graph.inputs]


def _print_differences(graph, got, want) -> None:
    import torch

    for node, g, w in zip(graph.outputs, got, want):
        g = g.cpu()
        diff = (
            (g.double() - w.double()).abs().max().item()
            if g.numel() and g.dtype != torch.bool
            else (float((g != w).sum()) if g.numel() else 0.0)
        )
        print(f"output {list(g.shape)} {node.dtype}: max |diff| vs reference = {diff:.3g}")


def compare_onnxruntime(path: Path, graph, inputs, got, kernelize_ms: float, repeat: int) -> int:
    """Run ``path`` with onnxruntime on the same inputs and threads; print its time and the differences.

    Raises:
        RuntimeError: onnxruntime is not installed (the message names the extra that installs it).
    """
    import statistics
    import time

    import torch

    try:
        import onnxruntime as ort
    except ImportError:
        raise RuntimeError(
            "--compare onnxruntime needs the onnxruntime package: pip install 'kernelize[onnx]' "
            "(or pip install onnxruntime)"
        ) from None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feed = {i.arg: t.numpy() for i, t in zip(graph.inputs, inputs)}
    want = sess.run(None, feed)  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    for node, g, w in zip(graph.outputs, got, want):
        g, w = g.cpu().double(), torch.from_numpy(w).double()
        diff = (g - w).abs().max().item() if g.numel() else 0.0
        rel = diff / max(w.abs().max().item(), 1e-30) if g.numel() else 0.0
        what = f"output {list(g.shape)} {node.dtype}"
        print(f"{what}: max |diff| vs onnxruntime = {diff:.3g} (relative {rel:.2g})")
    print(
        f"onnxruntime: {ms:.3f} ms per run (median of {repeat}, {torch.get_num_threads()} threads); "
        f"kernelize / onnxruntime = {kernelize_ms / ms:.2f}"
    )
    return 0


def _random_input(shape: tuple[int, ...], dtype, gen):
    import torch

    if dtype.is_float:
        return torch.randn(shape, generator=gen).to(dtype.torch)
    if dtype.torch == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(0, 8, shape, generator=gen).to(dtype.torch)


__all__ += ["run_main"]
