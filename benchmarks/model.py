"""Whole-model forward times on the CPU: eager vs kernelized vs torch.compile vs kernelized + torch.compile.

Models: the demo decoder (`kernelize.models.llama_demo`) and a transformers `LlamaForCausalLM` built from a
config in code (random weights, no download), both at hidden 1024, 4 layers, batch 4, sequence 256 (f32).
Prints a table of medians, writes `<out>/model.json` and `<out>/model.png`.

Usage:
    python benchmarks/model.py            # full size (a few minutes on 2 cores)
    python benchmarks/model.py --quick    # small sizes, a few repetitions (CI smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import kernelize
from kernelize import Mode, hub
from kernelize.demo import kernelize_demo_model, median_times_ms
from kernelize.models.llama_demo import LlamaDemo, LlamaDemoConfig

VARIANTS = ("eager", "kernelized", "torch.compile", "kernelized+torch.compile")


@contextlib.contextmanager
def marked_transformers_llama() -> Iterator[None]:
    """Mark LlamaRMSNorm / LlamaMLP for the block (restoring transformers' own marks afterwards)."""
    from transformers.models.llama import modeling_llama as ml

    classes = (ml.LlamaRMSNorm, ml.LlamaMLP)
    saved = [
        {k: c.__dict__[k] for k in ("kernel_layer_name", "kernel_condition") if k in c.__dict__}
        for c in classes
    ]
    kernelize.replace_kernel_forward_from_hub(ml.LlamaRMSNorm, "RMSNorm")
    kernelize.replace_kernel_forward_from_hub(ml.LlamaMLP, "LlamaMLP")
    try:
        yield
    finally:
        for c, attrs in zip(classes, saved):
            for k in ("kernel_layer_name", "kernel_condition"):
                if k in attrs:
                    setattr(c, k, attrs[k])
                elif k in c.__dict__:
                    delattr(c, k)


def build_demo(quick: bool) -> tuple[torch.nn.Module, tuple]:
    cfg = LlamaDemoConfig.tiny() if quick else LlamaDemoConfig.bench()
    batch, seq = (2, 32) if quick else (4, 256)
    return LlamaDemo(cfg).eval(), (torch.randint(0, cfg.vocab, (batch, seq)),)


def build_llama(quick: bool) -> tuple[torch.nn.Module, tuple]:
    import transformers

    size = (
        dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
        )
        if quick
        else dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=16,
            vocab_size=1024,
        )
    )
    config = transformers.LlamaConfig(
        **size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=512
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    batch, seq = (2, 32) if quick else (4, 256)
    return model, (torch.randint(0, size["vocab_size"], (batch, seq)),)


def bench_model(name: str, model: torch.nn.Module, inputs: tuple, repeat: int) -> dict:
    def logits(m):
        out = m(*inputs)
        return out.logits if hasattr(out, "logits") else out

    with torch.inference_mode():
        expected = logits(model)
        kernelized = kernelize_demo_model(copy.deepcopy(model))
        kz_compile = copy.deepcopy(model)
        with kernelize.use_kernel_mapping(hub.default_mapping()):
            kernelize.kernelize(kz_compile, device="cpu", mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
        models = {
            "eager": model,
            "kernelized": kernelized,
            "torch.compile": torch.compile(model),
            "kernelized+torch.compile": torch.compile(kz_compile),
        }
        result: dict = {"model": name, "times_ms": {}, "first_call_s": {}, "max_abs_diff": {}}
        for variant, m in models.items():
            start = time.perf_counter()
            got = logits(m)  # compiles (kernels or torch.compile)
            result["first_call_s"][variant] = time.perf_counter() - start
            result["max_abs_diff"][variant] = (got - expected).abs().max().item()
        result["times_ms"] = median_times_ms(
            {v: functools.partial(logits, m) for v, m in models.items()}, repeat
        )
        for variant in models:
            print(f"  {name:<18} {variant:<26} {result['times_ms'][variant]:9.2f} ms", file=sys.stderr)
    t = result["times_ms"]
    result["speedup_vs_eager"] = {v: t["eager"] / t[v] for v in VARIANTS}
    result["substituted"] = sorted(
        {c.layer_name for c in kernelize.inspect(kernelized).values() if c.uses_kernel}
    )
    return result


def table(results: list[dict]) -> str:
    head = f"| model | {' | '.join(VARIANTS)} |"
    lines = [head, "|" + "---|" * (len(VARIANTS) + 1)]
    for r in results:
        cells = [f"{r['times_ms'][v]:.1f} ms ({r['speedup_vs_eager'][v]:.2f}x)" for v in VARIANTS]
        lines.append(f"| {r['model']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        xs = [j + i * width for j in range(len(results))]
        ax.bar(xs, [r["times_ms"][v] for r in results], width, label=v)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))], [r["model"] for r in results])
    ax.set_ylabel("forward time, median (ms)")
    ax.set_title(f"CPU forward, {torch.get_num_threads()} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models, few repetitions")
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 10, 3 with --quick)")
    p.add_argument("--out", default="out/bench", help="folder for model.json and model.png")
    p.add_argument("--models", default="demo,llama", help="comma-separated: demo, llama")
    p.add_argument("--threads", type=int, default=None, help="torch and OpenMP threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        # before the first generated kernel loads: its OpenMP runtime reads OMP_NUM_THREADS once
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    repeat = args.repeat or (3 if args.quick else 10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    wanted = args.models.split(",")
    if "demo" in wanted:
        results.append(bench_model("llama_demo", *build_demo(args.quick), repeat))
    if "llama" in wanted:
        with marked_transformers_llama():
            results.append(bench_model("transformers Llama", *build_llama(args.quick), repeat))
    print(table(results))
    (out / "model.json").write_text(
        json.dumps({"quick": args.quick, "threads": torch.get_num_threads(), "results": results}, indent=2)
    )
    plot(results, out / "model.png")
    print(f"wrote {out / 'model.json'} and {out / 'model.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
