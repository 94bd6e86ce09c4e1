"""Mixture-of-experts models on the CPU: transformers' experts implementations vs `kernelize_model`.

Model: a Qwen3-MoE layout built from a config in code (random weights, no download); by default 32 experts,
top-4, hidden 1024, expert intermediate 768, 4 layers (`--layout qwen3-moe`), or a scaled Qwen3-30B-A3B
layout, 128 experts, top-8, hidden 1024, intermediate 512, 8 layers (~1.1 B parameters, `--layout large`).
Variants, round robin in one run (compare ratios, not absolute times):

* `eager`: the model as transformers builds it, its default experts implementation (`grouped_mm`);
* `eager-loop`: the `eager` experts implementation (a loop over the experts hit);
* `kernelized`: `kernelize_model` (the grouped-expert kernel through transformers' experts interface, plus
  the attention and norm kernels);
* `torch.compile` of the default model (prefill only; `--no-compile` leaves it out);
* `kernelized q8_0`, `kernelized q4_0` (`--quantize`): `kernelize_model(quantize=...)`, the experts packed too
  (`kernelize.quant.experts`): fewer bytes, so not the same tokens.

Measured: prefill (one forward over a 512-token prompt, last logits), decode (greedy `generate` of 32 new
tokens after a 32-token prompt: tokens/s of the tokens after the first, `llm.bench_decode`, and whether the
float variants' tokens equal eager's), and the experts alone in
decode shape: one token's call with fresh routing over `--bw-layers` layers' experts (more bytes than the
caches hold; packed: as many copies as make 1 GiB), GB/s of the selected experts' weights (packed: their
packed bytes), against the read bandwidth of `torch.sum` over 1 GiB in the same run. Writes
`<out>/moe.json`.

Usage:
    python benchmarks/moe.py                      # f32 and bf16, the qwen3-moe layout
    python benchmarks/moe.py --quick              # f32 only, few repetitions
    python benchmarks/moe.py --layout large --dtypes bf16 --no-compile
    python benchmarks/moe.py --quantize ""         # no packed variants
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm import bench_decode, bench_prefill  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = {  # experts, top-k, hidden, expert intermediate, layers, heads, kv heads
    "qwen3-moe": (32, 4, 1024, 768, 4, 16, 4),
    "large": (128, 8, 1024, 512, 8, 16, 4),
    "tiny": (8, 2, 256, 128, 2, 4, 2),
}


def cpu_name() -> str:
    """The host (cores and CPU model) and torch's vector capability: timings differ across them."""
    from threads import machine

    return f"{machine()}, {torch.backends.cpu.get_cpu_capability()}"


def build(layout: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    experts, top_k, hidden, inter, layers, heads, kv = LAYOUTS[layout]
    config = transformers.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * inter,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval().to(dtype)
    with torch.no_grad():  # spread the router's logits so that routing is not a tie between experts
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.05)
    return model


def with_experts(model: torch.nn.Module, implementation: str) -> torch.nn.Module:
    other = copy.deepcopy(model)
    other.set_experts_implementation(implementation)
    return other


def expert_bandwidth(model: torch.nn.Module, layers: int, repeat: int, packed: list[str]) -> dict:
    """GB/s of the selected experts' weights in a one-token experts call with fresh routing, against a sum
    (`packed`: the formats whose packed experts are timed too, over their packed bytes)."""
    from kernelize.experts import grouped_experts
    from kernelize.quant.experts import QuantizedExperts

    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    e, two_i, h = experts.gate_up_proj.shape
    k = model.config.num_experts_per_tok
    dtype = experts.gate_up_proj.dtype
    ups = [experts.gate_up_proj.detach().clone() for _ in range(layers)]
    downs = [experts.down_proj.detach().clone() for _ in range(layers)]
    x = torch.randn(1, h, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(e, generator=gen)[:k].view(1, k) for _ in range(64)]
    weights = torch.full((1, k), 1.0 / k, dtype=dtype)
    impls = {
        "kernelized": lambda i, u, d: grouped_experts(x, i, weights, u, d, "silu"),
        "eager": lambda i, u, d: _grouped_mm_call(experts, x, i, weights, u, d),
    }
    per_expert = (two_i * h + h * two_i // 2) * ups[0].element_size()
    out: dict = {"expert_mb": per_expert / 1e6, "top_k": k, "gb_s": {}}
    with torch.inference_mode():
        for name, fn in impls.items():
            times = []
            for r in range(repeat * 8):
                layer = r % layers
                t0 = time.perf_counter()
                fn(picks[r % len(picks)], ups[layer], downs[layer])
                times.append(time.perf_counter() - t0)
            out["gb_s"][name] = k * per_expert / statistics.median(times) / 1e9
        for fmt in packed:  # as many copies as make 1 GiB: this host's caches may hold a few layers' bytes
            one = QuantizedExperts.from_experts(experts, fmt)
            size = sum(b.numel() for b in one.buffers())
            copies = [one] + [copy.deepcopy(one) for _ in range(-(-(2**30) // size) - 1)]
            for c in copies:  # each copy's calls resolved once (as a model's are), not in the timed calls
                c(x, picks[0], weights)
            times = []
            for r in range(repeat * 8):
                t0 = time.perf_counter()
                copies[r % len(copies)](x, picks[r % len(picks)], weights)
                times.append(time.perf_counter() - t0)
            out["gb_s"][f"kernelized {fmt}"] = k * size / e / statistics.median(times) / 1e9
        big = torch.ones(2**30 // 4)
        sums = []
        for _ in range(max(3, repeat)):
            t0 = time.perf_counter()
            big.sum()
            sums.append(time.perf_counter() - t0)
    out["sum_gb_s"] = 2**30 / statistics.median(sums) / 1e9
    out["of_sum"] = {n: v / out["sum_gb_s"] for n, v in out["gb_s"].items()}
    return out


def _grouped_mm_call(experts, x, index, weights, up, down):
    """transformers' default experts implementation on the given weights."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    saved = experts.gate_up_proj, experts.down_proj
    try:
        experts.gate_up_proj, experts.down_proj = torch.nn.Parameter(up), torch.nn.Parameter(down)
        return grouped_mm_experts_forward(experts, x, index, weights)
    finally:
        experts.gate_up_proj, experts.down_proj = saved


def run(layout: str, dtype_name: str, args: argparse.Namespace) -> dict:
    from kernelize.integrations.transformers import kernelize_model

    eager = build(layout, DTYPES[dtype_name])
    params = sum(p.numel() for p in eager.parameters())
    models = {
        "eager": eager,
        "eager-loop": with_experts(eager, "eager"),
        "kernelized": kernelize_model(copy.deepcopy(eager)),
    }
    packed = [f for f in args.quantize.split(",") if f]
    for fmt in packed:
        models[f"kernelized {fmt}"] = kernelize_model(copy.deepcopy(eager), quantize=fmt)
    label = f"{layout} {dtype_name}"
    print(f"{label}: {params / 1e6:.0f} M parameters", file=sys.stderr)
    record: dict = {"model": label, "parameters": params, "layout": dict(zip(_FIELDS, LAYOUTS[layout]))}
    prefill_models = dict(models)
    if args.compile:
        torch._dynamo.reset()
        prefill_models["torch.compile"] = torch.compile(eager)
    record["prefill"] = bench_prefill(prefill_models, 1, args.seq, args.repeat)
    record["decode"] = bench_decode(models, args.new_tokens, args.repeat)
    equal = record["decode"]["equal"]
    record["decode"]["tokens_equal"] = all(v for n, v in equal.items() if not n.startswith("kernelized "))
    record["experts_decode"] = expert_bandwidth(eager, args.bw_layers, args.repeat, packed)
    p, d, b = record["prefill"], record["decode"], record["experts_decode"]
    print(
        f"  prefill s{args.seq}: " + "  ".join(f"{v} {p['speedup'][v]:.2f}x" for v in p["ms"]),
        file=sys.stderr,
    )
    print(
        "  decode: "
        + "  ".join(f"{v} {d['tokens_per_s'][v]:.1f} tok/s" for v in d["ms"])
        + f"  tokens equal {d['tokens_equal']}",
        file=sys.stderr,
    )
    print(
        f"  experts decode: {b['gb_s']['kernelized']:.1f} GB/s ({b['of_sum']['kernelized']:.0%} of sum "
        f"{b['sum_gb_s']:.1f} GB/s); eager {b['gb_s']['eager']:.1f} GB/s"
        + "".join(f"; {n} {v:.1f} GB/s ({b['of_sum'][n]:.0%})" for n, v in b["gb_s"].items() if " " in n),
        file=sys.stderr,
    )
    return record


def table(records: list[dict]) -> str:
    """The docs table: per dtype, prefill and decode against eager (same run), tokens, experts' read rate."""
    head = "| model | prefill vs eager | vs eager-loop | vs torch.compile | decode vs eager | decode tok/s "
    head += "(eager / ours) | same tokens | experts' read rate (share of `sum`) | packed experts: decode, "
    head += "prefill vs eager (read rate) |"
    rows = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        p, d, b = r["prefill"]["ms"], r["decode"], r["experts_decode"]
        ours = p["kernelized"]
        compiled = f"{p['torch.compile'] / ours:.2f}x" if "torch.compile" in p else "-"
        tps = d["tokens_per_s"]
        cells = [
            f"{r['model']} ({r['parameters'] / 1e6:.0f} M)",
            f"{p['eager'] / ours:.2f}x",
            f"{p['eager-loop'] / ours:.2f}x",
            compiled,
            f"{d['speedup']['kernelized']:.2f}x",
            f"{tps['eager']:.1f} / {tps['kernelized']:.1f}",
            str(d["tokens_equal"]),
            f"{b['gb_s']['kernelized']:.1f} GB/s ({b['of_sum']['kernelized']:.0%}; "
            f"eager {b['of_sum']['eager']:.0%})",
            "; ".join(
                f"{n.split()[1]} {d['speedup'][n]:.2f}x, {p['eager'] / p[n]:.2f}x ({b['of_sum'][n]:.0%})"
                for n in p
                if n.startswith("kernelized ")
            )
            or "-",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


_FIELDS = ("experts", "top_k", "hidden", "moe_intermediate", "layers", "heads", "kv_heads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3-moe")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bw-layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--quantize", default="q8_0,q4_0", help="packed variants (comma-separated formats)")
    parser.add_argument("--quick", action="store_true", help="f32 only, 3 repetitions, no torch.compile")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.repeat, args.compile, args.quantize = "f32", 3, False, ""
    torch.set_num_threads(args.threads)
    records = [run(args.layout, d, args) for d in args.dtypes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "torch": torch.__version__, "layout": args.layout, "cpu": cpu_name()}
    (args.out / "moe.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
