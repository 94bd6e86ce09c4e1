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
from kernelize import Mode, hub
from kernelize.models.llama_demo import LlamaDemo, LlamaDemoConfig

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


def _tp_config():
    import transformers

    sizes = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, **sizes)
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
        if rank == 0:
            torch.save({"want": want, "sharded": sharded, "got": got, "tokens": tokens,
                        "want_tokens": want_tokens, "lines": lines}, out)  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~30 s on 2 cores
@pytest.mark.parametrize("style", ["torch", "transformers"])
def test_tensor_parallel_inference_runs_the_kernels_on_the_local_shards(style: str, tmp_path: Path) -> None:
    """Under tensor parallelism (the Megatron split) the one call runs the attention, MLP and decoder-block
    kernels on each rank's local shards, one all-reduce after o_proj and down_proj, and the logits and greedy
    tokens stay the single process's."""
    pytest.importorskip("torch.distributed.tensor.parallel", reason="needs torch's tensor-parallel API")
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_tp_config()).save_pretrained(tmp_path / "llama")
    out = tmp_path / "tp.pt"
    args = (2, _free_port(), style, str(tmp_path / "llama"), str(out))
    mp.start_processes(_tp_worker, args=args, nprocs=2, join=True, start_method="spawn")
    r = torch.load(out)
    scale = r["want"].abs().max()
    assert (r["sharded"] - r["want"]).abs().max() <= 1e-5 * scale
    assert (r["got"] - r["want"]).abs().max() <= 1e-5 * scale
    assert torch.equal(r["tokens"], r["want_tokens"]) and r["tokens"].shape == (1, 9)
    lines = r["lines"]
    kept = [line for line in lines if "is a DTensor" in line]  # transformers' plan shards lm_head (gathered)
    assert [line.split()[0] for line in kept] == (["`lm_head`"] if style == "transformers" else []), lines
    for layer in ("CausalSelfAttention", "GatedMLP", "PreNormDecoderLayer"):  # each ran its kernels
        served = [line for line in lines if f"-> kernel layer `{layer}`" in line and " ran on cpu: " in line]
        assert len(served) == 2, (layer, lines)
    assert sum("tensor-parallel local shards (2 ranks" in line for line in lines) == 4, lines
