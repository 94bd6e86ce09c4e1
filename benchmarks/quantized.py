"""Packed-weight decode: the q8_0 / q4_0 / int8 kernels against bf16, and decode tok/s of a small Llama.

    .venv/bin/python benchmarks/quantized.py [--threads 2] [--repeat 21] [--parts matmul,model]

Part 1 (``matmul``): ``y = x @ W.T`` with x [1, 4096] and W [11008, 4096] (a 7B MLP projection), timed
round-robin in one run: ``F.linear`` on bf16, ``kernelize.quant.linear`` per format, and ``torch.sum`` over
1 GiB of f32 (one read of every byte: its bandwidth is the yardstick). Medians; GB/s = weight bytes (packed
bytes plus scales) / time. Part 2 (``model``): a random-weight LlamaForCausalLM (hidden 1024, 8 layers,
intermediate 2816, vocab 32000) in bf16, eager against ``quantize_model(copy, fmt)``: greedy decode tok/s
(32 new tokens, the prompt's prefill subtracted) and, on an 8-token prompt (the decode kernel's rows), the
cosine of the logits and the agreement of the argmax with the bf16 model. Writes
``benchmarks/results/quantized.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernelize import quant

RESULTS = Path(__file__).parent / "results"
FORMATS = ("q8_0", "q4_0", "int8")


def interleaved(fns: dict, repeat: int, inner: int = 1) -> dict[str, float]:
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


def bench_matmul(repeat: int, n: int = 11008, k: int = 4096) -> dict:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(1, k)
    big = torch.ones(2**28)  # 1 GiB of f32
    wb, xb = w.bfloat16(), x.bfloat16()
    packed = {f: quant.quantize(w, f) for f in FORMATS}
    fns = {"sum_1GiB": big.sum, "bf16_F.linear": lambda: F.linear(xb, wb)}
    nbytes = {"sum_1GiB": big.numel() * 4, "bf16_F.linear": wb.numel() * 2}
    for f, p in packed.items():
        fns[f] = lambda p=p: quant.linear(x, p)
        nbytes[f] = p.nbytes
    med = interleaved(fns, repeat, inner=1)
    sum_gbs = nbytes["sum_1GiB"] / med["sum_1GiB"] / 1e9
    rows = {}
    for name, t in med.items():
        gbs = nbytes[name] / t / 1e9
        rows[name] = {"ms": t * 1e3, "bytes": nbytes[name], "GB_s": gbs, "of_sum_bw": gbs / sum_gbs}
        print(f"{name:14} {t * 1e3:7.3f} ms  {gbs:6.1f} GB/s  {gbs / sum_gbs:5.0%} of sum", flush=True)
    return {"n": n, "k": k, "rows": 1, "results": rows}


def build_llama() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)


def bench_model(repeat: int, new: int = 32) -> dict:
    model = build_llama()
    variants = {"bf16": model}
    summaries = {}
    for f in ("q8_0", "q4_0"):
        variants[f] = copy.deepcopy(model)
        s = quant.quantize_model(variants[f], f)
        summaries[f] = {
            "layers": len(s.replaced),
            "MB_before": s.bytes_before / 1e6,
            "MB_after": s.bytes_after / 1e6,
        }
    prompt = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(0))

    def gen(m: torch.nn.Module, n: int) -> torch.Tensor:
        return m.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    out: dict = {"config": "llama hidden 1024, 8 layers, intermediate 2816, vocab 32000, bf16", "new": new}
    with torch.inference_mode():
        logits = {name: m(prompt).logits.float()[0] for name, m in variants.items()}
        tokens = {name: gen(m, new) for name, m in variants.items()}
        fns = {}
        for name, m in variants.items():
            fns[name + "/full"] = lambda m=m: gen(m, new)
            fns[name + "/prefill"] = lambda m=m: gen(m, 1)
        med = interleaved(fns, repeat)
    for name in variants:
        tok_s = (new - 1) / (med[name + "/full"] - med[name + "/prefill"])
        row = {"tok_s": tok_s, "vs_bf16": None}
        if name != "bf16":
            ref = logits["bf16"]
            row["logit_cosine"] = F.cosine_similarity(logits[name], ref, dim=-1).min().item()
            row["argmax_agree"] = (logits[name].argmax(-1) == ref.argmax(-1)).float().mean().item()
            row["same_greedy_tokens"] = int((tokens[name] == tokens["bf16"]).sum() - prompt.numel())
            row.update(summaries[name])
        out[name] = row
    for name in variants:
        out[name]["vs_bf16"] = out[name]["tok_s"] / out["bf16"]["tok_s"]
        print(
            f"{name:5} {out[name]['tok_s']:7.1f} tok/s ({out[name]['vs_bf16']:.2f}x)  {out[name]}", flush=True
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--parts", default="matmul,model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {
        "threads": args.threads,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_avg_before": Path("/proc/loadavg").read_text().split()[:3],
    }
    parts = args.parts.split(",")
    if "matmul" in parts:
        result["matmul"] = bench_matmul(args.repeat)
    if "model" in parts:
        result["model"] = bench_model(max(3, args.repeat // 4))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quantized.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
