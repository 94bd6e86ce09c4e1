"""Hand-built kernel specs for the Triton tests (the planner makes these in real use)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernelize.autokernel.kernels import Compute, Kernel, Load, PointwiseKernel, RowKernel, Store
from kernelize.ir import evaluate
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import LAYOUT, Graph, Node, Op
from kernelize.ir.shapes import Dim, numel
from kernelize.runtime import compile_graph

TOL = {DType.F32: (1e-4, 1e-5), DType.F16: (3e-3, 2e-3), DType.BF16: (2e-2, 2e-2), DType.F64: (1e-9, 1e-12)}


def contiguous(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    out: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        out.append(acc)
        acc = d * acc if not isinstance(acc, int) or not isinstance(d, int) else acc * d
    return tuple(reversed(out))


def broadcast_strides(shape: Sequence[Dim], domain: Sequence[Dim]) -> tuple[Dim, ...]:
    """Strides reading a contiguous ``shape`` right-aligned into ``domain`` (0 where broadcast)."""
    st = contiguous(shape)
    pad = len(domain) - len(shape)
    return tuple(0 if i < pad or shape[i - pad] == 1 else st[i - pad] for i in range(len(domain)))


def pointwise_from_graph(g: Graph, name: str = "k0") -> Kernel:
    """One pointwise kernel for a graph of inputs, constants, broadcasts and elementwise ops."""
    out = g.outputs[0]
    body: list = []
    pos: dict[Node, int] = {}

    def operand(n: Node) -> int:
        if n in pos:
            return pos[n]
        root = n
        while root.op in LAYOUT:
            root = root.src[0]
        if root not in pos:  # computed values are evaluated over the whole domain already
            pos[root] = len(body)
            body.append(Load(root, broadcast_strides(root.shape, out.shape)))
        pos[n] = pos[root]
        return pos[n]

    for n in g.nodes:
        if n.op in (Op.INPUT, Op.CONST) or n.op in LAYOUT:
            continue
        src = tuple(operand(s) for s in n.src)
        pos[n] = len(body)
        body.append(Compute(n.op, n.dtype, src, n.arg))
    return PointwiseKernel(name, out.shape, tuple(body), (Store(operand(out), out, contiguous(out.shape)),))


def row_kernel(
    g: Graph, x: Node, out: Node, op_entries: Sequence[Compute], params: Sequence[Node] = (), name: str = "k0"
) -> Kernel:
    """A row kernel over the last axis of ``x``: loads x and ``params`` (last-axis vectors), then entries."""
    body = [Load(x, contiguous(x.shape))]
    body += [Load(p, broadcast_strides(p.shape, x.shape)) for p in params]
    body += list(op_entries)
    st = contiguous(out.shape) if out.shape == x.shape else (*contiguous(out.shape)[:-1], 0)
    return RowKernel(name, x.shape, tuple(body), (Store(len(body) - 1, out, st),), row_rank=1)


def check(g: Graph, kernels: Sequence[Kernel], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``kernels`` through the runtime on CPU tensors (Triton interpreter) and compare with evaluate."""
    cg = compile_graph(g, backend="triton", device="cpu", plan=list(kernels))
    got = cg(*inputs)
    want = evaluate(g, inputs)
    for a, b, o in zip(got, want, g.outputs):
        assert_close(a, b, o.dtype)
    return got


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: DType) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if not dtype.is_float:
        assert torch.equal(got, want), (got, want)
        return
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)


def randn(shape, dtype: DType, gen: torch.Generator | None = None) -> torch.Tensor:
    if dtype.is_float:
        return torch.randn(tuple(shape), generator=gen).to(dtype.torch)
    if dtype is DType.BOOL:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    return torch.randint(-50, 50, tuple(shape), generator=gen).to(dtype.torch)


__all__ = [
    "TOL",
    "assert_close",
    "broadcast_strides",
    "check",
    "contiguous",
    "numel",
    "pointwise_from_graph",
    "randn",
    "row_kernel",
]
