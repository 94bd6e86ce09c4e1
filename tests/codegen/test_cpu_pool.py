"""The CPU backend's compiled pooling (kernelize/codegen/cpu_pool.py) against the reference executor."""

from __future__ import annotations

import pytest
import torch

from kernelize.codegen import cpu_pool
from kernelize.ir import Graph, evaluate
from kernelize.runtime.compiled import compile_graph

CASES = [  # (kind, input shape, kernel, stride, padding, dilation, ceil_mode, count_include_pad)
    ("max", (1, 24, 13, 11), 3, 2, (1, 1, 1, 1), 1, False, False),  # a stem pool, odd sizes
    ("avg", (2, 20, 9, 9), 3, 2, (1, 1, 1, 1), 1, False, True),  # ShuffleNet's strided-unit pool
    ("avg", (1, 5, 8, 7), 3, 2, (0, 0, 1, 1), 1, True, False),  # ceil mode, one-sided padding
    ("avg", (1, 17, 5, 6), 2, 1, (1, 1, 0, 0), 1, True, True),
    ("max", (1, 9, 7, 7), 2, 2, (0, 0, 0, 0), 1, True, False),
    ("max", (2, 3, 6, 5), 3, 1, (1, 0, 2, 1), 1, False, False),  # asymmetric padding
    ("max", (1, 8, 9, 9), 3, 1, (2, 2, 2, 2), 2, False, False),  # dilated
    ("avg", (1, 1, 1, 1), 1, 1, (0, 0, 0, 0), 1, False, False),
    ("max", (3, 40, 4, 4), 4, 4, (0, 0, 0, 0), 1, False, False),  # a global pool
]


@pytest.mark.parametrize("kind,shape,k,s,pad,dil,ceil,count_pad", CASES)
def test_pools_match_the_reference(kind, shape, k, s, pad, dil, ceil, count_pad):
    g = Graph()
    x = g.input("x", shape, "f32")
    y = g.pool(x, kind, (k, k), (s, s), pad, (dil, dil), ceil_mode=ceil, count_include_pad=count_pad)
    g.output(g.mul(y, y))  # a kernel after the pool, so its output is an intermediate buffer
    g.output(y)
    cg = compile_graph(g, backend="cpu", cache=False)
    gen = torch.Generator().manual_seed(sum(shape))
    xi = torch.randn(shape, generator=gen) * 3
    edge = torch.tensor([float("nan"), float("inf"), -0.0])  # edge values at spread positions
    flat = xi.view(-1)
    flat[torch.arange(3) * (flat.numel() // 3)] = edge[: flat.numel()]
    want = evaluate(g, [xi])
    for _ in range(2):
        for got, w in zip(cg(xi), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_the_compiled_pool_runs_and_declines_what_it_does_not_take():
    g = Graph()
    x = g.input("x", (1, 8, 6, 6), "f32")
    y = g.pool(x, "avg", (2, 2), (2, 2))
    g.output(y)
    xi = torch.randn(1, 8, 6, 6)
    assert cpu_pool.supports(y, xi) and not cpu_pool.supports(y, xi.double())
    out = cpu_pool.pool(y, xi, {})
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, torch.nn.functional.avg_pool2d(xi, 2), rtol=1e-6, atol=1e-6)
