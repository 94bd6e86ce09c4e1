"""Training on the CPU: eager vs kernelized (generated backward kernels) vs torch.compile.

Three parts, every implementation timed in interleaved repetitions (median reported):

1. Per layer, forward + backward (the ``cpu_layers.py`` layer list, f32 and bf16): eager autograd on the
   plain function, ``torch.compile`` of it, and ``kernelize.hub.run`` (the generated forward, which also
   writes what backward needs, plus the generated backward).
2. The demo decoder's training step (``kernelize.models.llama_demo``; cross-entropy on its logits):
   eager, kernelized (``Mode.TRAINING``), kernelized + the fused linear cross-entropy, torch.compile.
3. A transformers ``LlamaForCausalLM`` step with labels (vocab 32k, from a config): eager, kernelized
   (``replace_kernel_forward_from_hub`` marks on LlamaRMSNorm / LlamaMLP), the one call
   ``kernelize_model(model, mode=Mode.TRAINING)`` (norms, MLPs, decoder blocks and the fused loss, which
   ``model(input_ids, labels=...)`` then uses), torch.compile.

Peak memory of a step: each (model, variant) runs in a fresh child process (glibc's mmap threshold fixed,
so freed large blocks leave the resident set) that does two warm-up steps, resets the kernel's
resident-set high-water mark (``/proc/self/clear_refs``) after dropping the gradients (``zero_grad``), runs
one step and reports ``VmHWM - VmRSS(before the step) + held``: everything the step allocated, its
gradients included, on top of the model, inputs and caches, plus ``held``, what kernelize's runtime keeps
resident between steps that no tensor outside it uses (``kernelize.runtime.memory.held_bytes``: idle
output-pool buffers, arena blocks), which the resident size before the step would otherwise hide. (Until
2026-11-26 evening the baseline kept the previous step's gradients, which the step frees first: their
pages were headroom, so a variant whose gradients were not all resident, such as kernelize's lazily
zeroed embedding gradient, measured more.)

Usage:
    python benchmarks/train.py            # full sizes (~15 min on 2 shared cores)
    python benchmarks/train.py --quick    # small sizes (smoke run)
    python benchmarks/train.py --layers-only   # the per-layer table alone
The per-layer table's memory floor: forward reads every input and writes every output, backward reads the
upstream gradients and the inputs and writes one gradient per input, each byte once, at the rate
``Tensor.copy_`` moves bytes on this machine (same threads).
Writes ``benchmarks/results/train.json`` and ``train.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_layers import LAYERS, _inputs  # noqa: E402
from model import marked_transformers_llama  # noqa: E402

import kernelize  # noqa: E402
from kernelize import Mode, get_kernel, hub  # noqa: E402
from kernelize.integrations.transformers import kernelize_model  # noqa: E402
from kernelize.models.llama_demo import LlamaDemo, LlamaDemoConfig  # noqa: E402
from kernelize.runtime.memory import held_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# how many leading arguments of each cpu_layers function are activations (the rest are weights)
ACTIVATIONS = {
    "RMSNorm": 1,
    "add+RMSNorm": 2,
    "LayerNorm": 1,
    "SiluAndMul": 1,
    "GeluAndMul": 1,
    "softmax": 1,
    "rotary": 3,
}
STEP_VARIANTS = ("eager", "kernelized", "kernelized+fused loss", "torch.compile")


def interleaved_ms(impls: dict, reps: int) -> dict[str, float]:
    """Median wall time per implementation, each repetition timing every implementation once in a shuffled
    (seeded) order: what ran just before leaves the caches in a state that changes the next one's time
    (rotary bf16 forward + backward: 2.8 ms right after `torch.compile`'s, 2.1 ms after its own), so no
    implementation may always follow the same one."""
    times: dict[str, list[float]] = {k: [] for k in impls}
    rng = random.Random(0)
    for _ in range(reps):
        order = list(impls.items())
        rng.shuffle(order)
        for k, f in order:
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


# ---- 1. per layer ------------------------------------------------------------------------------------------
# rows beyond the cpu_layers list: (label, layer, the inputs that get gradients)
EXTRA_ROWS = [("rotary, cos/sin constant", "rotary", (0,))]  # models make cos / sin under no_grad


def bench_layer(
    name: str, rows: int, cols: int, dtype: torch.dtype, reps: int, trained=None, label=None
) -> dict:
    """One layer's forward + backward; ``trained``: the indices of the inputs that get gradients (all)."""
    fn, _ = LAYERS[name]
    n_act = ACTIVATIONS[name]
    inputs = _inputs(name, rows, cols, dtype)
    inputs = [t.requires_grad_(trained is None or i in trained) for i, t in enumerate(inputs)]
    acts, weights = inputs[:n_act], inputs[n_act:]
    seeds = None
    compiled = torch.compile(fn, dynamic=False)

    def fwd_bwd(call):
        def run():
            outs = call()
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(outs, seeds)
            for t in inputs:
                t.grad = None

        return run

    with torch.no_grad():
        ref = fn(*inputs)
    seeds = [torch.randn_like(o) for o in (ref if isinstance(ref, tuple) else (ref,))]
    impls = {
        "eager": fwd_bwd(lambda: fn(*inputs)),
        "torch.compile": fwd_bwd(lambda: compiled(*inputs)),
        "kernelize": fwd_bwd(lambda: hub.run(None, fn, acts, weights)),
    }
    err = grad_error(fn, acts, weights, seeds)
    for f in impls.values():  # warm up: compiles
        f()
        f()
    row = interleaved_ms(impls, reps)
    dtype_name = str(dtype).removeprefix("torch.")
    row.update(layer=label or name, shape=f"{rows}x{cols}", dtype=dtype_name, grad_rel_err=err)
    # the memory floor: forward reads every input and writes every output, backward reads the upstream
    # gradients and the inputs and writes one gradient per trained input, each byte once, at the copy rate
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    trained_bytes = nbytes([t for t in inputs if t.requires_grad])
    forward, backward = nbytes(inputs) + nbytes(seeds), nbytes(seeds) + nbytes(inputs) + trained_bytes
    row["floor"] = (forward + backward) / copy_rate() * 1e3
    return row


_COPY_RATE: list[float] = []


def copy_rate() -> float:
    """Bytes per second `Tensor.copy_` moves (read + write) on a 256 MiB f32 tensor, median of 7."""
    if not _COPY_RATE:
        src = torch.randn(64 << 20)
        dst = torch.empty_like(src)
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        _COPY_RATE.append(2 * src.numel() * 4 / statistics.median(times[1:]))
    return _COPY_RATE[0]


def grad_error(fn, acts, weights, seeds) -> float:
    """Largest relative gradient difference (max |a - b| / max |b|) of kernelize against eager autograd,
    over the inputs that require gradients."""
    trained = [t for t in [*acts, *weights] if t.requires_grad]
    outs = hub.run(None, fn, acts, weights)
    got = torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), trained, seeds)
    outs = fn(*acts, *weights)
    want = torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), trained, seeds)
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, want)
    )


# ---- 2./3. training steps ----------------------------------------------------------------------------------
def demo_case(quick: bool):
    cfg = (
        LlamaDemoConfig.tiny()
        if quick
        else LlamaDemoConfig(vocab=32000, hidden=512, layers=2, heads=8, intermediate=1408, max_seq=256)
    )
    batch, seq = (2, 16) if quick else (2, 256)
    model = LlamaDemo(cfg).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    return model, ids, torch.randint(0, cfg.vocab, (batch, seq), generator=gen)


def llama_case(quick: bool):
    import transformers

    size = (
        dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
        )
        if quick
        else dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=2,
            num_attention_heads=8,
            vocab_size=32000,
        )
    )
    config = transformers.LlamaConfig(
        **size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=512
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    batch, seq = (2, 16) if quick else (2, 256)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab_size"], (batch, seq), generator=gen)
    return model, ids, ids.clone()


def demo_hidden(model: LlamaDemo, ids: torch.Tensor) -> torch.Tensor:
    """The demo decoder's final hidden states (its forward without the LM head)."""
    s = ids.shape[1]
    x = model.embed(ids)
    cos, sin = model.cos_cached[:s].to(x.dtype), model.sin_cached[:s].to(x.dtype)
    mask = torch.full((s, s), float("-inf")).triu(1)
    for layer in model.layers:
        x = layer(x, cos, sin, mask)
    return model.norm(x)


def step_fn(case: str, variant: str, model, ids, labels):
    """A zero-grad + forward + loss + backward callable for one (case, variant); returns the loss."""
    fused = get_kernel("kernelize/loss", version=1).fused_linear_cross_entropy
    if variant == "torch.compile":
        model = torch.compile(model)
    if case == "demo":

        def loss_of():
            if variant == "kernelized+fused loss":
                return fused(demo_hidden(model, ids), model.lm_head.weight, labels)
            return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    else:

        def loss_of():  # with kernelize_model the fused loss is the model's own loss (see build_variant)
            return model(input_ids=ids, labels=labels).loss

    def step():
        model.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        return loss

    return step


def build_variant(case: str, variant: str, quick: bool):
    """(model, step) for one variant; kernelized variants go through kernelize(mode=TRAINING)."""
    model, ids, labels = (demo_case if case == "demo" else llama_case)(quick)
    if case == "llama" and variant == "kernelized+fused loss":
        kernelize_model(model, mode=Mode.TRAINING)  # the one call: layers, decoder blocks and the loss
    elif variant.startswith("kernelized"):
        with kernelize.use_kernel_mapping(hub.default_mapping()):
            if case == "llama":
                with marked_transformers_llama():
                    kernelize.kernelize(model, device="cpu", mode=Mode.TRAINING)
            else:
                kernelize.kernelize(model, device="cpu", mode=Mode.TRAINING)
    return model, step_fn(case, variant, model, ids, labels)


def bench_step(case: str, quick: bool, reps: int) -> dict:
    built = {v: build_variant(case, v, quick) for v in STEP_VARIANTS}
    steps = {v: s for v, (_, s) in built.items()}
    for s in steps.values():
        s()  # warm up: kernels, torch.compile
    losses = {v: s().item() for v, s in steps.items()}
    grads = {
        v: {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        for v, (m, _) in built.items()
    }
    ref = grads["eager"]
    errs = {
        v: max(
            ((g[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref if n in g
        )
        for v, g in grads.items()
    }
    times = interleaved_ms(steps, reps)
    return {"case": case, "times_ms": times, "loss": losses, "grad_rel_err": errs}


# a fixed mmap threshold: large blocks are mmapped and go back to the OS when freed, so the resident size
# before a step is what is live (glibc's dynamic threshold would keep freed blocks of up to 32 MiB resident
# and hide them from the high-water mark)
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _child(case: str, variant: str, quick: bool) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--memory-child", case, variant] + (["--quick"] if quick else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **CHILD_ENV})


def peak_memory_mib(cases: list[str], quick: bool) -> dict[str, dict[str, float]]:
    """Peak extra resident memory of one step per (case, variant), each in its own child process (run
    concurrently: the measure is per process, only the wall time suffers)."""
    children = {(c, v): _child(c, v, quick) for c in cases for v in STEP_VARIANTS}
    out: dict[str, dict[str, float]] = {c: {} for c in cases}
    for (c, v), proc in children.items():
        stdout, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"memory child {c} {v} failed with exit code {proc.returncode}")
        out[c][v] = float(stdout.strip().splitlines()[-1])
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_child(case: str, variant: str, quick: bool) -> None:
    torch.set_num_threads(2)
    model, step = build_variant(case, variant, quick)
    step()
    step()
    # the previous step's gradients go before the baseline: the step makes its own (counted), and a variant
    # whose old gradients were resident would otherwise get their freed pages as headroom below `before`
    model.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    # what kernelize's runtime keeps resident between steps that no tensor outside it uses (idle pool
    # buffers, arena blocks) is memory the step has on top of the previous step's, though it is in `before`
    held = held_bytes() / 1024
    step()
    print((_status_kib("VmHWM") - before + held) / 1024)


# ---- report ----------------------------------------------------------------------------------------------
def layer_table(rows: list[dict]) -> str:
    lines = [
        "| layer | dtype | eager ms | torch.compile ms | kernelize ms | memory floor ms | vs eager "
        "| vs compile | grad err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} {r['shape']} | {r['dtype']} | {r['eager']:.1f} | {r['torch.compile']:.1f} | "
            f"{r['kernelize']:.1f} | {r.get('floor', float('nan')):.1f} | "
            f"{r['eager'] / r['kernelize']:.2f}x | {r['torch.compile'] / r['kernelize']:.2f}x | "
            f"{r['grad_rel_err']:.1e} |"
        )
    return "\n".join(lines)


def step_table(rows: list[dict]) -> str:
    lines = [
        "| step | variant | time ms | vs eager | peak MiB | vs eager | grad rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, m = r["times_ms"], r["peak_mib"]
        for v in STEP_VARIANTS:
            lines.append(
                f"| {r['case']} | {v} | {t[v]:.0f} | {t['eager'] / t[v]:.2f}x | {m[v]:.0f} | "
                f"{m[v] / max(m['eager'], 1e-9):.2f}x | {r['grad_rel_err'][v]:.1e} |"
            )
    return "\n".join(lines)


def plot(layers: list[dict], steps: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2, 1]})
    labels = [f"{r['layer']} {r['dtype'].replace('float', 'f')}" for r in layers]
    xs = range(len(layers))
    for i, (impl, color) in enumerate((("torch.compile", "tab:orange"), ("kernelize", "tab:green"))):
        a.bar([x + 0.4 * i for x in xs], [r["eager"] / r[impl] for r in layers], 0.4, label=impl, color=color)
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_xticks([x + 0.2 for x in xs], labels, fontsize=7, rotation=40, ha="right")
    a.set_ylabel("speedup vs eager (fwd+bwd)")
    a.legend()
    a.set_title("per layer, forward + backward (CPU, 2 threads)")
    names = [f"{r['case']}: {v}" for r in steps for v in STEP_VARIANTS]
    b.bar(
        range(len(names)), [r["times_ms"]["eager"] / r["times_ms"][v] for r in steps for v in STEP_VARIANTS]
    )
    b.axhline(1.0, color="gray", lw=0.8)
    b.set_xticks(range(len(names)), names, fontsize=7, rotation=40, ha="right")
    b.set_ylabel("speedup vs eager (training step)")
    b.set_title("training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-child", nargs=2, metavar=("CASE", "VARIANT"))
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--layers-only", action="store_true", help="only the per-layer part (no steps, memory)")
    ap.add_argument("--memory-only", action="store_true", help="re-measure peak memory into train.json")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child, args.quick)
        return
    torch.set_num_threads(2)
    rows, cols, reps = (256, 512, 3) if args.quick else (2048, 2048, 21)
    layers = []
    if not args.skip_layers and not args.memory_only:
        for dtype in (torch.float32, torch.bfloat16):
            for name in LAYERS:
                layers.append(bench_layer(name, rows, cols, dtype, reps))
                print(layers[-1], file=sys.stderr)
            for label, name, trained in EXTRA_ROWS:
                layers.append(bench_layer(name, rows, cols, dtype, reps, trained, label))
                print(layers[-1], file=sys.stderr)
    if args.layers_only:
        print(layer_table(layers))
        return
    cases = ["demo", "llama"]
    if args.memory_only:  # re-measure memory into an existing train.json
        result = json.loads((args.out / "train.json").read_text())
        layers, steps = result["layers"], result["steps"]
    else:
        steps = [bench_step(case, args.quick, 3 if args.quick else 11) for case in cases]
    mem = peak_memory_mib(cases, args.quick)
    for r in steps:
        r["peak_mib"] = mem[r["case"]]
    print(layer_table(layers))
    print()
    print(step_table(steps))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.json").write_text(json.dumps({"layers": layers, "steps": steps}, indent=1))
    plot(layers, steps, args.out / "train.png")


if __name__ == "__main__":
    main()
