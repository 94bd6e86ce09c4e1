"""The shared-memory all-reduce (gloo, spawned processes on this host) gives `dist.all_reduce`'s bits,
sums in rank order, falls back where it must, leaves nothing in /dev/shm and unmaps when the process
group goes."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernelize import shm_collective
from kernelize.shm_collective import SLOT_BYTES

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
EDGES = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e4, -1e-30, 3.0])


def _partial(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank + n)) * 10 ** (rank + 1)
    t[: min(n, len(EDGES))] = EDGES[: min(n, len(EDGES))] * (rank + 1)
    return t.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of `t`, every NaN made one (torch's own bf16 adds give 0x7fc0 scalar, 0xffff vectorized)."""
    t = torch.where(t.isnan(), torch.tensor(float("nan"), dtype=t.dtype), t)
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _cases() -> list[tuple[int, torch.dtype]]:
    sizes = (0, 1, 7, 1024, 4097, SLOT_BYTES // 4, SLOT_BYTES // 4 + 1)  # the last f32 one falls back
    return [(n, dt) for dt in (torch.float32, torch.bfloat16) for n in sizes]


def _maps_lines(name: str) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if name in line]


def _worker(rank: int, world: int, port: int, out: str, env_off_rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == env_off_rank:
        os.environ[shm_collective.ENV] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    got, want, partials = {}, {}, {}
    for n, dtype in _cases():
        partials[n, dtype] = p = _partial(rank, n, dtype)
        got[n, dtype] = shm_collective.all_reduce(p.clone(), group)
        want[n, dtype] = p.clone()
        dist.all_reduce(want[n, dtype], group=group)
    strided = _partial(rank, 64, torch.float32)[::2]  # not contiguous: through torch.distributed
    got["strided"], want["strided"] = shm_collective.all_reduce(strided.clone(), group), strided.clone()
    dist.all_reduce(want["strided"], group=group)
    sub = dist.new_group(list(range(world)))  # a second group: its own segment, unmapped when freed
    shm_collective.all_reduce(torch.ones(3), sub)
    name, sub_name = shm_collective.segment_name(group), shm_collective.segment_name(sub)
    mapped = bool(name) and bool(sub_name) and len(_maps_lines(name)) == len(_maps_lines(sub_name)) == 1
    in_dev_shm = any(Path(f"/dev/shm{n}").exists() for n in (name, sub_name) if n)
    late = None
    if rank == 0 and name:  # rank 1 skips this call: rank 0 names it after the (shortened) timeout
        shm_collective.TIMEOUT_S = 0.5
        try:
            shm_collective.all_reduce(torch.ones(4), group)
        except RuntimeError as e:
            late = str(e)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (got, partials), group=group)
    dist.destroy_process_group()
    del sub
    gc.collect()  # the subgroup, freed: its segment unmapped
    sub_unmapped = not sub_name or not _maps_lines(sub_name)
    with contextlib.suppress(RuntimeError, ValueError):  # the world group, still held: unmapped at the next
        shm_collective.all_reduce(torch.ones(1), group)  # call (torch's own all-reduce then runs or raises)
    unmapped = not name or not _maps_lines(name)
    if rank == 0:
        torch.save(dict(everyone=everyone, want=want, name=name, mapped=mapped, in_dev_shm=in_dev_shm,
                        late=late, unmapped=unmapped, sub_unmapped=sub_unmapped), out)  # fmt: skip


def _run(tmp_path: Path, world: int, env_off_rank: int = -1) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.pt"
    mp.start_processes(
        _worker, args=(world, port, str(out), env_off_rank), nprocs=world, start_method="spawn"
    )
    return torch.load(out, weights_only=False)


def _check_sums(r: dict, world: int) -> None:
    """Every rank's result has the same bits, those of the rank-order sum of the partials (a bf16 sum
    rounded after each add, as torch's `a + b`), and with two ranks those of `dist.all_reduce`; a tensor
    larger than a slot, or strided, gets `dist.all_reduce`'s."""
    (got0, _), others = r["everyone"][0], r["everyone"][1:]
    for n, dtype in _cases():
        for got, _ in others:
            assert torch.equal(_bits(got[n, dtype]), _bits(got0[n, dtype])), (n, dtype)
        ordered = r["everyone"][0][1][n, dtype].clone()
        for _, theirs in others:
            ordered = ordered + theirs[n, dtype]
        if n * dtype.itemsize <= SLOT_BYTES:  # a larger one goes through gloo (its own order past 2 ranks)
            assert torch.equal(_bits(got0[n, dtype]), _bits(ordered)), (n, dtype)
        if world == 2:
            assert torch.equal(_bits(got0[n, dtype]), _bits(r["want"][n, dtype])), (n, dtype)
    strided, want = got0["strided"], r["want"]["strided"]  # gloo's both: past 2 ranks its order may vary
    assert (
        torch.equal(_bits(strided), _bits(want))
        if world == 2
        else torch.allclose(strided, want, 1e-6, equal_nan=True)
    )


@pytest.mark.slow  # spawned processes: ~20 s on 2 cores
@pytest.mark.parametrize("world", [2, 3])
def test_shm_all_reduce_gives_dist_all_reduce_bits_in_rank_order(world: int, tmp_path: Path) -> None:
    r = _run(tmp_path, world)
    assert r["name"] and r["mapped"], "the group did not get the shared-memory transport"
    _check_sums(r, world)
    assert not r["in_dev_shm"], f"{r['name']} still in /dev/shm after every rank mapped it"
    assert r["late"] and "rank 1 did not arrive within 0.5 s" in r["late"], r["late"]
    assert r["unmapped"] and r["sub_unmapped"], "a segment stayed mapped after the process group went"
    assert not Path(f"/dev/shm{r['name']}").exists()


@pytest.mark.slow  # spawned processes: ~15 s on 2 cores
def test_shm_all_reduce_off_on_one_rank_falls_back_on_all(tmp_path: Path) -> None:
    r = _run(tmp_path, 2, env_off_rank=1)
    assert r["name"] is None and r["late"] is None and r["unmapped"]
    for n, dtype in _cases():
        assert torch.equal(_bits(r["everyone"][0][0][n, dtype]), _bits(r["want"][n, dtype])), (n, dtype)


@pytest.mark.parametrize(
    "views, why",
    [
        ([("a", None), ("a", None)], None),
        ([("a", None)], "1 ranks (the segment serves 2 to 32)"),
        ([("a", None), ("b", None)], "the ranks run on 2 hosts (a, b)"),
        ([("a", None), ("a", "KERNELIZE_SHM_ALLREDUCE=0")], "rank 1: KERNELIZE_SHM_ALLREDUCE=0"),
    ],
)
def test_refusal_reasons(views, why) -> None:
    assert shm_collective._refusal(views) == why
