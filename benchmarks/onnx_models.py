"""Real ONNX models on the CPU: kernelize vs onnxruntime vs eager torch, plus cold and warm compile time.

Models are real architectures built from transformers configs (random weights, no download) and exported
with ``torch.onnx.export`` in opset 17, and the classic CNNs of ``cnn_zoo.py`` (AlexNet, VGG, GoogLeNet,
SqueezeNet, DenseNet, ShuffleNet v1/v2, MobileNet v1, ResNet-18, pre-activation ResNet), exported in
opset 9 with separate batch norms; all into ``benchmarks/.onnx_cache/`` (gitignored; reused across runs).
For each model
and batch size the script loads it the way ``kernelize run model.onnx --backend cpu`` does
(``load_onnx`` -> ``optimize`` -> ``compile_graph(backend="cpu")``), times kernelize, onnxruntime (same
thread count, same inputs) and eager torch interleaved (one call of each per round, medians over rounds),
and checks the largest relative difference from onnxruntime. Cold time is load + optimize + plan + compile
with an empty kernel cache in a fresh process; warm time is the same with the cache filled.

Prints a table, writes ``<out>/onnx_models.json`` and ``<out>/onnx_models.png``.

Usage:
    python benchmarks/onnx_models.py            # all models, batch 1 and 8
    python benchmarks/onnx_models.py --quick    # ResNet-50 and the BERT encoder at batch 1, few rounds
    python benchmarks/onnx_models.py --compile-times-only --models vit_base bert_base
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from cnn_zoo import ZOO
from cnn_zoo import build as build_cnn
from cnn_zoo import export as export_cnn

CACHE = Path(__file__).resolve().parent / ".onnx_cache"
THREADS = int(os.environ.get("ONNX_BENCH_THREADS", "2"))


def _vision(cls_name: str, cfg_name: str, **kw) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        cfg = getattr(transformers, cfg_name)(**kw)
        return getattr(transformers, cls_name)(cfg)

    return build


def _bert() -> torch.nn.Module:
    import transformers

    cfg = transformers.BertConfig(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    )
    return transformers.BertModel(cfg, add_pooling_layer=False)


def _whisper_encoder() -> torch.nn.Module:
    import transformers

    sizes = dict(encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048, max_source_positions=1500)
    sizes |= dict(decoder_layers=1, decoder_attention_heads=8)  # built with the encoder, then dropped
    cfg = transformers.WhisperConfig(d_model=512, num_mel_bins=80, **sizes)
    return transformers.WhisperModel(cfg).get_encoder()


def _cnn(name: str) -> Callable[[], torch.nn.Module]:
    return lambda: build_cnn(name, 224)


# name -> (builder, input kind); vision models take pixel_values [B, 3, 224, 224], BERT token ids [B, 128],
# the Whisper encoder 30 s of log-mel features [B, 80, 3000];
# "cnn" models are cnn_zoo's: images too, built with calibrated weights, exported in opset 9
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "resnet50": (_vision("ResNetForImageClassification", "ResNetConfig"), "image"),
    "mobilenet_v2": (_vision("MobileNetV2ForImageClassification", "MobileNetV2Config"), "image"),
    "convnext_tiny": (_vision("ConvNextForImageClassification", "ConvNextConfig"), "image"),
    "efficientnet_b0": (
        _vision(
            "EfficientNetForImageClassification",
            "EfficientNetConfig",
            width_coefficient=1.0,
            depth_coefficient=1.0,
            image_size=224,
            hidden_dim=1280,
        ),
        "image",
    ),
    "regnet_y_400mf": (
        _vision(
            "RegNetForImageClassification",
            "RegNetConfig",
            hidden_sizes=[48, 104, 208, 440],
            depths=[1, 3, 6, 6],
            groups_width=8,
            layer_type="y",
        ),
        "image",
    ),
    "vit_base": (_vision("ViTForImageClassification", "ViTConfig"), "image"),
    "swin_tiny": (_vision("SwinForImageClassification", "SwinConfig"), "image"),
    "deit_small": (
        _vision(
            "DeiTForImageClassification",
            "DeiTConfig",
            hidden_size=384,
            num_attention_heads=6,
            intermediate_size=1536,
        ),
        "image",
    ),  # fmt: skip
    "bert_base": (_bert, "text"),
    "whisper_encoder": (_whisper_encoder, "audio"),
    **{name: (_cnn(name), "cnn") for name in ZOO},
}
QUICK = ("resnet50", "bert_base")


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            return out
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def example_input(kind: str, batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind in ("image", "cnn"):
        return torch.randn(batch, 3, 224, 224, generator=gen)
    if kind == "audio":
        return torch.randn(batch, 80, 3000, generator=gen)
    return torch.randint(0, 30522, (batch, 128), generator=gen)


def calibrated(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """``model`` with weights a trained network's activations would resemble. transformers initialises
    convolutions with std 0.02 whatever their fan-in, and batch norm in eval mode then does not rescale:
    EfficientNet-B0's activations shrank ~50x per block, were denormal by block 6 and its logits all zero,
    which made the accuracy check vacuous and timed denormal arithmetic. So convolutions get He-normal
    weights and batch norms the statistics of a few random batches (train-mode forwards, no gradients)."""
    if kind != "image":
        return model.eval()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # a cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for seed in range(4):
            model(example_input(kind, 8, seed=100 + seed))
    return model.eval()


def export(name: str) -> Path:
    """The model's ONNX file (exported once, with a dynamic batch axis; ``.v2``: calibrated weights)."""
    build, kind = MODELS[name]
    if kind == "cnn":  # opset 9, batch norms kept, cached under the digest of cnn_zoo.py
        return export_cnn(name, 224, CACHE)
    path = CACHE / f"{name}.v2.onnx"
    if path.is_file():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = _Logits(calibrated(build(), kind))
    x = example_input(kind, 2)
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad():
        torch.onnx.export(
            model,
            (x,),
            str(tmp),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    tmp.replace(path)
    return path


def load_kernelize(path: Path, batch: int):
    """What ``kernelize run --backend cpu`` does: load, optimize, compile; returns the callable."""
    from kernelize.runtime.compiled import compile_graph
    from kernelize.runtime.graph_cache import load_optimized_onnx

    graph = load_optimized_onnx(path, dynamic_dims={"batch": batch})
    return compile_graph(graph, backend="cpu", device="cpu")


def load_ort(path: Path, threads: int = THREADS):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


# OpenVINO's CPU plugin computes in bf16 by default where the CPU has AVX512-BF16 (this benchmark's EPYC
# does): its time then is not an f32 engine's. Pinned to f32 like the others; OPENVINO_PRECISION=bf16 for its
# default
OPENVINO_PRECISION = os.environ.get("OPENVINO_PRECISION", "f32")


def load_openvino(path: Path, threads: int):
    """OpenVINO's CPU plugin on the same file and thread count, in :data:`OPENVINO_PRECISION` (None where
    `openvino` is not installed, or cannot convert the model: the row keeps kernelize and onnxruntime)."""
    try:
        import openvino as ov
    except ImportError:
        return None
    config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    config["INFERENCE_PRECISION_HINT"] = OPENVINO_PRECISION
    try:
        compiled = ov.Core().compile_model(str(path), "CPU", config)
    except RuntimeError as e:  # EfficientNet-B0's global AveragePool: OpenVINO 2026.4's shape check fails
        lines = str(e).splitlines()
        why = next((line for line in lines if "Conversion is failed" in line), lines[0] if lines else "")
        print(f"{path.name}: OpenVINO cannot convert it: {why}", file=sys.stderr, flush=True)
        return None
    return lambda x: torch.from_numpy(compiled(x.numpy())[0])


def compile_seconds(name: str, batch: int, cache_dir: str) -> float:
    """Load + optimize + plan + compile + the first run (what a user waits for the first output: parts built
    in the background, such as the GEMM library, or made on first use, such as packed weights, are counted)
    in a fresh process with kernel cache ``cache_dir``, after importing kernelize and onnx (as
    onnxruntime's session time excludes ``import onnxruntime``; :func:`import_seconds` reports that part).
    Bytecode is written as an installed package's is (this machine's environment sets
    ``PYTHONDONTWRITEBYTECODE``, which recompiled every module in each fresh process: 0.6 s)."""
    code = (
        f"import sys, time, torch; torch.set_num_threads({THREADS});"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); import onnx_models as m;"
        "import onnx, kernelize.runtime.compiled, kernelize.runtime.graph_cache;"
        f"x = m.example_input(m.MODELS[{name!r}][1], {batch}, seed=1); t=time.perf_counter();"
        f"f = m.load_kernelize(m.export({name!r}), {batch});"
        "torch.inference_mode().__enter__(); f(x); print(time.perf_counter()-t)"
    )
    env = dict(os.environ, KERNELIZE_CACHE_DIR=cache_dir, PYTHONDONTWRITEBYTECODE="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def import_seconds() -> float:
    """``import kernelize`` and what loading an ONNX model imports, in a fresh process (after torch)."""
    code = (
        "import time, torch; t=time.perf_counter();"
        "import onnx, kernelize.runtime.compiled, kernelize.runtime.graph_cache; print(time.perf_counter()-t)"
    )
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    """The CPU the rows were measured on, with the vector ISA torch's kernels use ("AMD EPYC, AVX2"): a
    table merged from runs on several machines says which row came from which."""
    model = platform.processor() or platform.machine()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


IDLE_S = 0.1  # pause before each timed run, so the previous variant's spinning threads have gone idle


def bench(name: str, batch: int, rounds: int, compile_times: bool, threads: int = THREADS) -> dict:
    path = export(name)
    build, kind = MODELS[name]
    x = example_input(kind, batch, seed=1)
    torch.manual_seed(0)
    eager = _Logits(calibrated(build(), kind))
    torch.set_num_threads(threads)
    row: dict = {"model": name, "batch": batch, "threads": threads, "cpu": cpu_name()}
    if compile_times:
        cold_dir = tempfile.mkdtemp(prefix="kcold")
        try:
            row["cold_s"] = compile_seconds(name, batch, cold_dir)
            row["warm_s"] = compile_seconds(name, batch, cold_dir)
            row["import_s"] = import_seconds()
        finally:
            shutil.rmtree(cold_dir, ignore_errors=True)
    cg = load_kernelize(path, batch)
    sess = load_ort(path, threads)
    feed = {"x": x.numpy()}
    runs = {
        "kernelize": lambda: cg(x)[0],
        "onnxruntime": lambda: torch.from_numpy(sess.run(None, feed)[0]),
        "eager": lambda: _Logits.forward(eager, x),
    }
    openvino = load_openvino(path, threads)
    if openvino is not None:
        runs["openvino"] = lambda: openvino(x)
    with torch.inference_mode():
        outs = {k: f() for k, f in runs.items()}  # warm-up
        row["rel_diff_vs_ort"] = rel_diff(outs["kernelize"], outs["onnxruntime"])
        # both f32 engines round differently from the exact result: the float64 model tells who is off
        torch.manual_seed(0)
        exact = _Logits(calibrated(build(), kind)).double()(x if kind == "text" else x.double())
        row["rel_diff_vs_f64"] = rel_diff(outs["kernelize"], exact)
        row["ort_rel_diff_vs_f64"] = rel_diff(outs["onnxruntime"], exact)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(rounds):
            for k, f in runs.items():
                # onnxruntime's and OpenMP's worker threads spin for a while after a run; on 2 cores the
                # next variant would share the CPU with them (measured: both times doubled back to back)
                time.sleep(IDLE_S)
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
    for k, ts in times.items():
        row[f"{k}_ms"] = statistics.median(ts)
    row["ratio_vs_ort"] = row["kernelize_ms"] / row["onnxruntime_ms"]
    if "openvino_ms" in row:
        row["ratio_vs_openvino"] = row["kernelize_ms"] / row["openvino_ms"]
    row["ratio_vs_eager"] = row["kernelize_ms"] / row["eager_ms"]
    return row


def compile_times(models: list[str], batch: int, rounds: int, out: Path) -> None:
    """Cold (empty caches, fresh process) and warm (median of ``rounds`` fresh processes) seconds from the
    model file to the first output (:func:`compile_seconds`) per model; writes
    ``<out>/onnx_compile_times.json``."""
    rows = []
    print(f"{'model':<16} {'cold s':>7} {'warm s':>7}  warm runs", flush=True)
    for name in models:
        export(name)
        cold_dir = tempfile.mkdtemp(prefix="kcold")
        try:
            cold = compile_seconds(name, batch, cold_dir)
            warm = [compile_seconds(name, batch, cold_dir) for _ in range(rounds)]
        finally:
            shutil.rmtree(cold_dir, ignore_errors=True)
        warm_s = statistics.median(warm)
        rows.append({"model": name, "batch": batch, "cold_s": cold, "warm_s": warm_s, "warm_runs": warm})
        runs = " ".join(f"{w:.2f}" for w in warm)
        print(f"{name:<16} {cold:>7.2f} {statistics.median(warm):>7.2f}  {runs}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": THREADS, "cpu": cpu_name(), "torch": torch.__version__}
    (out / "onnx_compile_times.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ResNet-50 and BERT at batch 1, few rounds")
    ap.add_argument("--models", nargs="*", choices=list(MODELS), help="subset of models")
    ap.add_argument("--batches", nargs="*", type=int, help="batch sizes (default 1 8)")
    ap.add_argument("--rounds", type=int, help="timed rounds per variant (interleaved)")
    ap.add_argument("--threads", nargs="*", type=int, help=f"thread counts (default {THREADS})")
    ap.add_argument("--no-compile-times", action="store_true", help="skip the cold/warm compile runs")
    ap.add_argument(
        "--compile-times-only",
        action="store_true",
        help="only the cold and warm load + compile seconds (cold once, warm median of --rounds, default 3)",
    )
    ap.add_argument("--merge", nargs="*", type=Path, help="only combine these runs' JSON files into one")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out = Path(args.out)
    if args.merge:
        runs = [json.loads(f.read_text()) for f in args.merge]
        write(out, [r for d in runs for r in d["rows"]], [f for d in runs for f in d["failed"]])
        return
    torch.set_num_threads(THREADS)
    models = args.models or (QUICK if args.quick else list(MODELS))
    batches = args.batches or ([1] if args.quick else [1, 8])
    if args.compile_times_only:
        compile_times(models, batches[0], args.rounds or 3, out)
        return
    rounds = args.rounds or (5 if args.quick else 15)
    rows, failed = measure(models, batches, args.threads or [THREADS], rounds, not args.no_compile_times)
    write(out, rows, failed)


def measure(models: list[str], batches: list[int], threads: list[int], rounds: int, compile_times: bool):
    """Every (model, batch, threads) row; the models that failed to load, with the error."""
    rows: list[dict] = []
    failed: list[dict] = []
    for name in models:
        for b in batches:
            for i, t in enumerate(threads):
                # compile times depend little on the batch: measured at the first batch and thread count only
                timed = compile_times and b == batches[0] and i == 0
                try:
                    row = bench(name, b, rounds if b == 1 else max(3, rounds // 2), timed, t)
                except (ValueError, RuntimeError, NotImplementedError) as e:  # kernelize cannot load it yet
                    failed.append({"model": name, "batch": b, "error": f"{type(e).__name__}: {e}"})
                    print(f"{name} batch {b}: {failed[-1]['error']}", file=sys.stderr, flush=True)
                    break
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows, failed


def summarize(rows: list[dict]) -> dict:
    """Geomean and worst kernelize / onnxruntime (and / OpenVINO) per batch and thread count, and each
    model's 1 -> n thread speedup against onnxruntime's."""
    summary: dict = {}
    for b, t in sorted({(r["batch"], r.get("threads", THREADS)) for r in rows}):
        group = [r for r in rows if r["batch"] == b and r.get("threads", THREADS) == t]
        ratios = [r["ratio_vs_ort"] for r in group]
        entry = {
            "threads": t,
            "models": len(group),
            "geomean_vs_ort": geomean(ratios),
            "worst_vs_ort": max(ratios),
        }
        ov = [r["ratio_vs_openvino"] for r in group if "ratio_vs_openvino" in r]
        if ov:
            entry["geomean_vs_openvino"] = geomean(ov)
        summary[f"batch{b}" if t == THREADS else f"batch{b}_threads{t}"] = entry
    return summary


def scaling(rows: list[dict]) -> list[dict]:
    """Per model and batch with a 1-thread row: kernelize's and onnxruntime's speedup to each other count."""
    one = {(r["model"], r["batch"]): r for r in rows if r.get("threads") == 1}
    found = []
    for r in rows:
        base = one.get((r["model"], r["batch"]))
        if base is None or r is base:
            continue
        k, o = base["kernelize_ms"] / r["kernelize_ms"], base["onnxruntime_ms"] / r["onnxruntime_ms"]
        found.append({"model": r["model"], "batch": r["batch"], "threads": r["threads"], "kernelize": k,
                      "onnxruntime": o, "relative": k / o})  # fmt: skip
    return found


def write(out: Path, rows: list[dict], failed: list[dict]) -> None:
    """Print the table, write ``onnx_models.json`` and the plot; fail the run on a wrong output."""
    print("CPU, f32, medians of interleaved rounds (shared machine: ratios only)\n")
    head = f"{'model':<16} {'batch':>5} {'thr':>3} {'kernelize':>10} {'ort':>8} {'eager':>8} {'k/ort':>6}"
    print(head + f" {'k/ov':>6} {'vs ort':>8} {'k vs f64':>8} {'ort/f64':>8} {'cold s':>7} {'warm s':>7}")
    for r in rows:
        print(
            f"{r['model']:<16} {r['batch']:>5} {r.get('threads', THREADS):>3} {r['kernelize_ms']:>10.2f} "
            f"{r['onnxruntime_ms']:>8.2f} {r['eager_ms']:>8.2f} {r['ratio_vs_ort']:>6.2f} "
            f"{r.get('ratio_vs_openvino', float('nan')):>6.2f} {r['rel_diff_vs_ort']:>8.1e} "
            f"{r['rel_diff_vs_f64']:>8.1e} {r['ort_rel_diff_vs_f64']:>8.1e} "
            f"{r.get('cold_s', float('nan')):>7.1f} {r.get('warm_s', float('nan')):>7.2f}"
        )
    for f in failed:
        print(f"{f['model']:<16} {f['batch']:>5}  failed: {f['error'][:200]}")
    summary = summarize(rows)
    for key, v in summary.items():
        print(
            f"{key}: geomean kernelize/onnxruntime {v['geomean_vs_ort']:.2f}, worst {v['worst_vs_ort']:.2f}"
        )
    out.mkdir(parents=True, exist_ok=True)
    data = {"threads": THREADS, "openvino_precision": OPENVINO_PRECISION, "rows": rows, "failed": failed}
    data |= {"summary": summary, "scaling": scaling(rows)}
    (out / "onnx_models.json").write_text(json.dumps(data, indent=1))
    plot([r for r in rows if r.get("threads", THREADS) == THREADS], sorted({r["batch"] for r in rows}),
         out / "onnx_models.png")  # fmt: skip
    print(f"wrote {out / 'onnx_models.json'} and {out / 'onnx_models.png'}")
    wrong = [f"{r['model']} batch {r['batch']}" for r in rows if not _accurate(r)]
    if wrong:  # a time for a wrong output means nothing: fail the run
        raise SystemExit(
            f"outputs off by more than {MAX_REL_DIFF:g} (relative) from onnxruntime and from the float64 "
            f"model, or further from the float64 model than onnxruntime is: {wrong}"
        )


MAX_REL_DIFF = 1e-4  # the accuracy target


def _accurate(r: dict) -> bool:
    """Within :data:`MAX_REL_DIFF` of onnxruntime, or, where two f32 engines' roundings differ by more
    (ResNet-50 with calibrated weights: 1.3e-4 apart, each ~6e-5 from float64), within it of the float64
    model and no further from it than onnxruntime is."""
    if r["rel_diff_vs_ort"] <= MAX_REL_DIFF:
        return True
    return r["rel_diff_vs_f64"] <= min(MAX_REL_DIFF, 1.5 * r["ort_rel_diff_vs_f64"])


def plot(rows: list[dict], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] == b]
        names = [r["model"] for r in rs]
        xs = range(len(rs))
        ax.bar([i - 0.2 for i in xs], [r["ratio_vs_ort"] for r in rs], 0.4, label="kernelize / onnxruntime")
        ax.bar(
            [i + 0.2 for i in xs],
            [r["eager_ms"] / r["onnxruntime_ms"] for r in rs],
            0.4,
            label="eager torch / onnxruntime",
        )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs), names, rotation=30, ha="right")
        ax.set_ylabel("time relative to onnxruntime (lower is faster)")
        ax.set_title(f"batch {b}, CPU {THREADS} threads")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
