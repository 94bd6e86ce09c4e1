"""conv_pad: zero padding of the spatial dims folds into the conv; anything else stays."""

from __future__ import annotations

import torch

from kernelize.ir import Graph, Op, evaluate, verify
from kernelize.passes.conv_pad import conv_pad


def _graph(pads, value=0.0):
    g = Graph()
    x = g.input("x", (2, 3, 7, 8), "f32")
    p = g.pad(x, pads, value)
    g.output(g.conv(p, g.const(torch.randn(4, 3, 3, 3)), stride=(2, 2), padding=(1, 0, 0, 1)))
    return g


def test_spatial_zero_pad_folds_into_conv_padding():
    g = _graph(((0, 0), (0, 0), (0, 1), (2, 1)))
    out = conv_pad(g)
    verify(out)
    conv = out.outputs[0]
    assert conv.op is Op.CONV and conv.src[0].op is Op.INPUT and conv.arg.padding == (1, 2, 1, 2)
    x = torch.randn(2, 3, 7, 8)
    torch.testing.assert_close(evaluate(out, [x])[0], evaluate(g, [x])[0], rtol=1e-5, atol=1e-5)


def test_nonzero_value_batch_pad_and_crop_stay():
    for pads, value in [
        (((0, 0), (0, 0), (1, 1), (1, 1)), 1.0),
        (((1, 0), (0, 0), (1, 1), (1, 1)), 0.0),
        (((0, 0), (0, 0), (-1, 1), (1, 1)), 0.0),
    ]:
        out = conv_pad(_graph(pads, value))
        assert out.outputs[0].src[0].op is not Op.INPUT, pads  # the pad (or crop) stays


POOL_CASES = [  # (kind, pad value, pool padding, count_include_pad, ceil_mode, folds)
    ("avg", 0.0, (0, 0, 0, 0), False, False, True),  # torch's opset-9 count_include_pad export
    ("avg", 0.0, (1, 0, 1, 0), True, False, True),
    ("avg", 0.0, (1, 0, 1, 0), False, False, False),  # its own padding is not counted, the pad's is
    ("avg", 1.0, (0, 0, 0, 0), True, False, False),
    ("avg", 0.0, (0, 0, 0, 0), True, True, False),  # ceil mode
    ("max", -float("inf"), (1, 1, 0, 0), False, False, True),
    ("max", 0.0, (0, 0, 0, 0), False, False, False),  # a zero pad changes a maximum of negatives
]


def test_pads_fold_into_pools_that_pad_the_same_way():
    for kind, value, padding, count, ceil, folds in POOL_CASES:
        g = Graph()
        x = g.input("x", (2, 3, 7, 8), "f32")
        p = g.pad(x, ((0, 0), (0, 0), (1, 2), (0, 1)), value)
        g.output(g.pool(p, kind, (3, 3), (2, 2), padding, ceil_mode=ceil, count_include_pad=count))
        out = conv_pad(g)
        verify(out)
        assert (out.outputs[0].src[0].op is Op.INPUT) == folds, (kind, value, padding, count, ceil)
        xi = torch.randn(2, 3, 7, 8) - 1  # mostly negative: a zero pad would change a maximum
        torch.testing.assert_close(evaluate(out, [xi])[0], evaluate(g, [xi])[0], rtol=1e-6, atol=1e-6)
