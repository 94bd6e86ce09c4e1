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
