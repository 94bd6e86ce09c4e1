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
    """``kernelize run model.onnx --backend B [--inputs file.npz] [--dim NAME=SIZE ...] [--repeat N]``.

    Runs the model through ``compile_graph`` with backend ``B`` and prints each output's shape, the largest
    difference from the reference executor, and the median time per run. Every symbolic input dim is
    pinned to a size at load time (:func:`_pinned_dims`), since ops such as a ``Reshape`` to a shape
    computed from the input may need it then. The compiled graph comes through the optimized-graph cache
    (:func:`~kernelize.runtime.graph_cache.load_optimized_onnx`), so a second run of the same model skips
    the optimizer. Triton on a machine without a GPU runs under its interpreter (``TRITON_INTERPRET=1``).
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
    from kernelize.ir import evaluate
    from kernelize.ir.onnx_frontend import load_onnx
    from kernelize.runtime.compiled import compile_graph, default_device
    from kernelize.runtime.graph_cache import load_optimized_onnx

    pins = _pinned_dims(path, getattr(args, "dim", None) or [], args.inputs)
    if pins is None:
        return 2
    graph = load_onnx(path, dynamic_dims=pins)
    device = default_device(args.backend)
    inputs = _run_inputs(graph, args.inputs)
    if inputs is None:
        return 2
    t0 = time.perf_counter()
    want = evaluate(graph, inputs)
    print(f"# reference executor: {time.perf_counter() - t0:.1f} s")
    ready = (
        graph if args.backend == "reference" else load_optimized_onnx(path, dynamic_dims=pins, loaded=graph)
    )
    cg = compile_graph(ready, args.backend, device)
    repeat = max(1, args.repeat)
    got, ms = _timed(cg, [t.to(device) for t in inputs], repeat)
    dims = "".join(f", {k}={v}" for k, v in pins.items())
    print(f"model {path.name}{dims}: backend {args.backend} on {device}, {_kernel_counts(cg)}")
    _print_differences(graph, got, want)
    print(f"time: {ms:.3f} ms per run (median of {repeat}, {torch.get_num_threads()} threads)")
    if getattr(args, "compare", None) == "onnxruntime":
        return compare_onnxruntime(path, graph, inputs, got, ms, repeat)
    return 0


def _timed(cg, xs: list, repeat: int) -> tuple[list, float]:
    """``cg``'s outputs on ``xs`` and its median ms per call over ``repeat`` calls, after a warm-up call
    (which compiles and loads the kernels); a GPU is synchronized around each timed call."""
    import statistics
    import time

    import torch

    sync = torch.cuda.synchronize if any(x.is_cuda for x in xs) else (lambda: None)
    got = cg(*xs)
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = cg(*xs)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return got, statistics.median(times)


def _pinned_dims(path: Path, given: list[str], npz: str | None) -> dict[str, int] | None:
    """A size for every symbolic input dim of the model (``dim_param`` name, or ``input:axis`` for an
    unnamed one): ``--dim NAME=SIZE``, else the size in the ``--inputs`` arrays, else 2, the rule
    ``kernelize.onnx.InferenceSession`` pins with (``pin_dims``). None after printing the error for a
    malformed ``--dim``."""
    import numpy as np
    import onnx

    from kernelize.onnx import pin_dims, symbolic_dims

    pins: dict[str, int] = {}
    for item in given:
        name, _, size = item.partition("=")
        if not name or not size.isdigit():
            print(f"kernelize run: --dim {item!r}: expected NAME=SIZE, e.g. --dim batch=8", file=sys.stderr)
            return None
        pins[name] = int(size)
    arrays = np.load(npz) if npz else {}
    dims = symbolic_dims(onnx.load(str(path), load_external_data=False))
    return pin_dims(dims, {n: arrays[n].shape for n in {d.input for d in dims} if n in arrays}, pins)


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
