"""`python -m kernelize demo`: kernelize a small Llama-style decoder on the CPU with the bundled hub.

Steps: build :class:`~kernelize.models.llama_demo.LlamaDemo` (random weights), run it eagerly, kernelize a
copy with :func:`kernelize.hub.default_mapping`, compile the kernels in one warm-up pass (progress bar,
one tick per marked layer), then print the substitution table (module -> layer -> repo -> backend ->
kernels), the largest difference against eager, and median forward times of eager, kernelized and
``torch.compile``. Writes ``<out>/demo.json`` and the SVG of one fused layer's graph.

Example:
    >>> from kernelize.cli import main
    >>> main(["demo", "--quick", "--out", "/tmp/kz-demo"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernelize import hub
from kernelize.layer import Mode, inspect, kernelize, use_kernel_mapping
from kernelize.layer.record import marked_modules
from kernelize.models.llama_demo import LlamaDemo, LlamaDemoConfig

logger = logging.getLogger(__name__)

# (config, batch, seq, timing repetitions) per run size
SIZES: dict[str, tuple[LlamaDemoConfig, int, int, int]] = {
    "quick": (LlamaDemoConfig.tiny(), 2, 32, 5),
    "full": (LlamaDemoConfig(), 4, 256, 10),
}
SVG_LAYER = "FusedAddRMSNorm"  # the layer whose fused graph the demo draws (falls back to any kernel layer)


def median_times_ms(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median wall time of each `fn()` in milliseconds, after one untimed call each.

    Round robin (every round calls each function once), so load drifting on a shared machine hits all alike.
    """
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def kernelize_demo_model(model: nn.Module) -> nn.Module:
    """Kernelize `model` in place for CPU inference with the bundled hub's default mapping."""
    with use_kernel_mapping(hub.default_mapping()):
        return kernelize(model, device="cpu", mode=Mode.INFERENCE)


def warm_up(model: nn.Module, inputs: torch.Tensor, show: bool = True) -> float:
    """One forward that compiles every hub kernel, with a progress bar ticking per marked layer; seconds."""
    from tqdm import tqdm

    marked = [m for _, m in marked_modules(model)]
    bar = tqdm(total=len(marked), desc="compiling kernels", unit="layer", disable=not show, leave=True)
    done: set[int] = set()

    def tick(module: nn.Module, *_: Any) -> None:
        if id(module) not in done:
            done.add(id(module))
            bar.set_postfix_str(type(module).kernel_layer_name, refresh=False)
            bar.update(1)

    handles = [m.register_forward_hook(tick) for m in marked]
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            model(inputs)
    finally:
        for h in handles:
            h.remove()
        bar.close()
    return time.perf_counter() - start


def substitution_rows(model: nn.Module) -> list[dict[str, str]]:
    """One row per marked module: module, layer, repo, backend, kernels (from `kernelize.inspect`)."""
    rows = []
    for path, choice in inspect(model).items():
        kernels = ", ".join(f"{name}#{digest[:8]}" for name, digest in choice.kernels)
        rows.append(
            {
                "module": path,
                "layer": choice.layer_name,
                "repo": _repo_id(choice.repository) if choice.uses_kernel else f"({choice.fallback})",
                "backend": choice.backend or "-",
                "kernels": kernels or ("-" if choice.backend is None else "(library)"),
            }
        )
    return rows


def _repo_id(repository: str | None) -> str:
    """`kernelize/layer_norm` out of a description such as "`kernelize/layer_norm` (version 1), layer ..."."""
    text = repository or "-"
    parts = text.split("`")
    return parts[1] if len(parts) > 2 else text.split(" (")[0]


def format_table(rows: Sequence[dict[str, str]], columns: Sequence[str]) -> str:
    widths = [max(len(c), *(len(r[c]) for r in rows)) for c in columns]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(r[c].ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(out)


def write_svg(model: nn.Module, out_dir: Path) -> Path | None:
    """Draw one fused layer (the first `SVG_LAYER`, else any that ran a kernel): its optimized graph
    (``<layer>.svg``) and its fusion plan with one cluster per kernel (``<layer>.plan.svg``)."""
    from kernelize.autokernel.dot import plan_to_svg
    from kernelize.ir.dot import graph_to_svg

    candidates = [m for _, m in marked_modules(model) if hub.compiled_ran(m) is not None]
    candidates.sort(key=lambda m: type(m).kernel_layer_name != SVG_LAYER)
    if not candidates:
        return None
    module = candidates[0]
    compiled, layer = hub.compiled_ran(module), type(module).kernel_layer_name
    title = f"{layer}: {len(compiled.kernels)} kernel(s) on {compiled.backend}"
    target = graph_to_svg(out_dir / f"{layer}.svg", compiled.graph, title=title)
    if compiled.plan is not None:
        plan_to_svg(out_dir / f"{layer}.plan.svg", compiled.plan, title=title)
    return Path(target)


def run_demo(quick: bool = False, out: str | Path = "out", show_progress: bool = True) -> dict[str, Any]:
    """Run the demo and return its results (also written to `<out>/demo.json`)."""
    cfg, batch, seq, repeat = SIZES["quick" if quick else "full"]
    torch.manual_seed(0)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    eager = LlamaDemo(cfg).eval()
    inputs = torch.randint(0, cfg.vocab, (batch, seq))
    with torch.inference_mode():
        expected = eager(inputs)

    model = kernelize_demo_model(copy.deepcopy(eager))
    compile_s = warm_up(model, inputs, show=show_progress)
    with torch.inference_mode():
        got = model(inputs)
    max_diff = (got - expected).abs().max().item()
    rows = substitution_rows(model)

    compiled = torch.compile(eager)
    with torch.inference_mode():
        start = time.perf_counter()
        compiled(inputs)
        torch_compile_s = time.perf_counter() - start
        timings = median_times_ms(
            {
                "eager": lambda: eager(inputs),
                "kernelized": lambda: model(inputs),
                "torch.compile": lambda: compiled(inputs),
            },
            repeat,
        )
    svg = write_svg(model, out_dir)
    result = {
        "config": {**cfg.__dict__, "batch": batch, "seq": seq},
        "substitutions": rows,
        "max_abs_diff": max_diff,
        "max_abs_logit": expected.abs().max().item(),
        "timings_ms": timings,
        "speedup_vs_eager": timings["eager"] / timings["kernelized"],
        "kernel_compile_s": compile_s,
        "torch_compile_first_call_s": torch_compile_s,
        "compiled_signatures": hub.compiled_count(),
        "svg": str(svg) if svg else None,
    }
    (out_dir / "demo.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


def report(result: dict[str, Any]) -> str:
    c = result["config"]
    t = result["timings_ms"]
    lines = [
        f"LlamaDemo: hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, batch {c['batch']}, "
        f"seq {c['seq']} (CPU, f32)",
        "",
        format_table(result["substitutions"], ["module", "layer", "repo", "backend", "kernels"]),
        "",
        f"max |kernelized - eager| = {result['max_abs_diff']:.3g} "
        f"(|logits| <= {result['max_abs_logit']:.3g})",
        f"kernels: {result['compiled_signatures']} signatures compiled in {result['kernel_compile_s']:.1f} s "
        f"(torch.compile first call: {result['torch_compile_first_call_s']:.1f} s)",
        "",
        "forward time (median ms):  " + "  ".join(f"{k} {v:.2f}" for k, v in t.items()),
        f"speedup: kernelized {t['eager'] / t['kernelized']:.2f}x vs eager, "
        f"{t['torch.compile'] / t['kernelized']:.2f}x vs torch.compile",
    ]
    if result["svg"]:
        lines.append(f"wrote {result['svg']} (the graph of one fused layer)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``kernelize demo`` (``--out``, ``--quick``)."""
    result = run_demo(quick=args.quick, out=args.out)
    print(report(result))
    return 0
