"""kernelize.hub: signatures, symbolic dims, backend choice, caching and what `inspect` reports."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from torch import nn

import kernelize
from kernelize import hub


def _add_mul(x: torch.Tensor, y: torch.Tensor, *, alpha: float) -> torch.Tensor:
    return (x + y) * alpha


def test_dim_names_align_from_the_right() -> None:
    q, k, cos = torch.empty(2, 8, 5, 16), torch.empty(2, 4, 5, 16), torch.empty(1, 1, 5, 16)
    w = torch.empty(16)
    names = hub.dim_names([q, k, cos, w], [True, True, True, False])
    assert names[0] == {0: "n4", 1: "n3", 2: "n2"}
    assert names[1] == {0: "n4", 1: "n3_1", 2: "n2"}  # fewer key heads: its own symbol
    assert names[2] == {2: "n2"}  # broadcast dims stay 1
    assert names[3] == {}  # weights are static


def test_backend_choice(monkeypatch) -> None:
    assert hub.backend_for(torch.device("cpu")) == "cpu"
    assert hub.backend_for(torch.device("cuda")) in ("triton", "cuda")
    monkeypatch.setenv("KERNELIZE_CUDA_BACKEND", "cuda")
    if torch.version.hip is None:
        assert hub.backend_for(torch.device("cuda")) == "cuda"
    monkeypatch.setenv("KERNELIZE_CUDA_BACKEND", "bogus")
    if torch.version.hip is None:
        with pytest.raises(ValueError, match="KERNELIZE_CUDA_BACKEND"):
            hub.backend_for(torch.device("cuda"))
    with hub.use_backend("reference"):
        assert hub.backend_for(torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="no kernel backend"):
        hub.backend_for(torch.device("meta"))


CPU = torch.device("cpu")


def test_use_backend_does_not_leak_into_other_threads() -> None:
    seen: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def worker() -> None:
        entered.wait(5)
        seen.append(hub.backend_for(CPU))  # while the main thread is inside use_backend("reference")
        release.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with hub.use_backend("reference"):
        entered.set()
        release.wait(5)
        assert hub.backend_for(CPU) == "reference"
    thread.join(5)
    assert seen == ["cpu"]


def test_use_backend_blocks_left_out_of_order_restore_correctly() -> None:
    outer, inner = hub.use_backend("reference"), hub.use_backend("triton")
    outer.__enter__()
    inner.__enter__()
    assert hub.backend_for(CPU) == "triton"
    outer.__exit__(None, None, None)  # the outer block ends first: the inner one is still open
    assert hub.backend_for(CPU) == "triton"
    inner.__exit__(None, None, None)
    assert hub.backend_for(CPU) == "cpu"


def test_use_backend_is_private_to_each_asyncio_task() -> None:
    async def task(name: str, started: asyncio.Event, other: asyncio.Event) -> str:
        with hub.use_backend(name):
            started.set()
            await other.wait()  # the other task enters its own block meanwhile
            return hub.backend_for(CPU)

    async def main() -> list[str]:
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task("reference", a, b), task("triton", b, a))

    assert asyncio.run(main()) == ["reference", "triton"]
    assert hub.backend_for(CPU) == "cpu"


def test_use_backend_rejects_unknown_backends() -> None:
    with pytest.raises(
        ValueError, match=r"use_backend\('tritonn'\): unknown backend; choose one of reference"
    ):
        with hub.use_backend("tritonn"):
            pass
    assert hub.backend_for(CPU) == "cpu"


def test_run_compiles_once_per_signature() -> None:
    x, y = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    out = hub.run(None, _add_mul, [x, y], alpha=2.0)
    torch.testing.assert_close(out, (x + y) * 2.0)
    n = hub.compiled_count()
    hub.run(
        None, _add_mul, [torch.randn(4, 9, 8), torch.randn(4, 9, 8)], alpha=2.0
    )  # new lengths: same kernel
    assert hub.compiled_count() == n
    out = hub.run(None, _add_mul, [x, y], alpha=3.0)  # new parameter: new signature
    torch.testing.assert_close(out, (x + y) * 3.0)
    assert hub.compiled_count() == n + 1
    hub.run(None, _add_mul, [x.double(), y.double()], alpha=3.0)  # new dtype: new signature
    assert hub.compiled_count() == n + 2


def _pick_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, ids) * 2.0


class _Picker(nn.Module):
    pass


def test_an_index_out_of_range_names_the_layer_and_its_math() -> None:
    table = torch.randn(6, 8)
    torch.testing.assert_close(
        hub.run(_Picker(), _pick_rows, [torch.tensor([5, 0])], [table]), table[[5, 0]] * 2
    )
    for bad in ([6, 0], [0, -1]):  # past the end; negative (torch's index_select raises on it too)
        with pytest.raises(IndexError, match=r"^_Picker \(_pick_rows\): .*out of range.*\[-6, 6\)"):
            hub.run(_Picker(), _pick_rows, [torch.tensor(bad)], [table])
    with pytest.raises(IndexError, match=r"^_pick_rows: "):
        hub.run(None, _pick_rows, [torch.tensor([7])], [table])


def test_inspect_lists_backend_and_kernels() -> None:
    @kernelize.use_kernel_forward_from_hub("RMSNorm")
    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x

    model = nn.Sequential(Norm())
    with kernelize.use_kernel_mapping(hub.default_mapping()):
        kernelize.kernelize(model, device="cpu", mode=kernelize.Mode.INFERENCE)
    choice = kernelize.inspect(model)["0"]
    assert choice.uses_kernel and choice.backend is None  # nothing ran yet
    with torch.no_grad():
        model(torch.randn(2, 16))
    choice = kernelize.inspect(model)["0"]
    assert choice.backend == "cpu" and choice.kernels
    name, digest = choice.kernels[0]
    assert name and len(digest) >= 8
    assert "ran on cpu" in str(choice)
    assert hub.kernels_ran(model[0]).kernels == choice.kernels
    assert hub.compiled_ran(model[0]).graph is not None


def test_torch_compile_fullgraph_goes_through_the_custom_op(hub_pkg) -> None:
    """Once a signature is compiled, torch.compile traces a hub layer to `kernelize::run_graph`: no break."""
    import torch._dynamo

    norm_layer, act_layer = hub_pkg["layer_norm"].RMSNorm, hub_pkg["activation"].SiluAndMul

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return act_layer.forward(self, norm_layer.forward(self, x).repeat(1, 1, 2)) * 2

    block = Block()
    with torch.no_grad():
        want = block(torch.randn(2, 5, 32))  # eager call compiles the kernels
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(torch.randn(2, 5, 32))
        assert explained.graph_break_count == 0, explained.break_reasons
        ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert sum(op is torch.ops.kernelize.run_graph for op in ops) == 2, ops
        x = torch.randn(3, 7, 32)  # another batch and length: same kernels
        got = torch.compile(block, fullgraph=True, dynamic=True)(x)
        torch.testing.assert_close(got, block(x))
    assert want.shape == (2, 5, 32)
