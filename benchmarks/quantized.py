"""Packed-weight decode: the q8_0 / q4_0 / q4_k / q6_k / int8 kernels against bf16, and decode tok/s of a
small Llama.

    .venv/bin/python benchmarks/quantized.py [--threads 2] [--repeat 21] [--parts matmul,model]

Part 1 (``matmul``): ``y = x @ W.T`` with x [1, 4096] and W [11008, 4096] (a 7B MLP projection), timed
round-robin in one run: ``F.linear`` on bf16, ``kernelize.quant.linear`` per format, and ``torch.sum`` over
1 GiB of f32 (one read of every byte: its bandwidth is the yardstick). Medians; GB/s = weight bytes (packed
bytes plus scales) / time. Part 2 (``model``): a random-weight LlamaForCausalLM (hidden 1024, 8 layers,
intermediate 2816, vocab 32000) in bf16, eager against ``quantize_model(copy, fmt)``: greedy decode tok/s
(32 new tokens, the prompt's prefill subtracted) and, on an 8-token prompt (the decode kernel's rows), the
cosine of the logits and the agreement of the argmax with the bf16 model. Writes
``benchmarks/results/quantized.json``.

Part 3 (``kernelize``, its own JSON ``benchmarks/results/quantized_kernelize.json``): a random-weight Llama
(hidden 1536, 8 layers, intermediate 4096, vocab 32000) in bf16: greedy decode tok/s of the eager model,
``kernelize_model(model)`` and ``kernelize_model(model, quantize=fmt)`` for each of ``PACKED``; the q8_0
model saved with ``kernelize.integrations.gguf.save`` and loaded back in a fresh process (its RSS increase
against the file size, and its tok/s); and, when ``llama_cpp`` (llama-cpp-python) imports, llama.cpp's
tok/s on each format's file (else the JSON says "llama.cpp not installed"), timed in the same round robin as
the torch models (`generate` of exactly 32 tokens less `generate` of 1, no end-of-sequence token, medians of
5 rounds), so that the machine's swings hit both alike; then prompt processing (one forward over 512
tokens, llama.cpp's evaluation of the same tokens) in a round robin of its own. The machine's load average
is recorded before and after.

    .venv/bin/python benchmarks/quantized.py --parts kernelize

Part 4 (``qwen``, its own JSON ``benchmarks/results/quantized_qwen.json``): a random-weight Qwen2.5-0.5B
layout (``Qwen2ForCausalLM``: hidden 896, 24 layers, 14 heads, 2 key/value heads, intermediate 4864, q/k/v
biases, vocab 151936, tied embeddings) in bf16, its projections packed as llama.cpp's ``Q4_K_M`` packs them
(``q5_0`` where K = 896 is not a multiple of 256, ``q4_k`` for down_proj, a ``q8_0`` head), saved with
``gguf.save`` and loaded back with ``gguf.load`` + ``kernelize_model``: decode and prompt tok/s against
llama.cpp on the same file in one round robin, and the logits' cosine. A case the kernels were not tuned on.

    .venv/bin/python benchmarks/quantized.py --parts qwen
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernelize import quant

sys.path.insert(0, str(Path(__file__).parent))
from decode import interleaved  # noqa: E402

RESULTS = Path(__file__).parent / "results"
FORMATS = ("q8_0", "q4_0", "q5_0", "q4_k", "q6_k", "int8")


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


def greedy(m: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy `generate` of exactly `n` tokens, as llama.cpp's loop is timed: the model gets no
    end-of-sequence token (random weights may emit it), so `generate` runs no min-length logits processor
    (`min_new_tokens`' `isin` over the 32,000-token vocabulary cost ~0.4 ms of every token)."""
    m.generation_config.eos_token_id = None
    out = m.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == prompt.shape[1] + n, "generate stopped early"
    return out


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
        return greedy(m, prompt, n)

    out: dict = {"config": "llama hidden 1024, 8 layers, intermediate 2816, vocab 32000, bf16", "new": new}
    with torch.inference_mode():
        logits = {name: m(prompt).logits.float()[0] for name, m in variants.items()}
        tokens = {name: gen(m, new) for name, m in variants.items()}
        fns = {}
        for name, m in variants.items():
            fns[name + "/full"] = lambda m=m: gen(m, new)
            fns[name + "/prefill"] = lambda m=m: gen(m, 1)
        med = interleaved(fns, repeat, inner=1)
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


KERNELIZE_CONFIG = {
    "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 12,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 512,
}  # fmt: skip


def _decode_tok_s(models: dict, new: int, repeat: int, others: dict | None = None) -> dict[str, float]:
    """Greedy decode tok/s of each model: `new` tokens after an 8-token prompt, less the prefill; `others`:
    name -> run(n) generating n tokens some other way (llama.cpp), timed in the same round robin."""
    prompt = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(0))

    def gen(m: torch.nn.Module, n: int) -> torch.Tensor:
        return greedy(m, prompt, n)

    fns = {}
    for name, m in models.items():
        fns[name + "/full"] = lambda m=m: gen(m, new)
        fns[name + "/prefill"] = lambda m=m: gen(m, 1)
    for name, run in (others or {}).items():
        fns[name + "/full"] = lambda run=run: run(new)
        fns[name + "/prefill"] = lambda run=run: run(1)
    with torch.inference_mode():
        med = interleaved(fns, repeat, inner=1)
    names = [*models, *(others or {})]
    return {name: (new - 1) / (med[name + "/full"] - med[name + "/prefill"]) for name in names}


PROMPT = 512  # prompt tokens of the prompt-processing figure
PACKED = ("q8_0", "q4_0", "q4_k")  # the formats of part 3, each against llama.cpp on the same file


def _prompt_tok_s(models: dict, repeat: int, others: dict | None = None) -> dict[str, float]:
    """Prompt processing tok/s of each model: one forward over a `PROMPT`-token prompt (the last position's
    logits, as `generate`'s prefill computes them); `others`: name -> run(tokens), timed in the same round
    robin (llama.cpp's evaluation of the same prompt)."""
    ids = torch.randint(3, 32000, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    fns = {name: lambda m=m: m(ids, logits_to_keep=1) for name, m in models.items()}
    fns.update({name: lambda run=run: run(ids[0].tolist()) for name, run in (others or {}).items()})
    with torch.inference_mode():
        med = interleaved(fns, repeat, inner=1)
    return {name: PROMPT / t for name, t in med.items()}


# run in a fresh process: the RSS a gguf.load adds, against the file's size, and the loaded model's tok/s
_LOAD_SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from benchmarks.quantized import _decode_tok_s, _rss
from kernelize.integrations import gguf
torch.set_num_threads(int(sys.argv[2]))
before = _rss()
model = gguf.load(sys.argv[1], dtype=torch.bfloat16)
loaded = _rss()
with torch.inference_mode():
    model(torch.zeros(1, 1, dtype=torch.long))
after_forward = _rss()
tok_s = _decode_tok_s({"gguf": model}, 32, 3)["gguf"]
print(json.dumps({"rss_before_MB": before / 1e6, "rss_load_MB": (loaded - before) / 1e6,
                  "rss_load_and_forward_MB": (after_forward - before) / 1e6, "tok_s": tok_s}))
"""


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _llama_cpp(path: str, threads: int, prompt: list[int], ours: torch.Tensor) -> tuple[dict, Any]:
    """llama.cpp on the GGUF file: ``(what it gave: status, the cosine of its last-position logits on
    ``prompt`` with ``ours`` (the kernelized model the file was saved from), whether the argmax agrees;
    run(n) generating n greedy tokens, or None)``."""
    try:
        import llama_cpp
    except ImportError:
        return {"status": "llama.cpp not installed (pip install llama-cpp-python to compare)"}, None
    crashed = _llama_cpp_crashes(path, threads, prompt)
    if crashed:
        return {"status": crashed}, None
    try:
        llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_ctx=64, logits_all=True, verbose=False)
    except (ValueError, RuntimeError) as exc:  # the file is not one llama.cpp loads: that is the finding
        return {"status": f"llama.cpp did not load the file: {type(exc).__name__}: {exc}"}, None
    llm.eval(prompt)
    theirs = torch.tensor(llm.scores[len(prompt) - 1]).float()
    cosine = torch.nn.functional.cosine_similarity(theirs, ours, dim=0).item()

    def run(n: int) -> None:
        llm.reset()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0)):
            if i + 1 >= n:
                break

    long = llama_cpp.Llama(
        model_path=path, n_threads=threads, n_ctx=PROMPT + 32, n_batch=PROMPT, verbose=False
    )

    def prompt_run(tokens: list[int]) -> None:  # one prompt's evaluation (llama.cpp's prompt tok/s)
        long.reset()
        long.eval(tokens)

    run.prompt = prompt_run
    same = int(theirs.argmax()) == int(ours.argmax())
    return {"status": "ran", "logits_cosine": cosine, "same_argmax": same}, run


def _llama_cpp_crashes(path: str, threads: int, prompt: list[int]) -> str | None:
    """Why llama.cpp cannot be timed in this process, or None: it evaluates ``prompt`` on the file once in a
    child process first, since a crash in its native code would end the benchmark and lose every figure
    (llama-cpp-python 0.3.36's default build segfaulted in its AMX matmul on an AMX Xeon)."""
    code = (
        "import sys, llama_cpp\n"
        "llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=64, verbose=False)\n"
        "llm.eval([int(t) for t in sys.argv[3:]])\n"
    )
    args = [sys.executable, "-c", code, path, str(threads), *map(str, prompt)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode >= 0:  # loaded and ran, or raised (the in-process load reports that)
        return None
    return (
        f"llama.cpp crashed evaluating the file (signal {-done.returncode}); if its build uses AMX, rebuild "
        "llama-cpp-python with CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
        "-DGGML_AVX512_BF16=ON' (AMX off)"
    )


def _load_fresh(path: str, threads: int) -> dict:
    """``gguf.load`` of the file in a fresh process: its RSS increase against the file size, its tok/s."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, path, str(threads), root],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    loaded["rss_load_over_file"] = loaded["rss_load_MB"] / (os.path.getsize(path) / 1e6)
    return loaded


def bench_kernelize(threads: int, repeat: int = 5, new: int = 32) -> dict:
    import transformers

    from kernelize.integrations import gguf
    from kernelize.integrations.transformers import kernelize_model

    config = transformers.LlamaConfig(**KERNELIZE_CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)
    models = {"bf16_eager": base}
    for fmt in (None, *PACKED):
        models[f"{fmt or 'bf16'}_kernelize"] = copy.deepcopy(base)
    setup = {}
    for fmt in (None, *PACKED):
        name = f"{fmt or 'bf16'}_kernelize"
        t0 = time.perf_counter()
        kernelize_model(models[name], quantize=fmt)
        setup[name] = time.perf_counter() - t0
    out: dict = {"config": {**KERNELIZE_CONFIG, "dtype": "bfloat16"}, "new": new, "threads": threads}
    prompt = torch.arange(3, 11).view(1, -1)  # the prompt llama.cpp is given below (token ids, no BOS)
    with torch.no_grad():
        ours = {f: models[f"{f}_kernelize"](prompt).logits[0, -1].float() for f in PACKED}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for fmt in PACKED:
            path = os.path.join(tmp, f"llama-{fmt}.gguf")
            t0 = time.perf_counter()
            gguf.save(models[f"{fmt}_kernelize"], path)
            out[f"gguf_{fmt}"] = {"save_s": time.perf_counter() - t0, "file_MB": os.path.getsize(path) / 1e6}
            out[f"llama_cpp_{fmt}"], run = _llama_cpp(path, threads, prompt[0].tolist(), ours[fmt])
            if run is not None:
                runs[f"llama_cpp_{fmt}"] = run
        # every variant, llama.cpp's too, timed round robin in one loop: the machine's swings hit all alike
        out["load_avg_before"] = os.getloadavg()
        tok_s = _decode_tok_s(models, new, repeat, runs)
        out["load_avg_after"] = os.getloadavg()
        for name, value in tok_s.items():
            if name.startswith("llama_cpp"):
                out[name]["tok_s"] = value
                ratio = out[name]["kernelize_vs_llama_cpp"] = (
                    tok_s[name.replace("llama_cpp", "")[1:] + "_kernelize"] / value
                )
                print(f"{name:15} {value:7.2f} tok/s (kernelize {ratio:.2f}x)", flush=True)
                continue
            out[name] = {"tok_s": value, "vs_bf16_eager": value / tok_s["bf16_eager"]}
            if name in setup:
                out[name]["kernelize_model_s"] = setup[name]
            print(f"{name:15} {value:7.2f} tok/s ({value / tok_s['bf16_eager']:.2f}x eager bf16)", flush=True)
        packed = {
            f"{fmt or 'bf16'}_kernelize": models[f"{fmt or 'bf16'}_kernelize"] for fmt in (None, *PACKED)
        }
        prompt_tok_s = _prompt_tok_s(packed, repeat, {name: run.prompt for name, run in runs.items()})
        for name, value in prompt_tok_s.items():
            out[name]["prompt_tok_s"] = value
            out[name]["prompt_vs_bf16_kernelize"] = value / prompt_tok_s["bf16_kernelize"]
            print(f"{name:15} prompt-{PROMPT} {value:7.1f} tok/s", flush=True)
        del models, runs, packed
        out["gguf_q8_0"]["load"] = _load_fresh(os.path.join(tmp, "llama-q8_0.gguf"), threads)
        print(f"gguf q8_0       {out['gguf_q8_0']}", flush=True)
    return out


QWEN_CONFIG = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
    rope_theta=1e6,
)  # fmt: skip


def bench_qwen(threads: int, repeat: int = 5, new: int = 32) -> dict:
    """Part 4 (module docstring): the Qwen2.5-0.5B layout as a Q4_K_M-style GGUF file, against llama.cpp."""
    import transformers

    from kernelize.integrations import gguf
    from kernelize.integrations.transformers import kernelize_model
    from kernelize.quant.module import QuantizedLinear

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN_CONFIG)).eval().to(torch.bfloat16)
    formats = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            fmt = "q8_0" if name == "lm_head" else "q4_k" if mod.in_features % 256 == 0 else "q5_0"
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, QuantizedLinear.from_linear(mod, fmt))
            formats[fmt] = formats.get(fmt, 0) + 1
    out: dict = {"config": QWEN_CONFIG, "formats": formats, "new": new, "threads": threads}
    prompt = torch.arange(3, 11).view(1, -1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "qwen2.5-0.5b-layout.gguf")
        gguf.save(model, path)
        out["file_MB"] = os.path.getsize(path) / 1e6
        del model
        ours = kernelize_model(gguf.load(path, dtype=torch.bfloat16))
        with torch.no_grad():
            logits = ours(prompt).logits[0, -1].float()
        out["llama_cpp"], run = _llama_cpp(path, threads, prompt[0].tolist(), logits)
        if run is None:
            return out
        out["load_avg_before"] = os.getloadavg()
        tok_s = _decode_tok_s({"kernelize": ours}, new, repeat, {"llama_cpp": run})
        prompt_tok_s = _prompt_tok_s({"kernelize": ours}, repeat, {"llama_cpp": run.prompt})
        out["load_avg_after"] = os.getloadavg()
    for name in ("kernelize", "llama_cpp"):
        out[name] = {**out.get(name, {}), "tok_s": tok_s[name], "prompt_tok_s": prompt_tok_s[name]}
    out["decode_vs_llama_cpp"] = tok_s["kernelize"] / tok_s["llama_cpp"]
    out["prompt_vs_llama_cpp"] = prompt_tok_s["kernelize"] / prompt_tok_s["llama_cpp"]
    print(f"qwen2.5-0.5b layout: {json.dumps(out, default=str)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--parts", default="matmul,model", help="any of matmul, model, kernelize, qwen")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {
        "threads": args.threads,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_avg_before": Path("/proc/loadavg").read_text().split()[:3],
    }
    parts = args.parts.split(",")
    if "qwen" in parts:  # its own file too
        RESULTS.mkdir(parents=True, exist_ok=True)
        qwen = {**result, "qwen": bench_qwen(args.threads)}
        (RESULTS / "quantized_qwen.json").write_text(json.dumps(qwen, indent=1))
        parts.remove("qwen")
        if not parts:
            return
    if "kernelize" in parts:  # its own file: the matmul / model parts' JSON stays as it was measured
        result["kernelize"] = bench_kernelize(args.threads)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "quantized_kernelize.json").write_text(json.dumps(result, indent=1))
        if parts == ["kernelize"]:
            return
    if "matmul" in parts:
        result["matmul"] = bench_matmul(args.repeat)
    if "model" in parts:
        result["model"] = bench_model(max(3, args.repeat // 4))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quantized.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
