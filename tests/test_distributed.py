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


def _model() -> torch.nn.Module:
    model = LlamaDemo(LlamaDemoConfig.tiny()).train()
    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=Mode.TRAINING)
    return model


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
        loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        grads.append({n.removeprefix("module."): _full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 shard) gathered to the full tensor; a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        ids, labels = _batch()
        mine = slice(rank * 2, rank * 2 + 2)  # each rank trains on half the batch
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        grads = _train(wrapped, ids[mine], labels[mine])
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two spawned processes import torch and build the kernels: ~1 min on 2 cores
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_training_matches_single_process(mode: str, tmp_path: Path) -> None:
    if mode == "fsdp2":
        pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed.fsdp.fully_shard")
    ids, labels = _batch()
    want = _train(_model(), ids, labels)
    out = tmp_path / "grads.pt"
    mp.start_processes(
        _worker, args=(2, _free_port(), mode, str(out)), nprocs=2, join=True, start_method="spawn"
    )
    got = torch.load(out)
    for step_got, step_want in zip(got, want, strict=True):
        assert step_got.keys() == step_want.keys()
        for name, g in step_got.items():
            torch.testing.assert_close(g, step_want[name], rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")
