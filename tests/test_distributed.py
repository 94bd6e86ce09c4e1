"""A kernelized model trains under DistributedDataParallel (gloo, 2 processes) and FSDP2 ``fully_shard``
on the CPU; its gradients equal single-process training on the whole batch, step after step."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import kernelize
from kernelize import Mode, hub, shm_collective
from kernelize.models.llama_demo import LlamaDemo, LlamaDemoConfig
from kernelize.shards import shards_of

STEPS = 2
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _model(family: str) -> torch.nn.Module:
    """The demo decoder kernelized by hand, or a tiny transformers Llama through the one call (projections
    through `kernelize.hub.project`, the fused loss)."""
    if family == "llama":
        import transformers

        from kernelize.integrations.transformers import kernelize_model

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
        )
        config._attn_implementation = "sdpa"
        return kernelize_model(transformers.LlamaForCausalLM(config).train(), mode=Mode.TRAINING)
    model = LlamaDemo(LlamaDemoConfig.tiny()).train()
    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=Mode.TRAINING)
    return model


def _loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    inner = getattr(model, "module", model)
    if isinstance(inner, LlamaDemo):
        return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    return model(input_ids=ids, labels=labels).loss  # the same token count on every rank: mean of means


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 12), generator=gen)
    return ids, torch.randint(0, 128, (4, 12), generator=gen)


def _train(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """STEPS SGD steps; the gradients of each step, by parameter name."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(model, ids, labels).backward()
        grads.append({n.removeprefix("module."): _full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 shard) gathered to the full tensor; a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank: int, world: int, port: int, mode: str, family: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model(family)
        ids, labels = _batch()
        mine = slice(rank * 4 // world, (rank + 1) * 4 // world)  # each rank trains on its part of the batch
        if mode == "single":
            wrapped = model
        elif mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers if family == "demo" else model.model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        grads = _train(wrapped, ids[mine], labels[mine])
        if rank == 0:
            torch.save(grads, out)
        dist.barrier()  # no rank tears gloo down while another's last collective may be in flight
    finally:
        dist.destroy_process_group()


def _spawned(world: int, mode: str, family: str, out: Path) -> list[dict[str, torch.Tensor]]:
    """The gradients rank 0 saw, training in `world` spawned processes (the single-process reference
    runs spawned too: `kernelize_model` marks transformers' classes process-wide)."""
    args = (world, _free_port(), mode, family, str(out))
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="spawn")
    return torch.load(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two spawned processes import torch and build the kernels: ~1 min on 2 cores
@pytest.mark.parametrize("family", ["demo", "llama"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_training_matches_single_process(mode: str, family: str, tmp_path: Path) -> None:
    if mode == "fsdp2":
        pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed.fsdp.fully_shard")
    got, want = (_spawned(n, m, family, tmp_path / f"{m}.pt") for n, m in ((2, mode), (1, "single")))
    for step_got, step_want in zip(got, want, strict=True):
        assert step_got.keys() == step_want.keys()
        for name, g in step_got.items():
            torch.testing.assert_close(g, step_want[name], rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")


def _tp_config(intermediate: int = 96):
    import transformers

    sizes = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=128, num_hidden_layers=2)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=intermediate, **sizes)
    config._attn_implementation = "sdpa"
    return config


def _tp_models(style: str, world: int, saved: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the whole tiny Llama, the same Llama sharded): by torch's tensor-parallel plans (q, k, v, gate, up
    colwise; o, down rowwise) or by transformers' `from_pretrained(..., tp_plan="auto")` (the same split)."""
    import transformers

    if style == "transformers":
        load = transformers.LlamaForCausalLM.from_pretrained
        return load(saved).eval(), load(saved, tp_plan="auto").eval()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    whole, model = (transformers.LlamaForCausalLM.from_pretrained(saved).eval() for _ in range(2))
    colwise = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    plan = {name: ColwiseParallel() for name in colwise}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return whole, model


def _tp_worker(rank: int, world: int, port: int, style: str, saved: str, out: str) -> None:
    """The tiny Llama sharded (`_tp_models`), then the one call: rank 0 saves the whole model's and the
    sharded model's logits (eager and kernelized), greedy tokens and `inspect`'s lines."""
    from kernelize.integrations.transformers import kernelize_model

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(env, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        whole, model = _tp_models(style, world, saved)
        ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(1))
        kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            want, want_tokens = whole(ids).logits, whole.generate(ids[:1, :5], **kw)
            sharded = model(ids).logits
            fast = kernelize_model(model)
            got = fast(ids).logits
            tokens = fast.generate(ids[:1, :5], **kw)
        lines = [str(choice) for choice in kernelize.inspect(fast).values()]
        transport = shm_collective.segment_name(shards_of(fast.model.layers[0].self_attn).group)
        if rank == 0:
            torch.save({"want": want, "sharded": sharded, "got": got, "tokens": tokens,
                        "want_tokens": want_tokens, "lines": lines, "transport": transport}, out)  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _tensor_parallel(tmp_path: Path, style: str, intermediate: int = 96) -> dict:
    """What rank 0 of `_tp_worker` saw; the logits and greedy tokens checked against the whole model's."""
    pytest.importorskip("torch.distributed.tensor.parallel", reason="needs torch's tensor-parallel API")
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_tp_config(intermediate)).save_pretrained(tmp_path / "llama")
    out = tmp_path / "tp.pt"
    args = (2, _free_port(), style, str(tmp_path / "llama"), str(out))
    mp.start_processes(_tp_worker, args=args, nprocs=2, join=True, start_method="spawn")
    r = torch.load(out)
    scale = r["want"].abs().max()
    assert (r["sharded"] - r["want"]).abs().max() <= 1e-5 * scale
    assert (r["got"] - r["want"]).abs().max() <= 1e-5 * scale
    assert torch.equal(r["tokens"], r["want_tokens"]) and r["tokens"].shape == (1, 9)
    return r


def _served(lines: list[str], layer: str) -> list[str]:
    return [line for line in lines if f"-> kernel layer `{layer}`" in line and " ran on cpu: " in line]


@pytest.mark.slow  # two spawned processes: ~30 s on 2 cores
@pytest.mark.parametrize("style", ["torch", "transformers"])
def test_tensor_parallel_inference_runs_the_kernels_on_the_local_shards(style: str, tmp_path: Path) -> None:
    """Under tensor parallelism (the Megatron split, torch's plans or transformers' `tp_plan="auto"`) the one
    call runs the attention, MLP and decoder-block kernels on each rank's local shards, one all-reduce after
    o_proj and down_proj, and the logits and greedy tokens stay the single process's."""
    r = _tensor_parallel(tmp_path, style)
    lines = r["lines"]
    kept = [line for line in lines if "is a DTensor" in line]  # transformers' plan shards lm_head (gathered)
    assert [line.split()[0] for line in kept] == (["`lm_head`"] if style == "transformers" else []), lines
    for layer in ("CausalSelfAttention", "GatedMLP", "PreNormDecoderLayer"):  # each ran its kernels
        assert len(_served(lines, layer)) == 2, (layer, lines)
    assert sum("tensor-parallel local shards (2 ranks" in line for line in lines) == 4, lines
    assert r["transport"], "the kernels' all-reduces did not go through shared memory"


@pytest.mark.slow  # two spawned processes: ~30 s on 2 cores
def test_tensor_parallel_uneven_split_keeps_the_modules_own_forward(tmp_path: Path) -> None:
    """An intermediate size the ranks do not divide (transformers' plan shards it unevenly; torch's own
    row-parallel forward fails there): the MLPs keep their own forwards with the reason, the attention still
    runs its kernels on the shards, the logits stay."""
    lines = _tensor_parallel(tmp_path, "transformers", intermediate=97)["lines"]
    mlps = [line for line in lines if ".mlp` (LlamaMLP" in line]
    assert len(mlps) == 2 and all("97 do not divide by the 2 ranks" in line for line in mlps), lines
    assert len(_served(lines, "CausalSelfAttention")) == 2 and not _served(lines, "GatedMLP"), lines


def _status_kib(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def _memory_worker(rank: int, world: int, port: int, variant: str, out: str, shape=(4, 256)) -> None:
    """One FSDP2 step's peak extra resident memory on this rank (as benchmarks/train.py measures it: the
    high-water mark reset after two warm-up steps and `zero_grad`, plus what kernelize's runtime holds
    between steps), for a Llama with a 32k vocabulary: eager, or the one call with the fused loss."""
    import transformers

    from kernelize.integrations.transformers import kernelize_model
    from kernelize.runtime.memory import held_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        sizes = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=32000)
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, **sizes)
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config).train()
        if variant == "kernelized":
            model = kernelize_model(model, mode=Mode.TRAINING)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        gen = torch.Generator().manual_seed(rank)
        ids, labels = (torch.randint(0, 32000, shape, generator=gen) for _ in range(2))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels)
            assert (out.logits is None) == (variant == "kernelized")  # the fused loss ran under FSDP2
            out.loss.backward()
            opt.step()

        step(), step()
        opt.zero_grad(set_to_none=True)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        before = _status_kib("VmRSS") - held_bytes() // 1024
        step()
        peaks = [None] * world
        dist.all_gather_object(peaks, (_status_kib("VmHWM") - before) / 1024)
        if rank == 0:
            torch.save(peaks, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # four spawned processes: ~1 min on 2 cores
@pytest.mark.parametrize("shape", [(2, 128), (4, 256)])
def test_fsdp2_step_peak_memory_of_the_one_call_is_at_most_eager(
    shape: tuple[int, int], tmp_path: Path
) -> None:
    """Per rank, an FSDP2 step of the one call (fused loss: no (tokens, 32k) logits) peaks no higher than
    the eager model's step, with few tokens (the logits matter less) and more; the numbers are printed
    (`pytest -s`)."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed.fsdp.fully_shard")
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the resident-set high-water mark")
    peaks = {}
    malloc = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}  # freed blocks leave
    saved = {k: os.environ.get(k) for k in malloc}
    os.environ.update(malloc)  # the spawned children's glibc reads them at start
    try:
        for variant in ("eager", "kernelized"):
            out = tmp_path / f"{variant}.pt"
            args = (2, _free_port(), variant, str(out), shape)
            mp.start_processes(_memory_worker, args=args, nprocs=2, join=True, start_method="spawn")
            peaks[variant] = torch.load(out)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    eager, fast = peaks["eager"], peaks["kernelized"]
    print(f"FSDP2 step peak MiB per rank, {shape[0]} x {shape[1]} tokens: eager {eager}, one call {fast}")
    for rank, (fast, eager) in enumerate(zip(peaks["kernelized"], peaks["eager"], strict=True)):
        assert fast <= eager, f"rank {rank}: kernelized {fast:.1f} MiB > eager {eager:.1f} MiB"
