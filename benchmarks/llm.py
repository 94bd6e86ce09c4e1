"""transformers decoder models on the CPU: eager vs `kernelize_model` (one call) vs torch.compile.

Models: transformers `LlamaForCausalLM` and `Qwen2ForCausalLM` built from configs in code (random weights,
no download): hidden 512 (8 heads, 2 KV heads) and 1024 (16 heads, 4 KV heads), head dim 64, 4 layers,
f32 and bf16. Eager is the model as transformers builds it (SDPA attention).

* prefill: one forward over the prompt (batch 1 and 4, seq 512 and 2048; logits of the last position only,
  as `generate` does), eager vs kernelized vs torch.compile, medians of interleaved repetitions;
* decode: greedy `generate` of 64 new tokens after a 32-token prompt (batch 1), eager vs kernelized,
  tokens/s, with a check that the tokens are identical.

Prints a table, writes `<out>/llm.json` and `<out>/llm.png`. The variants run round robin, so compare ratios
within one run; absolute times move with the machine's load.

Usage:
    python benchmarks/llm.py             # the full grid (long on 2 cores)
    python benchmarks/llm.py --quick     # hidden 512, f32, batch 1, seq 512, few repetitions
    python benchmarks/llm.py --families llama --hidden 512 --dtypes f32 --seqs 1024,2048 --batches 1
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
SIZES = {  # hidden -> (heads, kv heads, intermediate)
    512: (8, 2, 1408),
    1024: (16, 4, 2816),
}
PREFILL_VARIANTS = ("eager", "kernelized", "torch.compile")
DECODE_VARIANTS = ("eager", "kernelized")


def build(family: str, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    heads, kv_heads, inter = SIZES[hidden]
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in names[family])
    config = config_cls(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_cls(config).eval().to(dtype)


def kernelized_copy(model: torch.nn.Module) -> torch.nn.Module:
    from kernelize.integrations.transformers import kernelize_model

    return kernelize_model(copy.deepcopy(model))


def prefill(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False, logits_to_keep=1).logits


def bench_prefill(models: dict, batch: int, seq: int, repeat: int) -> dict:
    ids = torch.randint(1, 4096, (batch, seq), generator=torch.Generator().manual_seed(seq))
    result: dict = {"batch": batch, "seq": seq, "first_call_s": {}}
    with torch.inference_mode():
        want = prefill(models["eager"], ids).float()
        for name, m in models.items():
            start = time.perf_counter()
            got = prefill(m, ids).float()
            result["first_call_s"][name] = time.perf_counter() - start
            result.setdefault("max_abs_diff", {})[name] = (got - want).abs().max().item()
        from kernelize.demo import median_times_ms

        fns = {name: functools.partial(prefill, m, ids) for name, m in models.items()}
        result["ms"] = median_times_ms(fns, repeat)
    result["speedup"] = {v: result["ms"]["eager"] / result["ms"][v] for v in models}
    return result


def bench_decode(models: dict, new_tokens: int, repeat: int) -> dict:
    """Greedy decode after a 32-token prompt: `generate` of `new_tokens` and of 1 token, interleaved; the
    decode rate is that of the tokens after the first (the prompt's prefill and the first token taken off,
    as benchmarks/quantized.py does), and `speedup` compares it. `ms` keeps the whole generate's time."""
    ids = torch.randint(1, 4096, (1, 32), generator=torch.Generator().manual_seed(1))
    kw = dict(do_sample=False, pad_token_id=0)
    full = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    with torch.inference_mode():
        tokens = {name: m.generate(ids, **full) for name, m in models.items()}
        from kernelize.demo import median_times_ms

        fns = {}
        for name, m in models.items():
            fns[name] = functools.partial(m.generate, ids, **full)
            fns[name + "/first"] = functools.partial(m.generate, ids, max_new_tokens=1, **kw)
        both = median_times_ms(fns, repeat)
    ms = {name: both[name] for name in models}
    first = {name: both[name + "/first"] for name in models}
    per_token = {name: max(ms[name] - first[name], 1e-6) / (new_tokens - 1) for name in models}
    return {
        "new_tokens": new_tokens,
        "ms": ms,
        "first_token_ms": first,
        "ms_per_token": per_token,
        "tokens_per_s": {name: 1e3 / t for name, t in per_token.items()},
        "speedup": {name: per_token["eager"] / t for name, t in per_token.items()},
        "generate_speedup": {name: ms["eager"] / t for name, t in ms.items()},
        "tokens_equal": all(torch.equal(t, tokens["eager"]) for t in tokens.values()),
        "equal": {name: torch.equal(t, tokens["eager"]) for name, t in tokens.items()},
    }


def run_model(family: str, hidden: int, dtype_name: str, args: argparse.Namespace) -> dict:
    eager = build(family, hidden, DTYPES[dtype_name])
    fast = kernelized_copy(eager)
    import kernelize

    replaced = sorted({c.layer_name for c in kernelize.inspect(fast).values() if c.uses_kernel})
    label = f"{family} h{hidden} {dtype_name}"
    print(f"{label}: kernelized layers {', '.join(replaced)}", file=sys.stderr)
    record: dict = {"model": label, "replaced": replaced, "prefill": [], "decode": None}
    torch._dynamo.reset()  # each configuration traces afresh instead of hitting the recompile limit
    prefill_models = {"eager": eager, "kernelized": fast, "torch.compile": torch.compile(eager)}
    for batch in args.batches:
        for seq in args.seqs:
            r = bench_prefill(prefill_models, batch, seq, args.repeat)
            record["prefill"].append(r)
            cells = "  ".join(f"{v} {r['ms'][v]:8.1f} ms ({r['speedup'][v]:.2f}x)" for v in PREFILL_VARIANTS)
            print(f"  prefill b{batch} s{seq}: {cells}", file=sys.stderr)
    if args.decode:
        record["decode"] = bench_decode({"eager": eager, "kernelized": fast}, args.new_tokens, args.repeat)
        d = record["decode"]
        print(f"  decode: {d['tokens_per_s']} tokens/s, equal {d['tokens_equal']}", file=sys.stderr)
    return record


def table(records: list[dict]) -> str:
    lines = [
        "| model | batch x seq | eager ms | kernelized ms | torch.compile ms | kernelized vs eager | "
        "kernelized vs compile | max abs logit diff vs eager (kernelized / compile) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        for r in rec["prefill"]:
            ms, diff = r["ms"], {k: f"{v:.1e}" for k, v in r.get("max_abs_diff", {}).items()}
            lines.append(
                f"| {rec['model']} | {r['batch']} x {r['seq']} | {ms['eager']:.1f} | "
                f"{ms['kernelized']:.1f} | {ms['torch.compile']:.1f} | {r['speedup']['kernelized']:.2f}x | "
                f"{ms['torch.compile'] / ms['kernelized']:.2f}x | "
                f"{diff.get('kernelized', '-')} / {diff.get('torch.compile', '-')} |"
            )
    decode = [rec for rec in records if rec["decode"]]
    if decode:
        lines += [
            "",
            "| model | decode eager tok/s | kernelized tok/s | speedup | tokens equal |",
            "|---|---|---|---|---|",
        ]
        for rec in decode:
            d = rec["decode"]
            tps = d["tokens_per_s"]
            lines.append(
                f"| {rec['model']} | {tps['eager']:.1f} | {tps['kernelized']:.1f} | "
                f"{d['speedup']['kernelized']:.2f}x | {d['tokens_equal']} |"
            )
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{rec['model']}\nb{r['batch']} s{r['seq']}", r) for rec in records for r in rec["prefill"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / len(PREFILL_VARIANTS)
    for i, v in enumerate(PREFILL_VARIANTS):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["speedup"][v] for _, r in rows], width, label=v)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [label for label, _ in rows], fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("prefill speedup vs eager (median)")
    ax.set_title(f"transformers prefill on the CPU, {torch.get_num_threads()} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="llama h512 f32, batch 1, seq 512, 3 repetitions")
    p.add_argument("--families", default="llama,qwen2")
    p.add_argument("--hidden", default="512,1024")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--seqs", default="512,2048")
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 5, 3 with --quick)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-decode", dest="decode", action="store_false")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/bench")
    args = p.parse_args(argv)
    # before the first generated kernel loads: its OpenMP runtime reads OMP_NUM_THREADS once
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.families, args.hidden, args.dtypes, args.batches, args.seqs = "llama", "512", "f32", "1", "512"
        args.new_tokens = min(args.new_tokens, 16)
    args.repeat = args.repeat or (3 if args.quick else 5)
    args.batches, args.seqs = _ints(args.batches), _ints(args.seqs)
    records = [
        run_model(family, hidden, dtype, args)
        for family in args.families.split(",")
        for hidden in _ints(args.hidden)
        for dtype in args.dtypes.split(",")
    ]
    print(table(records))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"quick": args.quick, "threads": torch.get_num_threads(), "load_avg": os.getloadavg()}
    (out / "llm.json").write_text(json.dumps({**meta, "results": records}, indent=2))
    plot(records, out / "llm.png")
    print(f"wrote {out / 'llm.json'} and {out / 'llm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
