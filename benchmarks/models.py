"""The one call on every causal-LM family transformers ships, and decode / prefill speed on one per group.

1. The sweep (`--sweep`): each family's tiny random model (`kernelize.models.zoo`: its default config at
   tiny widths, 2 layers or one per layer kind), eager vs `kernelize_model` on a left-padded batch:
   served or eager (with the reasons), how many of its decoder layers run at least one generated kernel,
   the kernel layers used, and the max logit difference relative to the largest logit.
   With `--quantize FMT` (`--sweep --quantize q8_0`): `kernelize_model(model, quantize=FMT)` against the
   same packed model's own forward (`quantize_for_kernelize`), with the projections and experts modules
   packed and those left float (with the reasons).
2. Speed (`--speed`): decode (greedy `generate`, batch 1) and prefill (one forward over the prompt) of one
   family per group (Qwen2: gated MLP + RMSNorm; GPT-NeoX and GPT-2: LayerNorm + GELU MLP), at a realistic
   size, f32, 2 threads: eager, the one call and `torch.compile`, medians of interleaved repetitions.

Writes `<out>/models.json` (and prints the tables). Compare ratios within one run only.

Usage:
    python benchmarks/models.py --sweep            # a few minutes
    python benchmarks/models.py --sweep --quantize q8_0
    python benchmarks/models.py --speed [--quick]  # --quick: small models, few repetitions
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

# a family counts as served when every decoder layer runs at least one generated kernel
_LAYER_LISTS = ("layers", "h", "blocks", "layer")


def decoder_layers(model: torch.nn.Module) -> list[str]:
    """Paths of the decoder layers: the longest ModuleList named like a layer stack."""
    best: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and path.rsplit(".", 1)[-1] in _LAYER_LISTS:
            if len(module) > len(best):
                best = [f"{path}.{i}" for i in range(len(module))]
    return best


def sweep_one(model_type: str, class_name: str, quantize: str | None = None) -> dict:
    import kernelize
    from kernelize.integrations.transformers import kernelize_model
    from kernelize.models import zoo
    from kernelize.quant.model import quantize_for_kernelize

    record: dict = {"family": model_type, "class": class_name}
    try:
        eager = zoo.tiny_causal_lm(model_type, class_name)
        embedding = eager.get_input_embeddings()
        ids, mask = zoo.padded_batch(embedding.num_embeddings)
        want = zoo.logits(eager, ids, mask)
    except Exception as exc:
        return record | {"status": "skipped", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    start = time.perf_counter()
    try:
        if quantize:  # the reference: the same packed model's own forward
            own = copy.deepcopy(eager)
            summary = quantize_for_kernelize(own, quantize)
            want = zoo.logits(own, ids, mask)
            record["packed"], record["float"] = len(summary.replaced), sorted(set(summary.skipped.values()))
        fast = kernelize_model(copy.deepcopy(eager), quantize=quantize)
        got = zoo.logits(fast, ids, mask)
    except Exception as exc:  # what the sweep test forbids: recorded, never hidden
        return record | {"status": "crash", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    real = mask.bool()
    diff = ((got[real] - want[real]).abs().max() / want[real].abs().max()).item()
    choices = kernelize.inspect(fast)
    used = {p: c.layer_name for p, c in choices.items() if c.uses_kernel}
    layers = decoder_layers(fast)
    served = [any(p == layer or p.startswith(f"{layer}.") for p in used) for layer in layers]
    eager_reasons = sorted({c.reason for c in choices.values() if not c.uses_kernel and c.reason})
    experts = [c for c in choices.values() if c.layer_name == EXPERTS_LAYER]
    if experts:  # MoE: the grouped-expert kernel, or the model's experts implementation with the reason
        record["experts"] = {
            "modules": len(experts),
            "grouped_kernel": sum(c.uses_kernel for c in experts),
            "reasons": sorted({c.reason for c in experts if not c.uses_kernel}),
        }
    return record | {
        "status": "wrong" if not diff <= 1e-4 else "ok",
        "max_logit_diff": diff,
        "decoder_layers": len(layers),
        "layers_with_kernels": sum(served),
        "kernel_layers": sorted(set(used.values())),
        "eager_reasons": eager_reasons[:6],
        "seconds": round(time.perf_counter() - start, 2),
    }


EXPERTS_LAYER = "Experts"  # kernelize.model_experts.EXPERTS_LAYER (imported lazily there)


def experts_table(records: list[dict]) -> str:
    """The MoE families: experts modules on the grouped-expert kernel, or why they keep their own."""
    rows = ["| family | experts modules | grouped-expert kernel | kept their implementation because |"]
    rows.append("|---|---|---|---|")
    for r in records:
        if "experts" in r:
            e = r["experts"]
            why = "; ".join(e["reasons"]) or "-"
            rows.append(f"| {r['family']} | {e['modules']} | {e['grouped_kernel']} | {why} |")
    return "\n".join(rows)


def sweep(families: list[str] | None, quantize: str | None = None) -> list[dict]:
    from kernelize.models import zoo

    records = []
    for model_type, class_name in zoo.causal_lm_families():
        if families and model_type not in families:
            continue
        record = sweep_one(model_type, class_name, quantize)
        print(json.dumps({k: record.get(k) for k in ("family", "status", "layers_with_kernels")}), flush=True)
        records.append(record)
    return records


def sweep_table(records: list[dict]) -> str:
    rows = ["| family | class | result | layers with kernels | kernel layers | max logit diff |"]
    rows.append("|---|---|---|---|---|---|")
    for r in records:
        if r["status"] == "skipped":
            rows.append(f"| {r['family']} | {r['class']} | skipped: {r['reason'][:80]} | | | |")
            continue
        served = f"{r.get('layers_with_kernels', 0)}/{r.get('decoder_layers', 0)}"
        kernels = ", ".join(r.get("kernel_layers", []))
        diff = f"{r['max_logit_diff']:.1e}" if "max_logit_diff" in r else ""
        rows.append(f"| {r['family']} | {r['class']} | {r['status']} | {served} | {kernels} | {diff} |")
    return "\n".join(rows)


# The decoder families the coverage target counts (model types): at least one generated kernel in every
# decoder layer for >= 90% of them.
TARGET_FAMILIES = (
    *("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "gemma", "gemma2", "gemma3_text", "phi", "phi3"),
    *("gpt2", "gpt_neox", "falcon", "opt", "bloom", "stablelm", "cohere", "cohere2", "olmo", "olmo2"),
    *("olmo3", "granite", "smollm3", "starcoder2", "gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"),
    *("deepseek_v2", "deepseek_v3", "glm", "glm4", "gptj", "codegen", "gpt_bigcode", "exaone4", "helium"),
    *("ministral3", "seed_oss", "phimoe", "granitemoe", "persimmon", "nemotron_h", "xglm", "mpt"),
)


def coverage(records: list[dict]) -> tuple[list[str], list[str]]:
    """(target families with a kernel in every decoder layer, the others)."""
    by_family = {r["family"]: r for r in records}
    served, not_served = [], []
    for family in TARGET_FAMILIES:
        r = by_family.get(family, {})
        full = r.get("status") == "ok" and 0 < r.get("decoder_layers", 0) == r.get("layers_with_kernels")
        (served if full else not_served).append(family)
    return served, not_served


# ---- speed ------------------------------------------------------------------------------------------------
SPEED = {  # family -> config overrides at the realistic size (quick: a small one)
    "qwen2": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "gpt_neox": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        vocab_size=50304,
    ),
    "gpt2": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257),
    # gated RMSNorm and gated attention, three linear-attention layers (eager) to each full one: 0.70 B
    "qwen3_5_text": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=151936,
    ),
    # multi-head latent attention, 32 routed experts (top-4) and a shared one after a dense layer: 0.68 B
    "deepseek_v3": dict(
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_group=4,
        topk_group=2,
        vocab_size=32000,
    ),
}
QUICK = {
    "qwen2": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
    ),
    "gpt_neox": dict(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, vocab_size=4096
    ),
    "gpt2": dict(n_embd=256, n_layer=2, n_head=4, vocab_size=4096),
    "qwen3_5_text": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=4096,
    ),
    "deepseek_v3": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_group=2,
        topk_group=1,
        vocab_size=4096,
    ),
}


def speed_model(family: str, quick: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **(QUICK if quick else SPEED)[family])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def medians(fns: dict, repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def decode_after_prompt(models: dict, prompt: torch.Tensor, steps: int, repeat: int) -> tuple[dict, bool]:
    """Milliseconds per greedy decode step after a prefill of ``prompt`` (the prefill untimed), each model in
    turn per round, medians over rounds; and whether every model chose the same tokens."""
    from transformers import DynamicCache

    times: dict[str, list[float]] = {name: [] for name in models}
    tokens = {}
    for _ in range(repeat + 1):  # the first round warms up
        for name, m in models.items():
            cache = DynamicCache(config=m.config)
            out = m(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            chosen = [out.logits[:, -1:].argmax(-1)]
            start = time.perf_counter()
            for _ in range(steps):
                out = m(chosen[-1], past_key_values=cache, use_cache=True)
                chosen.append(out.logits[:, -1:].argmax(-1))
            times[name].append((time.perf_counter() - start) / steps)
            tokens[name] = torch.cat(chosen, dim=-1)
    same = all(torch.equal(t, tokens["eager"]) for t in tokens.values())
    return {name: statistics.median(t[1:]) for name, t in times.items()}, same


def speed(families: list[str], quick: bool, repeat: int, seq: int, new_tokens: int) -> list[dict]:
    from kernelize.integrations.transformers import kernelize_model

    records = []
    for family in families:
        eager = speed_model(family, quick)
        params = sum(p.numel() for p in eager.parameters())
        fast = kernelize_model(copy.deepcopy(eager))
        compiled = torch.compile(copy.deepcopy(eager))
        vocab = eager.get_input_embeddings().num_embeddings
        prompt = torch.randint(1, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
        short = prompt[:, :16]
        models = {"eager": eager, "kernelize": fast, "torch.compile": compiled}

        def prefill(m, prompt=prompt):
            return lambda: m(prompt, logits_to_keep=1)

        def decode(m, short=short):
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            return lambda: m.generate(short, **kw)

        with torch.no_grad():
            for m in models.values():  # warm up: compile kernels and graphs
                prefill(m)()
                decode(m)()
            same = torch.equal(decode(eager)(), decode(fast)())
            pre = medians({n: prefill(m) for n, m in models.items()}, repeat)
            dec = medians(
                {n: decode(m) for n, m in models.items() if n != "torch.compile"}, max(repeat // 2, 2)
            )
            two = {n: models[n] for n in ("eager", "kernelize")}
            after, same_after = decode_after_prompt(two, prompt, min(new_tokens, 16), max(repeat // 2, 2))
        record = {
            "family": family,
            "parameters": params,
            "prefill_seq": seq,
            "prefill_s": pre,
            "decode_tokens": new_tokens,
            "decode_s": dec,
            "prefill_vs_eager": pre["eager"] / pre["kernelize"],
            "prefill_vs_compile": pre["torch.compile"] / pre["kernelize"],
            "decode_vs_eager": dec["eager"] / dec["kernelize"],
            "same_tokens": same,
            "decode_after_prompt_s": after,  # per step, after a prefill of the `prefill_seq` prompt
            "decode_after_prompt_vs_eager": after["eager"] / after["kernelize"],
            "same_tokens_after_prompt": same_after,
        }
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


def speed_table(records: list[dict]) -> str:
    rows = [
        "| family | parameters | prefill vs eager | prefill vs compile | decode vs eager "
        "| decode after the prompt vs eager | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        after = r.get("decode_after_prompt_vs_eager")
        same = r["same_tokens"] and r.get("same_tokens_after_prompt", True)
        rows.append(
            f"| {r['family']} | {r['parameters'] / 1e6:.0f} M | {r['prefill_vs_eager']:.2f}x "
            f"| {r['prefill_vs_compile']:.2f}x | {r['decode_vs_eager']:.2f}x "
            f"| {'-' if after is None else f'{after:.2f}x'} | {same} |"
        )
    return "\n".join(rows)


DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def quantized_table(records: list[dict]) -> str:
    """The `--quantize` sweep: per result, the families, and the reasons layers stayed float."""
    rows = ["| result | classes | families |", "|---|---|---|"]
    for status in ("ok", "wrong", "crash", "skipped"):
        names = [r["family"] for r in records if r["status"] == status]
        if names:
            rows.append(f"| {status} | {len(names)} | {', '.join(names)} |")

    # the kinds of reason: sizes and names as N and X, a gate form's parameters left out
    def kind(why: str) -> str:
        why = re.sub(r" \(.*\)$", "", why.split(":")[0])
        return re.sub(r"uses \w+\.weight", "uses X.weight", re.sub(r"\b\d+\b", "N", why))

    reasons = sorted({kind(why) for r in records for why in r.get("float", [])})
    return "\n".join(rows) + "\n\nLayers left float because: " + ("; ".join(reasons) or "none") + "."


def docs_page(result: dict) -> str:
    """docs/models.md, generated from models.json (never typed by hand; a test compares the two)."""
    records = result.get("sweep", [])
    served, not_served = coverage(records)
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "wrong", "crash", "skipped")}
    versions, commands = result.get("versions", {}), result.get("commands", {})
    lines = [
        "# Models: the one call on every causal-LM family",
        "",
        "<!-- generated by `python benchmarks/models.py --docs` from benchmarks/results/models.json -->",
        "",
        "`kernelize_model(model)` recognises a model's layers by structure, swaps in kernel layers, and then",
        "verifies each swap on a probe forward (the module's own forward against the kernel's, and the whole",
        "model's output before and after): a kernel that raises or differs is withdrawn, with the reason in",
        "`kernelize.inspect(model)`. The sweep below runs it on a tiny random model of every `*ForCausalLM`",
        "class transformers ships (`kernelize.models.zoo`; `tests/integrations/test_sweep.py` runs the same",
        "in `make test`), on a left-padded batch, f32.",
        "",
        f"- Measured with: `{commands.get('sweep', '')}` (transformers {versions.get('transformers', '?')}, "
        f"torch {versions.get('torch', '?')})"
        + "".join(f"; families re-run since with `{c}`" for c in commands.get("sweep_updates", []))
        + ".",
        f"- {len(records)} classes: {counts['ok']} equal logits (max difference <= 1e-4 of the largest "
        "logit), "
        f"{counts['wrong']} changed, {counts['crash']} crashed, {counts['skipped']} skipped (transformers "
        "cannot build or run their tiny config, or they take no token ids).",
        f"- Decoder families of the coverage list with a generated kernel in every decoder layer: "
        f"{len(served)} of {len(TARGET_FAMILIES)} ({100 * len(served) / len(TARGET_FAMILIES):.0f}%).",
        f"  Served: {', '.join(served)}.",
        f"  Not (yet): {', '.join(not_served) or 'none'}.",
        "",
        "## Every family",
        "",
        sweep_table(records),
        "",
        "## Mixture-of-experts families",
        "",
        "Experts modules built on transformers' experts interface run the generated grouped-expert",
        "kernel (`kernelize.model_experts`: the (token, slot) pairs sorted by expert, each selected",
        "expert's MLP over its tokens, the weighted combine fused) unless their layout is one the kernel",
        "lacks (the sweep runs on the CPU; on a GPU the one call keeps transformers' `grouped_mm`, measured",
        "faster on an H200, unless `KERNELIZE_GPU_EXPERTS=1`):",
        "",
        experts_table(records),
        "",
    ]
    quantized = result.get("sweep_quantized")
    if quantized:
        recs = quantized["records"]
        ok = sum(r["status"] == "ok" for r in recs)
        lines += [
            f'## Packed weights: `kernelize_model(model, quantize="{quantized["format"]}")`',
            "",
            f"Measured with `{quantized['command']}`: the same tiny models, the one call with `quantize=`",
            "against the packed model's own forward (`quantize_for_kernelize`): every projection and experts",
            "module packed but for the kinds of layer below, left float with the reason; skipped: as above.",
            f"{ok} of {len(recs)} classes give their packed model's logits (max difference <= 1e-4 of the",
            "largest logit).",
            "",
            quantized_table(recs),
            "",
        ]
    if result.get("speed"):
        lines += [
            "## Speed (CPU, f32, 2 threads)",
            "",
            f"Measured with {speed_commands(result['speed'])}: decode is",
        ]
        lines += [
            "greedy `generate` of 32 tokens after 16, batch 1; prefill one forward over 512 tokens; decode",
            "after the prompt: the mean greedy step of 16 after that 512-token prefill (untimed), where the",
            "cache is long (families measured before this column have none). Ratios within one run (medians",
            "of interleaved repetitions).",
            "",
            speed_table(result["speed"]),
            "",
        ]
    return "\n".join(lines)


def speed_commands(records: list[dict]) -> str:
    """Each command that measured speed rows, with its families (rows from before commands were kept per
    row: "an earlier run")."""
    families: dict[str, list[str]] = {}
    for r in records:
        families.setdefault(r.get("command", ""), []).append(r["family"])
    return "; ".join(
        f"`{command}` ({', '.join(names)})" if command else f"an earlier run ({', '.join(names)})"
        for command, names in families.items()
    )


def write_docs(result: dict) -> None:
    DOCS.parent.mkdir(exist_ok=True)
    DOCS.write_text(docs_page(result))
    print(f"wrote {DOCS}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="the one call on every causal-LM family")
    parser.add_argument("--speed", action="store_true", help="decode / prefill of one family per group")
    parser.add_argument("--families", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--quick", action="store_true", help="speed: small models, few repetitions")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--docs", action="store_true", help="write docs/models.md from the JSON")
    parser.add_argument("--quantize", default="", help="sweep: kernelize_model(quantize=FMT) instead")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    families = [f for f in args.families.split(",") if f]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "models.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    if not (args.sweep or args.speed):
        if args.docs:
            write_docs(result)
        return 0
    if args.sweep and args.quantize:  # its own record: the packed model's one call against its own forward
        fresh = sweep(families, args.quantize)
        command = " ".join(["python", *sys.argv])
        result["sweep_quantized"] = {"format": args.quantize, "command": command, "records": fresh}
        result["sweep_quantized"]["date"] = time.strftime("%Y-%m-%d")
        print(quantized_table(fresh))
        path.write_text(json.dumps(result, indent=1))
        if args.docs:
            write_docs(result)
        return 0
    result["machine"] = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "threads": args.threads,
    }
    result["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    command = " ".join(["python", *sys.argv])
    result["date"] = time.strftime("%Y-%m-%d")
    if args.sweep:
        fresh = sweep(families)
        # with --families, the other families keep their records, in the sweep's order
        key = lambda r: (r["family"], r["class"])  # noqa: E731
        kept = {key(r): r for r in result.get("sweep", []) if families}
        result["sweep"] = sorted((kept | {key(r): r for r in fresh}).values(), key=key)
        # a partial re-run is merged: the docs name it beside the whole sweep's command
        commands = result.setdefault("commands", {})  # partial re-runs merge: the docs name each of them
        if families:
            commands["sweep_updates"] = [*commands.get("sweep_updates", []), command]
        else:
            commands["sweep"], commands["sweep_updates"] = command, []
        print(sweep_table(result["sweep"]))
    if args.speed:
        result.setdefault("commands", {})["speed"] = command
        fresh = speed(families or list(SPEED), args.quick, args.repeat, args.seq, args.new_tokens)
        for r in fresh:
            r["date"], r["command"] = result["date"], command
        # families not re-run keep their records (each record's ratios come from one side-by-side run)
        kept = [r for r in result.get("speed", []) if r["family"] not in {f["family"] for f in fresh}]
        result["speed"] = kept + fresh
        print(speed_table(result["speed"]))
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    if args.docs:
        write_docs(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
