"""Render the performance tables of README.md and docs/*.md from benchmarks/results/*.json.

A generated table sits between two markers in a page; the name says which JSON and which view of it:

    <!-- table: models.json:speed -->
    | family | ... |
    <!-- end table -->

`python benchmarks/report.py` rewrites every such table in place, and docs/models.md through
`benchmarks/models.py`'s own renderer (`docs_page`), so there is one entry point for every generated number.
`--check` writes nothing and exits 1, listing every table that differs from its JSON. A table whose JSON is
absent keeps its text, with one line under it naming the command that writes the JSON. `--root DIR` works
on another copy of the pages (README.md, docs/ and benchmarks/results/ under DIR).

Usage:
    python benchmarks/report.py            # rewrite the tables
    python benchmarks/report.py --check    # exit 1 if a table differs from its JSON
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ABSENT = "Not in benchmarks/results yet:"
MARKED = re.compile(r"(<!-- table: (\S+) -->\n)(.*?)(<!-- end table -->)", re.DOTALL)


def bench(name: str):
    """A benchmark script imported as a module, for its own table renderer (lazily: they import torch)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


def span(values: list[float], unit: str = "x") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}{unit}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}{unit}"


# ---- renderers for the benchmarks that print but have no table function of their own ------------------
def md(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def demo_table(r: dict) -> str:
    c, t = r["config"], r["timings_ms"]
    head = ["model", "eager ms", "kernelized ms", "torch.compile ms", "vs eager", "vs torch.compile"]
    row = [f"LlamaDemo h{c['hidden']}, {c['layers']} layers, batch {c['batch']} x seq {c['seq']}"]
    row += [f"{t[k]:.1f}" for k in ("eager", "kernelized", "torch.compile")]
    row += [f"{t['eager'] / t['kernelized']:.2f}x", f"{t['torch.compile'] / t['kernelized']:.2f}x"]
    return md([*head, "max abs diff"], [[*row, f"{r['max_abs_diff']:.1e}"]])


def attention_table(r: dict) -> str:
    rows = [
        [x["case"], f"{x['sdpa'] * 1e3:.3f}", f"{x['kernelize'] * 1e3:.3f}", f"{x['ratio']:.2f}x"]
        + [f"{x['max_abs_err']:.1e}"]
        for x in r["rows"]
    ]
    return md(["case", "SDPA ms", "kernelize ms", "ratio", "max abs error"], rows)


def gemv_table(r: dict) -> str:
    head = ["dtype", "weight MB", "rows", "kernel ms", "GB/s", "F.linear ms", "GB/s", "sum ms", "GB/s"]
    rows = []
    for g in r["gemv"]:
        row = [g["dtype"], str(g["weight_mb"]), str(g["rows"])]
        for k in ("kernel", "F.linear", "sum"):
            row += [f"{g[k + '_ms']:.2f}", f"{g[k + '_gbs']:.1f}"]
        rows.append([*row, f"{g['kernel_vs_sum']:.2f}", f"{g['kernel_vs_linear']:.2f}x"])
    return md([*head, "kernel / sum", "vs F.linear"], rows)


def decode_model_table(r: dict) -> str:
    names = [n.removesuffix("_tok_s") for n in r["model"][0] if n.endswith("_tok_s")]
    head = ["model", "batch", *(f"{n} tok/s" for n in names), *(f"{n} vs eager" for n in names[1:])]
    rows = []
    for m in r["model"]:
        same = m["same_tokens_as_eager"]
        row = [f"{m['family']} h{m['hidden']} {m['dtype']}", str(m["batch"])]
        row += [f"{m[n + '_tok_s']:.1f}" for n in names] + [f"{m[n + '_vs_eager']:.2f}x" for n in names[1:]]
        rows.append([*row, ", ".join(f"{n}: {'yes' if same[n] else 'no'}" for n in names[1:])])
    return md([*head, "same tokens as eager"], rows)


def onnx_table(r: dict) -> str:
    threads = any("threads" in x for x in r["rows"])
    openvino = any("ratio_vs_openvino" in x for x in r["rows"])
    head = ["model", "batch", *(["threads"] if threads else []), "kernelize ms", "onnxruntime ms"]
    head += ["kernelize / ort", *(["kernelize / OpenVINO"] if openvino else []), "kernelize / eager"]
    cpus = any("cpu" in x for x in r["rows"])  # rows merged from runs on several machines say which
    rows = []
    for x in r["rows"]:
        row = [x["model"], str(x["batch"]), *([str(x.get("threads", "-"))] if threads else [])]
        row += [f"{x['kernelize_ms']:.1f}", f"{x['onnxruntime_ms']:.1f}", f"**{x['ratio_vs_ort']:.2f}**"]
        row += [f"{x['ratio_vs_openvino']:.2f}" if "ratio_vs_openvino" in x else "-"] if openvino else []
        row += [f"{x['ratio_vs_eager']:.2f}", f"{x['rel_diff_vs_ort']:.1e}"]
        row.append(f"{x['cold_s']:.1f} / {x['warm_s']:.2f}" if "cold_s" in x else "-")
        rows.append([*row, x.get("cpu", "-")] if cpus else row)
    for batch, s in r.get("summary", {}).items():
        row = [f"geomean, {batch}", "", *([str(s.get("threads", ""))] if threads else []), "", ""]
        ov = [f"{s['geomean_vs_openvino']:.2f}" if "geomean_vs_openvino" in s else "-"] if openvino else []
        row += [f"**{s['geomean_vs_ort']:.2f}**", *ov]
        rows.append([*row, f"worst {s['worst_vs_ort']:.2f}", "", "", *([""] if cpus else [])])
    return md([*head, "rel. diff vs ort", "cold / warm load s", *(["CPU"] if cpus else [])], rows)


def load_table(r: dict) -> str:
    """Seconds from the ONNX file to the first output, cold (empty caches) and warm, per model."""
    rows = [[x["model"], str(x["batch"]), f"{x['cold_s']:.1f}", f"{x['warm_s']:.2f}"] for x in r["rows"]]
    meta = r.get("meta", {})
    note = f"\n\n{meta.get('threads', '?')} threads, {meta.get('cpu', '?')}, torch {meta.get('torch', '?')}."
    return md(["model", "batch", "cold s", "warm s"], rows) + note


def threads_table(r: dict) -> str:
    rows = []
    for model, runs in r["models"].items():
        base = {e: runs[0][f"{e}_ms"] for e in ("kernelize", "onnxruntime")}
        for x in runs:
            row = [model, str(x["threads"]), f"{x['kernelize_ms']:.1f}", f"{x['onnxruntime_ms']:.1f}"]
            row += [f"{base[e] / x[f'{e}_ms']:.2f}x" for e in ("kernelize", "onnxruntime")]
            rows.append(row + [f"**{x['kernelize_ms'] / x['onnxruntime_ms']:.2f}**"])
    head = ["model", "threads", "kernelize ms", "onnxruntime ms", "kernelize scaling", "ort scaling"]
    return (
        md([*head, "kernelize / ort"], rows) + f"\n\nbatch {r['batch']}, on {r.get('machine', 'this host')}."
    )


def gpu_timings(section: dict) -> dict[str, tuple[dict[str, float], float | None]]:
    """A GPU-check section's timings: label -> (median ms per variant, max relative difference)."""
    diff = next(
        (section[k] for k in ("max_rel_diff", "max_rel_grad_diff", "max_rel_logit_diff") if k in section),
        None,
    )
    if "backends" in section:
        return {f"({b})": (x["ms"], x.get("max_rel_diff")) for b, x in section["backends"].items()}
    parts = {p: section[f"{p}_ms"] for p in ("prefill", "decode") if f"{p}_ms" in section}
    if parts:
        return {p: (ms, diff if p == "prefill" else None) for p, ms in parts.items()}
    return {"": (section.get("ms", {}), diff)}


def speedup(ms: dict[str, float]) -> float | None:
    """The baseline's time (eager, or torch's SDPA) over kernelize's."""
    base = ms.get("eager", ms.get("sdpa"))
    return base / ms["kernelize"] if base and ms.get("kernelize") else None


def gpu_table(sections: dict) -> str:
    first = next(iter(sections.values()))
    machine = first.get("machine", {})
    rows = []
    for name, s in sections.items():
        if not s["ok"]:
            rows.append([name, "failed", s.get("error", "")[:100], "", ""])
            continue
        for label, (ms, diff) in gpu_timings(s).items():
            times = ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
            x = speedup(ms)
            rows.append([f"{name} {label}".strip(), "ok", times, "-" if x is None else f"{x:.2f}x"])
            rows[-1].append("-" if diff is None else f"{diff:.1e}")
    head = ["section", "result", "median ms", "kernelize speedup", "max relative difference"]
    caption = f"{machine.get('gpu', '?')}, torch {machine.get('torch', '?')}:"
    return caption + "\n\n" + md(head, rows)


def quantized_table(r: dict) -> str:
    """Packed-weight decode (benchmarks/quantized.py --parts kernelize): tok/s per variant, against eager bf16
    and against llama.cpp on the same GGUF file, with the logits' agreement."""
    k = r["kernelize"]
    rows = []
    for name in ("bf16_eager", "bf16_kernelize", *(f"{f}_kernelize" for f in ("q8_0", "q4_0", "q4_k"))):
        if name not in k:
            continue
        fmt = name.split("_kernelize")[0]
        cpp = k.get(f"llama_cpp_{fmt}", {})
        label = name.replace("_kernelize", " kernelize").replace("_eager", " eager")
        row = [label, f"{k[name]['tok_s']:.1f}", f"**{k[name]['vs_bf16_eager']:.2f}x**"]
        row += [f"{cpp['tok_s']:.1f}" if "tok_s" in cpp else cpp.get("status", "-")[:60]]
        row += [f"**{cpp['kernelize_vs_llama_cpp']:.2f}x**" if "kernelize_vs_llama_cpp" in cpp else "-"]
        row += [f"{cpp['logits_cosine']:.4f}" if "logits_cosine" in cpp else "-"]
        ours, theirs = k[name].get("prompt_tok_s"), cpp.get("prompt_tok_s")
        row += [f"{ours:.0f}" if ours else "-", f"{theirs:.0f}" if theirs else "-"]
        rows.append(row)
    head = ["model", "decode tok/s", "vs eager bf16", "llama.cpp tok/s (same file)", "vs llama.cpp"]
    head += ["logits cosine vs llama.cpp", "prompt-512 tok/s", "llama.cpp prompt-512 tok/s"]
    caption = f"{k['threads']} threads, random-weight Llama hidden {k['config']['hidden_size']}"
    return caption + ":\n\n" + md(head, rows)


def quantized_qwen_table(r: dict) -> str:
    """A Qwen2.5-0.5B layout as a Q4_K_M-style GGUF file (benchmarks/quantized.py --parts qwen): ours against
    llama.cpp on the same file."""
    q = r["qwen"]
    rows = []
    for name, label in (("kernelize", "gguf.load + kernelize_model"), ("llama_cpp", "llama.cpp")):
        if "tok_s" in q.get(name, {}):
            rows.append([label, f"{q[name]['tok_s']:.1f}", f"{q[name]['prompt_tok_s']:.0f}"])
    if "decode_vs_llama_cpp" in q:
        ratios = (f"**{q['decode_vs_llama_cpp']:.2f}x**", f"**{q['prompt_vs_llama_cpp']:.2f}x**")
        rows.append(["ours / llama.cpp", *ratios])
    formats = ", ".join(f"{n} {f}" for f, n in q["formats"].items())
    cosine = q.get("llama_cpp", {}).get("logits_cosine")
    caption = f"{q['threads']} threads, {q['file_MB']:.0f} MB file ({formats} tensors)"
    caption += f", logits cosine vs llama.cpp {cosine:.4f}" if cosine is not None else ""
    return caption + ":\n\n" + md(["", "decode tok/s", "prompt-512 tok/s"], rows)


def quantized_gpu_table(r: dict) -> str:
    """Packed-weight linears on a GPU (benchmarks/quantized_gpu.py): us per call, weight bytes read per
    second, and torch bf16's time over each (same rows)."""
    torch_us = {x["rows"]: x["us"] for x in r["rows"] if x["backend"] == "torch"}
    rows = [
        [x["backend"], x["format"], str(x["rows"]), f"{x['us']:.1f}", f"{x['bytes'] / x['us'] / 1e3:.0f}"]
        + [f"**{torch_us[x['rows']] / x['us']:.2f}x**"]
        for x in r["rows"]
    ]
    head = ["backend", "format", "rows", "us per call", "weight GB/s", "speed vs torch bf16"]
    return f"{r['device']}, N = {r['n']}, K = {r['k']}, x bf16:\n\n" + md(head, rows)


def fenced(text: str) -> str:
    return f"```text\n{text}\n```"


# ---- the tables a page can hold --------------------------------------------------------------------------
class Table(NamedTuple):
    source: str  # a JSON file under benchmarks/results/ (a glob for the GPU check's folder)
    command: str  # what writes it
    render: Callable[[dict], str]  # the JSON (for a glob: file stem -> JSON) -> markdown
    part: str | None = None  # the key the table needs, for a benchmark that can write one part of its JSON


def _bench_table(module: str, function: str, key: str, text: bool = False) -> Callable[[dict], str]:
    """A benchmark script's own table renderer, applied to `json[key]` (`text`: fixed width, fenced)."""

    def render(result: dict) -> str:
        table = getattr(bench(module), function)(result[key])
        return fenced(table) if text else table

    return render


def _cmd(script: str, *args: str) -> str:
    return " ".join(["python", f"benchmarks/{script}", *args])


TO_RESULTS = "--out benchmarks/results"  # model.py and llm.py write to out/bench unless told
TABLES: dict[str, Table] = {
    "demo.json:forward": Table("demo.json", f"python -m kernelize demo {TO_RESULTS}", demo_table),
    "cpu_layers.json:layers": Table(
        "cpu_layers.json", _cmd("cpu_layers.py"), _bench_table("cpu_layers", "table", "rows", text=True)
    ),
    "model.json:forward": Table(
        "model.json", _cmd("model.py", TO_RESULTS), _bench_table("model", "table", "results")
    ),
    "llm.json:prefill": Table(
        "llm.json", _cmd("llm.py", TO_RESULTS), _bench_table("llm", "table", "results")
    ),
    "attention.json:kernel": Table("attention.json", _cmd("attention.py"), attention_table),
    "decode.json:gemv": Table("decode.json", _cmd("decode.py"), gemv_table, "gemv"),
    "decode.json:model": Table("decode.json", _cmd("decode.py"), decode_model_table, "model"),
    "models.json:sweep": Table(
        "models.json",
        _cmd("models.py", "--sweep --docs"),
        _bench_table("models", "sweep_table", "sweep"),
        "sweep",
    ),
    "models.json:speed": Table(
        "models.json",
        _cmd("models.py", "--speed --docs"),
        _bench_table("models", "speed_table", "speed"),
        "speed",
    ),
    "train.json:layers": Table(
        "train.json", _cmd("train.py"), _bench_table("train", "layer_table", "layers"), "layers"
    ),
    "train.json:steps": Table(
        "train.json", _cmd("train.py"), _bench_table("train", "step_table", "steps"), "steps"
    ),
    "onnx_models.json:models": Table("onnx_models.json", _cmd("onnx_models.py"), onnx_table),
    "onnx_compile_times.json:load": Table(
        "onnx_compile_times.json", _cmd("onnx_models.py", "--compile-times-only"), load_table
    ),
    "gpu/*.json:sections": Table("gpu/*.json", "make gpu-check", gpu_table),
    "moe.json:models": Table("moe.json", _cmd("moe.py"), _bench_table("moe", "table", "records")),
    "quantized_kernelize.json:kernelize": Table(
        "quantized_kernelize.json", _cmd("quantized.py", "--parts kernelize"), quantized_table, "kernelize"
    ),
    "quantized_qwen.json:qwen": Table(
        "quantized_qwen.json", _cmd("quantized.py", "--parts qwen"), quantized_qwen_table, "qwen"
    ),
    "quantized_gpu.json:rows": Table("quantized_gpu.json", _cmd("quantized_gpu.py"), quantized_gpu_table),
    "threads.json:scaling": Table(
        "threads.json", _cmd("threads.py", "--out benchmarks/results/threads.json"), threads_table
    ),
}


def load(results: Path, source: str) -> dict | None:
    """The JSON behind a table, or None when it is absent (for a glob: None when no file matches)."""
    if "*" in source:
        found = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob(source))}
        return found or None
    path = results / source
    return json.loads(path.read_text()) if path.exists() else None


def table_data(results: Path, table: Table) -> dict | None:
    """What `table` renders, or None when its JSON (or the part of it the table needs) is absent."""
    data = load(results, table.source)
    return data if data is not None and (table.part is None or data.get(table.part)) else None


# ---- the README's headline: one figure per benchmark, never typed by hand -------------------------------
def _demo(r: dict) -> str:
    t = r["timings_ms"]
    vs_compile = t["torch.compile"] / t["kernelized"]
    return f"{t['eager'] / t['kernelized']:.2f}x eager, {vs_compile:.2f}x `torch.compile`"


def _cpu_layers(r: dict) -> str:
    ratios = [x["torch.compile"] / x["kernelize"] for x in r["rows"]]
    return f"{span(ratios)} `torch.compile` ({len(ratios)} layer / shape / dtype configs)"


def _model(r: dict) -> str:
    return "; ".join(f"{x['model']} {x['speedup_vs_eager']['kernelized']:.2f}x eager" for x in r["results"])


def _llm(r: dict) -> str:
    return f"{span([p['speedup']['kernelized'] for x in r['results'] for p in x['prefill']])} eager"


def _moe(r: dict) -> str:
    recs = r["records"]
    decode = span([x["decode"]["speedup"]["kernelized"] for x in recs])
    prefill = span([x["prefill"]["ms"]["eager"] / x["prefill"]["ms"]["kernelized"] for x in recs])
    shares = sorted(round(100 * x["experts_decode"]["of_sum"]["kernelized"]) for x in recs)
    read = f"{shares[0]}%" if shares[0] == shares[-1] else f"{shares[0]}-{shares[-1]}%"
    out = f"decode {decode} eager, prefill {prefill} eager; experts read at {read} of `sum`'s bandwidth"
    packed = sorted({n for x in recs for n in x["decode"]["speedup"] if n.startswith("kernelized ")})
    for name in packed:  # kernelize_model(quantize=...): the experts packed too
        out += f"; {name.split()[1]} decode {span([x['decode']['speedup'][name] for x in recs])} eager"
    return out


def _packed(r: dict) -> str:
    k = r["kernelize"]
    cells = [
        f"{fmt} {k[f'{fmt}_kernelize']['vs_bf16_eager']:.2f}x eager bf16, "
        f"{k[f'llama_cpp_{fmt}']['kernelize_vs_llama_cpp']:.2f}x llama.cpp"
        for fmt in ("q8_0", "q4_0", "q4_k")
        if "kernelize_vs_llama_cpp" in k.get(f"llama_cpp_{fmt}", {})
    ]
    return "decode " + "; ".join(cells) if cells else ""


def _gemv(r: dict) -> str:
    return f"few-row matmul {span([g['kernel_vs_linear'] for g in r['gemv']])} `F.linear`"


def _decode(r: dict) -> str:
    return f"{span([m['kernelized_vs_eager'] for m in r['model']])} eager tokens/s"


def _attention(r: dict) -> str:
    return f"{span([x['ratio'] for x in r['rows']])} SDPA ({r['dtype']})"


def _sweep(r: dict) -> str:
    models = bench("models")
    served, _ = models.coverage(r["sweep"])
    ok = sum(x["status"] == "ok" for x in r["sweep"])
    return (
        f"{len(served)} of {len(models.TARGET_FAMILIES)} target families with a kernel in every decoder "
        f"layer; {ok} of {len(r['sweep'])} classes give eager's logits"
    )


def _models_speed(r: dict) -> str:
    decode, prefill = ([x[k] for x in r["speed"]] for k in ("decode_vs_eager", "prefill_vs_eager"))
    families = ", ".join(x["family"] for x in r["speed"])
    return f"decode {span(decode)} eager, prefill {span(prefill)} eager ({families})"


def _train(r: dict) -> str:
    layers = span([x["torch.compile"] / x["kernelize"] for x in r["layers"]])
    steps = ", ".join(
        f"{s['case']} {s['times_ms']['eager'] / s['times_ms']['kernelized+fused loss']:.2f}x"
        for s in r["steps"]
    )
    return f"per layer fwd+bwd {layers} `torch.compile`; step with the fused loss vs eager: {steps}"


def _onnx(r: dict) -> str:
    by_batch = ", ".join(
        f"batch {k.removeprefix('batch').split('_')[0]}"
        + (f" at {v['threads']} thread{'s' if v['threads'] != 1 else ''}" if "threads" in v else "")
        + f" ({v['models']} model{'s' if v['models'] != 1 else ''}): {v['geomean_vs_ort']:.2f}"
        + f" (worst {v['worst_vs_ort']:.2f})"
        for k, v in r["summary"].items()
    )
    return f"kernelize / onnxruntime time, geomean: {by_batch}"


def _gpu(r: dict) -> str:
    gpu = next(iter(r.values()))["machine"].get("gpu", "?")
    ratios = [x for s in r.values() if s["ok"] for ms, _ in gpu_timings(s).values() if (x := speedup(ms))]
    passed = f"{sum(s['ok'] for s in r.values())} of {len(r)} sections pass on {gpu}"
    return passed + (f"; kernelize {span(ratios)} the speed of eager / SDPA" if ratios else "")


HEADLINES: list[tuple[str, str, Callable[[dict], str]]] = [
    ("Demo decoder, forward (`make demo`)", "demo.json:forward", _demo),
    ("Layers, forward (CPU)", "cpu_layers.json:layers", _cpu_layers),
    ("Whole model, forward", "model.json:forward", _model),
    ("transformers prefill", "llm.json:prefill", _llm),
    ("Decode matmuls", "decode.json:gemv", _gemv),
    ("Decode, transformers models", "decode.json:model", _decode),
    ("Attention kernel", "attention.json:kernel", _attention),
    ("One call on every causal-LM family", "models.json:sweep", _sweep),
    ("Decode / prefill at realistic sizes", "models.json:speed", _models_speed),
    ("Mixture of experts (Qwen3-MoE layout)", "moe.json:models", _moe),
    ("Packed weights (300 M Llama, same GGUF file)", "quantized_kernelize.json:kernelize", _packed),
    ("Training", "train.json:layers", _train),
    ("ONNX models", "onnx_models.json:models", _onnx),
    ("GPU check", "gpu/*.json:sections", _gpu),
]


def headline(results: Path) -> str:
    lines = ["| benchmark | latest figure | reproduce |", "|---|---|---|"]
    for label, name, figure in HEADLINES:
        table = TABLES[name]
        data = table_data(results, table)
        command = table.command
        if data is not None and "*" not in table.source:
            command = data.get("commands", {}).get(name.split(":")[1]) or data.get("command") or command
        shown = figure(data) if data is not None else None
        lines.append(f"| {label} | {shown or 'not in benchmarks/results yet'} | `{command}` |")
    return "\n".join(lines)


# ---- pages ----------------------------------------------------------------------------------------------
def body(name: str, old: str, results: Path) -> str:
    """What belongs between a table's markers now."""
    if name == "headline":
        return headline(results) + "\n"
    if name not in TABLES:
        raise SystemExit(f"report.py: unknown table {name!r}; known: headline, {', '.join(TABLES)}")
    table = TABLES[name]
    data = table_data(results, table)
    if data is not None:
        return table.render(data) + "\n"
    kept = re.sub(rf"\n*{re.escape(ABSENT)}[^\n]*\n?\Z", "", old.rstrip("\n")).rstrip("\n")
    what = f"benchmarks/results/{table.source}" + (f" (its `{table.part}` part)" if table.part else "")
    note = f"{ABSENT} `{table.command}` writes {what}."
    return f"{kept}\n\n{note}\n" if kept.strip() else f"{note}\n"


def rewrite(text: str, results: Path) -> tuple[str, list[str]]:
    """The page with every marked table rendered, and the names of the tables that changed."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        new = body(m.group(2), m.group(3), results)
        if new != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + new + m.group(4)

    return MARKED.sub(one, text), changed


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *(p for p in sorted((root / "docs").glob("*.md")) if p.name != "models.md")]


def models_page(root: Path) -> str | None:
    """docs/models.md as `benchmarks/models.py --docs` renders it, or None without models.json."""
    data = load(root / "benchmarks" / "results", "models.json")
    return None if data is None else bench("models").docs_page(data)


def run(root: Path, check: bool) -> list[str]:
    """Rewrite (with `check`: only compare) every generated table; returns `page: table` per difference."""
    results = root / "benchmarks" / "results"
    differ = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new, changed = rewrite(text, results)
        differ += [f"{page.relative_to(root).as_posix()}: {name}" for name in changed]
        if changed and not check:
            page.write_text(new, encoding="utf-8")
    models = models_page(root)
    target = root / "docs" / "models.md"
    if models is not None and (not target.exists() or target.read_text(encoding="utf-8") != models):
        differ.append("docs/models.md: models.json (python benchmarks/models.py --docs)")
        if not check:
            target.write_text(models, encoding="utf-8")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose pages to render")
    args = parser.parse_args(argv)
    differ = run(args.root.resolve(), args.check)
    if args.check and differ:
        print("tables that differ from their JSON (run python benchmarks/report.py):")
        print("\n".join(f"  {d}" for d in differ))
        return 1
    print("\n".join(f"rewrote {d}" for d in differ) if differ else "every table matches its JSON")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
