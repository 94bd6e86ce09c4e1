"""The GPU check: what `make gpu-check` runs on an NVIDIA GPU machine (after the `@pytest.mark.cuda` tests).

Every section runs on `--device` (default `cuda`), so the same code runs on the CPU in the test suite
(`tests/test_gpu_check.py`, `--device cpu --quick`) and cannot rot between GPU windows:

1. `layers`: the bundled demo decoder (`kernelize.models.llama_demo`: RMSNorm, SiluAndMul, rotary, attention,
   linears) kernelized on the device, once per code generator (`triton`, and `cuda` = CUDA C through NVRTC;
   on the CPU the C++ one), against its eager self: max logit difference, eager / ours / `torch.compile`
   forward times;
2. `attention`: the generated attention kernel against torch's SDPA (causal, GQA), max difference and times;
3. `llm`: a ~1 B-parameter transformers Llama (bf16; `--quick`: tiny) through `kernelize_model` (with
   `KERNELIZE_GPU_MODEL=1`: on a GPU the one call otherwise leaves the model as it is): prefill of
   512 tokens and greedy decode of 32, against eager (and `torch.compile` for prefill), same tokens;
4. `training`: one training step of the demo decoder (`Mode.TRAINING`), gradients against eager, times;
5. `moe`: a Qwen3-MoE layout (`benchmarks/moe.py`; bf16, `--quick`: tiny, f32) through `kernelize_model` with
   `KERNELIZE_GPU_MODEL=1` and `KERNELIZE_GPU_EXPERTS=1`: the grouped-expert kernel
   in every MoE layer, prefill and decode against eager (`grouped_mm`), logits with eager's routing.

Writes `<out>/<section>.json` (machine, versions, command, date in each) and prints one line per section.
A section that fails is recorded with its error and the rest still run; the exit code is 1 if any failed.

Usage:
    python benchmarks/gpu_check.py                         # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --quick    # the same code on the CPU (a test runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def timed(fns: dict[str, Callable[[], object]], device: str, repeat: int) -> dict[str, float]:
    """Median milliseconds per call of each function, interleaved, synchronising the device."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm up: compile kernels and graphs
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def profiled(fn: Callable[[], object], device: str, top: int = 8) -> dict[str, list[dict]]:
    """Where the time of one call goes: the ops with the most device time and the most host time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    fn()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()

    def ranked(key: str) -> list[dict]:
        best = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
        return [{"op": e.key[:90], "calls": e.count, "ms": round(getattr(e, key) / 1e3, 3)} for e in best]

    return {"device": ranked("self_device_time_total") if cuda else [], "host": ranked("self_cpu_time_total")}


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


@contextlib.contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _demo(device: str, quick: bool):
    from kernelize.models import LlamaDemo, LlamaDemoConfig

    torch.manual_seed(0)
    config = (
        LlamaDemoConfig.tiny()
        if quick
        else LlamaDemoConfig(hidden=1024, layers=8, heads=16, intermediate=2816)
    )
    model = LlamaDemo(config).to(device)
    ids = torch.randint(0, config.vocab, (4, 64 if quick else 512), device=device)
    return model, ids


def section_layers(device: str, quick: bool, repeat: int) -> dict:
    from kernelize import Mode, kernelize, use_kernel_mapping
    from kernelize.hub import default_mapping

    eager, ids = _demo(device, quick)
    eager.eval()
    backends = ("triton", "cuda") if device == "cuda" else (None,)
    result: dict = {"backends": {}}
    with torch.no_grad():
        want = eager(ids)
        compiled = torch.compile(copy.deepcopy(eager)) if not quick else None
        for backend in backends:
            with _env("KERNELIZE_CUDA_BACKEND", backend):
                fast = copy.deepcopy(eager)
                with use_kernel_mapping(default_mapping()):
                    kernelize(fast, device=device, mode=Mode.INFERENCE)
                diff = _max_rel(fast(ids), want)
                fns = {"eager": lambda: eager(ids), "kernelize": lambda fast=fast: fast(ids)}
                if compiled is not None:
                    fns["torch.compile"] = lambda: compiled(ids)
                ms = timed(fns, device, repeat)
            result["backends"][backend or "cpu"] = {
                "max_rel_diff": diff, "ms": ms, "profile": profiled(lambda fast=fast: fast(ids), device)
            }  # fmt: skip
            assert diff <= 1e-2, f"{backend}: logits differ by {diff:.3g} of the largest"
    return result


def section_attention(device: str, quick: bool, repeat: int) -> dict:
    from kernelize.attention import scaled_dot_product_attention

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    b, h, kv, s, d = (1, 4, 2, 64, 32) if quick else (4, 16, 4, 1024, 64)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, kv, s, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        want = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        got = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        diff = _max_rel(got, want)
        ms = timed(
            {
                "sdpa": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True),
                "kernelize": lambda: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            },
            device,
            repeat,
        )
    assert diff <= 2e-2, f"attention differs from SDPA by {diff:.3g} of the largest value"
    return {"shape": [b, h, kv, s, d], "dtype": str(dtype), "max_rel_diff": diff, "ms": ms}


def section_llm(device: str, quick: bool, repeat: int) -> dict:
    import transformers

    from kernelize.integrations.transformers import kernelize_model

    sizes = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000)  # fmt: skip
    if quick:
        sizes = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)  # fmt: skip
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=4096, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    eager = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
    params = sum(p.numel() for p in eager.parameters())
    with _env("KERNELIZE_GPU_MODEL", "1"):  # the one call leaves a GPU model as it is unless asked
        fast = kernelize_model(copy.deepcopy(eager))
    prompt = torch.randint(1, sizes["vocab_size"], (1, 64 if quick else 512), device=device)
    short = prompt[:, :16]
    kw = dict(max_new_tokens=8 if quick else 32, do_sample=False, pad_token_id=0)
    kw["min_new_tokens"] = kw["max_new_tokens"]
    with torch.no_grad():
        same = torch.equal(eager.generate(short, **kw), fast.generate(short, **kw))
        # random weights give near-flat logits: greedy tokens may part on a near-tie in bf16, so the
        # prefill logits' difference is the measure of correctness, the tokens a second opinion
        diff = _max_rel(fast(prompt).logits, eager(prompt).logits)
        prefill = timed(
            {
                "eager": lambda: eager(prompt, logits_to_keep=1),
                "kernelize": lambda: fast(prompt, logits_to_keep=1),
            },
            device,
            repeat,
        )
        decode = timed(
            {"eager": lambda: eager.generate(short, **kw), "kernelize": lambda: fast.generate(short, **kw)},
            device,
            max(2, repeat // 3),
        )
        step = dict(kw, max_new_tokens=4, min_new_tokens=4)
        where = {"prefill": profiled(lambda: fast(prompt, logits_to_keep=1), device),
                 "decode_4_tokens": profiled(lambda: fast.generate(short, **step), device)}  # fmt: skip
    return {"parameters": params, "dtype": str(dtype), "same_tokens": same, "max_rel_logit_diff": diff,
            "prefill_ms": prefill, "decode_ms": decode, "new_tokens": kw["max_new_tokens"],
            "profile": where}  # fmt: skip


def section_training(device: str, quick: bool, repeat: int) -> dict:
    from kernelize import Mode, kernelize, use_kernel_mapping
    from kernelize.hub import default_mapping

    eager, ids = _demo(device, quick)
    eager.train()
    fast = copy.deepcopy(eager)
    with use_kernel_mapping(default_mapping()):
        kernelize(fast, device=device, mode=Mode.TRAINING)

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        return loss

    step(eager), step(fast)
    worst = max(
        _max_rel(q.grad, p.grad) for p, q in zip(eager.parameters(), fast.parameters(), strict=True)
        if p.grad is not None
    )  # fmt: skip
    assert worst <= 2e-2, f"gradients differ by {worst:.3g} of the largest"
    ms = timed({"eager": lambda: step(eager), "kernelize": lambda: step(fast)}, device, repeat)
    return {"max_rel_grad_diff": worst, "ms": ms}


def section_moe(device: str, quick: bool, repeat: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from moe import build

    from kernelize import inspect
    from kernelize.integrations.transformers import kernelize_model

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    eager = build("tiny" if quick else "qwen3-moe", dtype).to(device)
    # the one call leaves a GPU model as it is and keeps grouped_mm there unless asked: measure the kernels
    with _env("KERNELIZE_GPU_MODEL", "1"), _env("KERNELIZE_GPU_EXPERTS", "1"):
        fast = kernelize_model(copy.deepcopy(eager))
    experts = [c for c in inspect(fast).values() if c.layer_name == "Experts"]
    served = sum(c.uses_kernel for c in experts)
    vocab = eager.config.vocab_size
    prompt = torch.randint(1, vocab, (1, 64 if quick else 512), device=device)
    short = prompt[:, :16]
    kw = dict(max_new_tokens=8 if quick else 32, do_sample=False, pad_token_id=0)
    kw["min_new_tokens"] = kw["max_new_tokens"]
    with torch.no_grad():
        same = torch.equal(eager.generate(short, **kw), fast.generate(short, **kw))
        diff, routed_diff = _pinned_diff(eager, fast, prompt)
        prefill = timed({"eager": lambda: eager(prompt, logits_to_keep=1),
                         "kernelize": lambda: fast(prompt, logits_to_keep=1)}, device, repeat)  # fmt: skip
        runs = {"eager": lambda: eager.generate(short, **kw), "kernelize": lambda: fast.generate(short, **kw)}
        decode = timed(runs, device, max(2, repeat // 3))
    assert served == len(experts) > 0, f"the expert kernel serves {served} of {len(experts)} MoE layers"
    assert diff <= 2e-2, f"logits differ by {diff:.3g} of the largest (eager's routing replayed)"
    return {"dtype": str(dtype), "experts_layers": len(experts), "served": served, "same_tokens": same,
            "max_rel_logit_diff": diff, "max_rel_logit_diff_own_routing": routed_diff,
            "prefill_ms": prefill, "decode_ms": decode}  # fmt: skip


def _pinned_diff(eager: torch.nn.Module, fast: torch.nn.Module, prompt: torch.Tensor) -> tuple[float, float]:
    """The logits' difference with eager's routing replayed in `fast` (top-k is discontinuous: a bf16
    rounding upstream flips near-tie tokens to other experts), and with `fast`'s own routing."""
    from kernelize.model_experts import Routing

    want_routing, pinned = Routing(eager), Routing(fast)
    with want_routing.recording():
        want = eager(prompt).logits
    same_module = {id(a): id(b) for a, b in zip(want_routing.modules, pinned.modules, strict=True)}
    pinned.calls = [(same_module[m], index, weights) for m, index, weights in want_routing.calls]
    return _max_rel(pinned.pinning(lambda: fast(prompt).logits)(), want), _max_rel(fast(prompt).logits, want)


SECTIONS = {
    "layers": section_layers,
    "attention": section_attention,
    "llm": section_llm,
    "training": section_training,
    "moe": section_moe,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", default="benchmarks/results/gpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no usable CUDA GPU (torch.cuda.is_available() is False): nothing to run")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    failed = 0
    for name in args.sections.split(","):
        start = time.perf_counter()
        try:
            record = {"ok": True, **SECTIONS[name](args.device, args.quick, args.repeat)}
        except Exception as exc:  # recorded, not hidden: the other sections still run
            failed += 1
            record = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        record |= {"seconds": round(time.perf_counter() - start, 1), "machine": machine,
                   "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
                   "device": args.device}  # fmt: skip
        (out / f"{name}.json").write_text(json.dumps(record, indent=1))
        summary = {k: v for k, v in record.items() if k not in ("machine", "traceback", "command", "profile")}
        print(f"gpu_check {name}: {json.dumps(summary)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
