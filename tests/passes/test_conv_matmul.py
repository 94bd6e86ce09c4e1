"""conv_matmul: a 1x1 conv of a 1x1 image (squeeze-and-excite) becomes a matmul; other convs stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernelize.ir import Graph, Op, evaluate, op_counts, optimize, verify
from kernelize.passes.conv_matmul import conv_matmul
from kernelize.passes.dce import dce
from kernelize.runtime.compiled import compile_graph


def _se_block(image: int = 1, kernel: int = 1, groups: int = 1, padding=(0, 0, 0, 0)):
    """GAP -> conv + bias -> silu -> conv + bias -> sigmoid, over a batch of `n` images."""
    g = Graph()
    x = g.input("x", ("n", 16, image, image), "f32")
    w1, b1 = torch.randn(4, 16 // groups, kernel, kernel), torch.randn(4)
    w2, b2 = torch.randn(16, 4, 1, 1), torch.randn(16)
    h = g.conv(x, g.const(w1), g.const(b1), groups=groups, padding=padding)
    h = g.mul(h, g.sigmoid(h))
    g.output(g.sigmoid(g.conv(h, g.const(w2), g.const(b2))))
    return g, (w1, b1, w2, b2)


def test_pooled_1x1_convs_become_matmuls_with_the_same_result():
    g, (w1, b1, w2, b2) = _se_block()
    out = dce(conv_matmul(g))
    verify(out)
    counts = op_counts(out)
    assert counts.get("conv", 0) == 0 and counts["matmul"] == 2, counts
    for n in (1, 3, 17):
        x = torch.randn(n, 16, 1, 1)
        want = torch.sigmoid(F.conv2d(F.silu(F.conv2d(x, w1, b1)), w2, b2))
        torch.testing.assert_close(evaluate(out, [x])[0], want, rtol=1e-5, atol=1e-5)
        cg = compile_graph(optimize(g), backend="cpu")
        torch.testing.assert_close(cg(x)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "image,kernel,groups,padding", [(2, 1, 1, (0, 0, 0, 0)), (1, 1, 2, (0, 0, 0, 0)), (1, 1, 1, (1, 1, 1, 1))]
)
def test_other_convs_stay(image, kernel, groups, padding):
    g, _ = _se_block(image, kernel, groups, padding)
    out = dce(conv_matmul(g))
    assert out.outputs[0].op is not Op.MATMUL and op_counts(out)["conv"] >= 1
