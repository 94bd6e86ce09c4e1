"""Decode benchmarks: the few-row matmul kernel against F.linear and the read bandwidth of a torch sum.

    .venv/bin/python benchmarks/decode.py [--quick] [--threads 2] [--repeat 15] [--sizes 8,32,64,128]

Part 1 (``gemv``): ``y = x @ W.T`` with one row (and four), W of 8-128 MB in f32 and bf16, K = 4096. Per
size, round-robin in one run: the generated kernel (``compile_graph(..., backend="cpu")``), ``F.linear``,
and ``W.sum()`` (which reads the same bytes once: its bandwidth is the yardstick). Medians; GB/s = weight
bytes / time. Part 2 (``model``): decode tokens/s of transformers models, when the one-call integration
is available (``kernelize.integrations.transformers``). Writes ``benchmarks/results/decode.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph
from kernelize.runtime.compiled import compile_graph

RESULTS = Path(__file__).parent / "results"


def linear_graph(k: int, n: int, dtype: DType) -> Graph:
    g = Graph()
    x = g.input("x", ("m", k), dtype)
    w = g.input("w", (n, k), dtype)
    g.output(g.matmul(x, g.transpose(w)))
    return g


def interleaved(fns: dict, repeat: int, inner: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin so load changes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_gemv(sizes_mb: list[int], rows: list[int], repeat: int) -> list[dict]:
    out = []
    k = 4096
    for dtype in (DType.F32, DType.BF16):
        for mb in sizes_mb:
            n = mb * 2**20 // (k * dtype.torch.itemsize)
            w = torch.randn(n, k).to(dtype.torch)
            nbytes = w.numel() * w.element_size()
            cg = compile_graph(linear_graph(k, n, dtype), backend="cpu")
            for m in rows:
                x = torch.randn(m, k).to(dtype.torch)
                med = interleaved(
                    {
                        "kernel": lambda x=x, w=w, cg=cg: cg(x, w),
                        "F.linear": lambda x=x, w=w: F.linear(x, w),
                        "sum": lambda w=w: w.sum(),
                    },
                    repeat,
                )
                row = {
                    "dtype": str(dtype),
                    "weight_mb": mb,
                    "rows": m,
                    **{f"{name}_ms": t * 1e3 for name, t in med.items()},
                    **{f"{name}_gbs": nbytes / t / 1e9 for name, t in med.items()},
                }
                row["kernel_vs_sum"] = row["kernel_gbs"] / row["sum_gbs"]
                row["kernel_vs_linear"] = med["F.linear"] / med["kernel"]
                print(
                    f"{row['dtype']:5} {mb:4d} MB rows {m:2d}: kernel {row['kernel_ms']:7.2f} ms "
                    f"({row['kernel_gbs']:5.1f} GB/s)  F.linear {row['F.linear_ms']:7.2f} ms "
                    f"({row['F.linear_gbs']:5.1f} GB/s)  sum {row['sum_ms']:7.2f} ms "
                    f"({row['sum_gbs']:5.1f} GB/s)"
                    f"  kernel/sum {row['kernel_vs_sum']:.2f}  vs F.linear {row['kernel_vs_linear']:.2f}x",
                    flush=True,
                )
                out.append(row)
    return out


# ---- part 2: decode tokens/s of transformers models -----------------------------------------------------
FAMILY = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def build_model(family: str, hidden: int, dtype: torch.dtype, quick: bool) -> torch.nn.Module:
    import transformers

    cfg_name, model_name = FAMILY[family]
    heads = hidden // 64
    config = getattr(transformers, cfg_name)(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=1 if quick else 4,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        vocab_size=2048 if quick else 32000,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval().to(dtype)


@contextlib.contextmanager
def marked(model: torch.nn.Module):
    """Mark the model's RMSNorm, MLP and Linear classes for the hub (restored afterwards), when the one-call
    integration is not there to do it."""
    import kernelize

    classes = {type(m) for m in model.modules()}
    marks = {}
    for cls in classes:
        name = cls.__name__
        mark = "RMSNorm" if name.endswith("RMSNorm") else "LlamaMLP" if name.endswith("MLP") else None
        if cls is torch.nn.Linear:
            mark = "Linear"
        if mark:
            marks[cls] = {
                k: cls.__dict__[k] for k in ("kernel_layer_name", "kernel_condition") if k in cls.__dict__
            }
            kernelize.replace_kernel_forward_from_hub(cls, mark)
    try:
        yield
    finally:
        for cls, saved in marks.items():
            for k in ("kernel_layer_name", "kernel_condition"):
                if k in saved:
                    setattr(cls, k, saved[k])
                elif k in cls.__dict__:
                    delattr(cls, k)


def kernelize_model(model: torch.nn.Module) -> torch.nn.Module:
    import kernelize
    from kernelize import Mode, hub

    try:  # the one call, once it exists
        from kernelize.integrations.transformers import kernelize_model as one_call

        return one_call(model, mode=Mode.INFERENCE)
    except ImportError:
        with marked(model), kernelize.use_kernel_mapping(hub.default_mapping()):
            return kernelize.kernelize(model, device="cpu", mode=Mode.INFERENCE)


def bench_decode(
    family: str,
    hidden: int,
    dtype: torch.dtype,
    batch: int,
    new: int,
    repeat: int,
    quick: bool,
    compile_: bool,
) -> dict:
    import copy

    torch._dynamo.reset()  # each configuration traces afresh instead of hitting the recompile limit
    model = build_model(family, hidden, dtype, quick)
    prompt = torch.randint(
        0, model.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(0)
    )
    variants = {"eager": model, "kernelized": kernelize_model(copy.deepcopy(model))}
    if compile_:
        compiled = copy.deepcopy(model)
        compiled.generation_config.cache_implementation = "static"
        compiled.forward = torch.compile(compiled.forward, dynamic=False)
        variants["torch.compile"] = compiled

    def gen(m, n):
        return m.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    out: dict = {
        "family": family,
        "hidden": hidden,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
    }
    with torch.inference_mode():
        tokens = {}
        for name, m in variants.items():
            t0 = time.perf_counter()
            tokens[name] = gen(m, new)  # warm-up: kernels compiled, torch.compile traced
            out[f"{name}_first_s"] = time.perf_counter() - t0
        out["same_tokens_as_eager"] = {n: bool(torch.equal(t, tokens["eager"])) for n, t in tokens.items()}
        fns = {}
        for name, m in variants.items():
            fns[name + "/full"] = lambda m=m: gen(m, new)
            fns[name + "/prefill"] = lambda m=m: gen(m, 1)
        med = interleaved(fns, repeat, inner=1)
    for name in variants:
        dt = med[name + "/full"] - med[name + "/prefill"]
        out[f"{name}_tok_s"] = batch * (new - 1) / dt
    for name in variants:
        out[f"{name}_vs_eager"] = out[f"{name}_tok_s"] / out["eager_tok_s"]
    print(
        f"{family:6} hidden {hidden:5d} {out['dtype']:8} batch {batch}: "
        + "  ".join(f"{n} {out[n + '_tok_s']:7.1f} tok/s ({out[n + '_vs_eager']:.2f}x)" for n in variants)
        + f"  same tokens {out['same_tokens_as_eager']}",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 MB only, one row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--sizes", default="8,32,64,128", help="weight sizes in MB")
    ap.add_argument("--parts", default="gemv,model")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [32] if args.quick else [int(s) for s in args.sizes.split(",")]
    rows = [1] if args.quick else [1, 4]
    result: dict = {"threads": args.threads, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    parts = args.parts.split(",")
    if "gemv" in parts:
        result["gemv"] = bench_gemv(sizes, rows, args.repeat)
    if "model" in parts:
        result["model"] = []
        families = ["llama"] if args.quick else ["llama", "qwen2"]
        hiddens = [512] if args.quick else [512, 1024]
        for family, hidden, dtype, batch in itertools.product(
            families, hiddens, (torch.float32, torch.bfloat16), (1,) if args.quick else (1, 4)
        ):
            result["model"].append(
                bench_decode(
                    family,
                    hidden,
                    dtype,
                    batch,
                    args.new_tokens,
                    max(3, args.repeat // 3),
                    args.quick,
                    not args.no_compile,
                )
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
