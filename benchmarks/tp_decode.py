"""Tensor-parallel decode on the CPU: eager TP vs kernelized TP, side by side in the same processes.

    .venv/bin/python benchmarks/tp_decode.py [--world 2] [--hidden 1024] [--layers 8] [--new-tokens 32]
                                             [--repeat 7] [--vocab 32000] [--style torch|transformers]
                                             [--out /tmp/tp_decode.json]

`--world` processes (gloo, one thread each) load the same Llama (f32, batch 1, heads = hidden / 64, a
quarter as many key/value heads, intermediate 8/3 hidden, saved once under /tmp) twice, sharded by torch's
`parallelize_module` (q, k, v, gate, up `ColwiseParallel`; o, down `RowwiseParallel`) or, `--style
transformers`, by `from_pretrained(..., tp_plan="auto")` (the same split, its linears' local fast path,
and its lm_head colwise with a gathered output), and run `kernelize_model` on the second:
its attention, MLP and decoder-block kernels read the local shards and all-reduce once after o_proj and
down_proj (`kernelize.shards`). Round-robin over the repeats, each rank times `generate` of `new` tokens and
of one (the prefill), eager and kernelized alternately; decode tokens/s = (new - 1) / (median full - median
prefill), rank 0's medians. Writes the JSON to `--out` (default under /tmp) and prints one line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
STYLES = {
    "torch": "torch parallelize_module (ColwiseParallel / RowwiseParallel)",
    "transformers": 'transformers from_pretrained(tp_plan="auto") (its lm_head colwise, gathered: eager)',
}


def config(args: argparse.Namespace):
    import transformers

    heads = args.hidden // 64
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(args.world, heads // 4),
        vocab_size=args.vocab,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    return config


def build(args: argparse.Namespace, mesh) -> torch.nn.Module:
    """The benchmark's Llama (the weights `main` saved), sharded the Megatron way: by torch's
    `parallelize_module` over `mesh`, or by transformers' `from_pretrained(..., tp_plan="auto")`."""
    import transformers
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    load = transformers.LlamaForCausalLM.from_pretrained
    if args.style == "transformers":
        return load(args.saved, tp_plan="auto", attn_implementation="sdpa").eval()
    model = load(args.saved, attn_implementation="sdpa").eval()
    plan = {n: ColwiseParallel() for n in COLWISE} | {n: RowwiseParallel() for n in ROWWISE}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from torch.distributed.device_mesh import init_device_mesh

    import kernelize
    from kernelize.integrations.transformers import kernelize_model

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world))
    os.environ.update(env, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.world))  # as torchrun sets them
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        mesh = init_device_mesh("cpu", (args.world,))
        eager = build(args, mesh)
        t0 = time.perf_counter()
        fast = kernelize_model(build(args, mesh))
        kernelize_s = time.perf_counter() - t0
        on_shards = sum("tensor-parallel local shards" in str(c) for c in kernelize.inspect(fast).values())
        prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(0))

        def gen(m: torch.nn.Module, n: int) -> torch.Tensor:
            return m.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        variants = {"eager": eager, "kernelized": fast}
        tokens = {name: gen(m, args.new_tokens) for name, m in variants.items()}  # warm-up
        times: dict[str, list[float]] = {f"{n}/{k}": [] for n in variants for k in ("full", "prefill")}
        for _ in range(args.repeat):
            for name, m in variants.items():
                for kind, n in (("full", args.new_tokens), ("prefill", 1)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    gen(m, n)
                    times[f"{name}/{kind}"].append(time.perf_counter() - t0)
        if rank == 0:
            report(args, times, tokens, kernelize_s, on_shards)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def report(args, times, tokens, kernelize_s: float, on_shards: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    tok_s = {
        n: (args.new_tokens - 1) / (med[f"{n}/full"] - med[f"{n}/prefill"]) for n in ("eager", "kernelized")
    }
    out = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "world": args.world,
        "threads_per_rank": 1,
        "hidden": args.hidden,
        "layers": args.layers,
        "vocab": args.vocab,
        "dtype": "float32",
        "batch": 1,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "tp_style": STYLES[args.style],
        "modules_on_local_shards": on_shards,
        "kernelize_model_s": kernelize_s,
        "same_tokens": bool(torch.equal(tokens["eager"], tokens["kernelized"])),
        "median_s": med,
        "eager_tok_s": tok_s["eager"],
        "kernelized_tok_s": tok_s["kernelized"],
        "kernelized_vs_eager": tok_s["kernelized"] / tok_s["eager"],
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"TP decode ({args.style}), {args.world} ranks x 1 thread, Llama hidden {args.hidden}, "
        f"{args.layers} layers, f32, batch 1: eager {tok_s['eager']:.1f} tok/s, "
        f"kernelized {tok_s['kernelized']:.1f} tok/s "
        f"({out['kernelized_vs_eager']:.2f}x), same tokens {out['same_tokens']}, "
        f"{on_shards} modules on local shards -> {args.out}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--style", choices=tuple(STYLES), default="torch", help="who shards the model")
    ap.add_argument("--out", default="/tmp/tp_decode.json")
    args = ap.parse_args()
    import tempfile

    import transformers

    torch.manual_seed(0)
    saved = tempfile.TemporaryDirectory(prefix="tp_decode_")  # the weights both variants load, under /tmp
    transformers.LlamaForCausalLM(config(args)).save_pretrained(saved.name)
    args.saved = saved.name
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(run, args=(args, port), nprocs=args.world, join=True, start_method="spawn")
    finally:
        saved.cleanup()


if __name__ == "__main__":
    main()
