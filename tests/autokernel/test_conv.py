"""CONV kernels: which epilogues fuse into the library convolution, and that every one runs right."""

from __future__ import annotations

import math

import pytest
import torch
from spec_interpreter import run

from kernelize.autokernel import KernelKind, PlanSettings, plan
from kernelize.ir import Graph, Op, evaluate, optimize
from kernelize.runtime.buffers import channels_last_buffers
from kernelize.runtime.compiled import compile_graph


def _conv(g: Graph, x, cin: int, cout: int, k: int = 3, groups: int = 1, pad: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = g.const(torch.randn(cout, cin // groups, k, k, generator=gen) * 0.3)
    return g.conv(x, w, padding=(pad,) * 4, groups=groups)


def _bias(g: Graph, y, c: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return g.add(y, g.broadcast(g.const(torch.randn(1, c, 1, 1, generator=gen)), y.shape))


def _check(g: Graph, inputs, want_kinds):
    p = plan(g)
    assert [k.kind for k in p.kernels] == want_kinds, str(p)
    want = evaluate(g, inputs)
    for got in (run(p, inputs), compile_graph(g, backend="cpu", cache=False)(*inputs)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    return p


@pytest.mark.parametrize("act", ["relu", "relu6", "sigmoid", "tanh", "swish"])
def test_bias_and_activation_are_post_ops(act):
    g = Graph()
    x = g.input("x", ("batch", 4, 7, 9), "f32")
    y = _bias(g, _conv(g, x, 4, 6), 6)
    y = {
        "relu": lambda: g.clamp(y, 0, math.inf),
        "relu6": lambda: g.clamp(y, 0, 6),
        "sigmoid": lambda: g.sigmoid(y),
        "tanh": lambda: g.tanh(y),
        "swish": lambda: g.mul(y, g.sigmoid(y)),
    }[act]()
    g.output(y)
    p = _check(g, [torch.randn(3, 4, 7, 9)], [KernelKind.CONV])
    ep = p.kernels[0].epilogue
    assert ep.bias is not None and ep.activation == {"relu6": "hardtanh"}.get(act, act)
    assert ep.tail is g.outputs[0]


def test_residual_add_then_relu_is_one_kernel_and_the_shortcut_conv_another():
    g = Graph()
    x = g.input("x", (2, 8, 5, 5), "f32")
    a = _conv(g, x, 8, 8, seed=2)
    b = _conv(g, x, 8, 8, k=1, pad=0, seed=3)  # the shortcut: conv(a) + conv(b) needs one of them stored
    g.output(g.clamp(g.add(a, b), 0, math.inf))
    p = _check(g, [torch.randn(2, 8, 5, 5)], [KernelKind.CONV, KernelKind.CONV])
    eps = [k.epilogue for k in p.kernels]
    assert sum(ep.residual is not None for ep in eps) == 1
    assert {ep.activation for ep in eps} == {None, "relu"}


def test_a_value_read_twice_ends_the_chain():
    g = Graph()
    x = g.input("x", (1, 4, 6, 6), "f32")
    y = _bias(g, _conv(g, x, 4, 4), 4)
    r = g.clamp(y, 0, math.inf)
    g.output(r, g.exp(y))  # y has two readers: it must be stored, relu and exp run elsewhere
    p = _check(g, [torch.randn(1, 4, 6, 6)], [KernelKind.CONV, KernelKind.POINTWISE])
    assert p.kernels[0].epilogue.activation is None


def test_graph_output_in_the_middle_stops_the_chain():
    g = Graph()
    x = g.input("x", (1, 4, 6, 6), "f32")
    y = _bias(g, _conv(g, x, 4, 4), 4)
    g.output(y, g.clamp(y, 0, math.inf))
    _check(g, [torch.randn(1, 4, 6, 6)], [KernelKind.CONV, KernelKind.POINTWISE])


def test_conv_epilogue_off_keeps_library_conv():
    g = Graph()
    x = g.input("x", (1, 4, 6, 6), "f32")
    g.output(g.clamp(_conv(g, x, 4, 4), 0, math.inf))
    p = plan(g, PlanSettings(conv_epilogue=False))
    assert [k.kind for k in p.kernels] == [KernelKind.LIBRARY, KernelKind.POINTWISE]


def test_depthwise_chain_stays_channels_last_and_asymmetric_padding_runs():
    g = Graph()
    x = g.input("x", ("batch", 8, 9, 9), "f32")
    y = g.clamp(_bias(g, _conv(g, x, 8, 8, k=1, pad=0), 8), 0, 6)
    w = g.const(torch.randn(8, 1, 3, 3))
    y = g.clamp(g.conv(y, w, stride=(2, 2), padding=(0, 0, 1, 1), groups=8), 0, 6)  # TF "same"
    z = g.add(_conv(g, y, 8, 8, k=1, pad=0, seed=5), y)  # projection + residual
    g.output(z)
    p = _check(g, [torch.randn(2, 8, 9, 9)], [KernelKind.CONV] * 3)
    cl = channels_last_buffers(p.kernels)
    assert p.kernels[0].writes[0] in cl and p.kernels[1].writes[0] in cl  # read only by convs


@pytest.mark.parametrize("shape", [(1, 3, 1, 1), (0, 3, 4, 4), (7, 3, 5, 129)])
def test_awkward_shapes(shape):
    g = Graph()
    x = g.input("x", ("n", 3, *shape[2:]), "f32")  # spatial sizes are static in the conv builder
    g.output(g.mul(y := _bias(g, _conv(g, x, 3, 5), 5), g.sigmoid(y)))
    cg = compile_graph(g, backend="cpu", cache=False)
    xs = torch.randn(shape)
    torch.testing.assert_close(cg(xs)[0], evaluate(g, [xs])[0], rtol=1e-4, atol=1e-4)


def test_generated_reader_gets_a_dense_buffer():
    """Under the default plan settings a conv output a generated kernel reads (here a mean) is stored
    NCHW (``PlanSettings.channels_last``, the cpu backend's, lays it out NHWC: see test_layout.py)."""
    g = Graph()
    x = g.input("x", (2, 4, 8, 8), "f32")
    y = g.clamp(_conv(g, x, 4, 6), 0, math.inf)
    m = g.reduce(Op.MEAN, y, (2, 3), keepdim=True)
    g.output(g.add(_conv(g, y, 6, 6, seed=7), g.broadcast(m, (2, 6, 8, 8))))
    p = _check(optimize(g), [torch.randn(2, 4, 8, 8)], [KernelKind.CONV, KernelKind.CONV, KernelKind.ROW])
    assert p.kernels[0].writes[0] not in channels_last_buffers(p.kernels)


@pytest.fixture(params=["library", "auto"])
def conv_path(request, monkeypatch):
    """Both ways a CPU conv runs: oneDNN (``library``) and the generated kernel (``auto``)."""
    monkeypatch.setenv("KERNELIZE_CPU_CONV", request.param)
    return request.param


@pytest.fixture
def onednn(monkeypatch):
    """The oneDNN path (the generated kernels would take these convs otherwise)."""
    monkeypatch.setenv("KERNELIZE_CPU_CONV", "library")


@pytest.mark.parametrize("pads", [(0, 0, 1, 1), (1, 0, 2, 1), (2, 1, 0, 0), (0, 3, 2, 0)])
@pytest.mark.parametrize("stride,dilation", [((1, 1), (1, 1)), ((2, 2), (1, 1)), ((3, 2), (2, 1))])
def test_asymmetric_padding_without_a_padded_copy(pads, stride, dilation, conv_path):
    """Asymmetric pads run as zero taps of the kernel (when the pad difference is a multiple of the
    dilation) or as a symmetric pad by whole strides and a crop of the extra leading outputs; the generated
    kernel reads its padding as zero rows."""
    g = Graph()
    x = g.input("x", ("n", 4, 11, 10), "f32")
    w = g.const(torch.randn(6, 4, 3, 3))
    g.output(g.clamp(g.conv(x, w, stride=stride, padding=pads, dilation=dilation), 0, 6))
    cg = compile_graph(g, backend="cpu", cache=False)
    (runner,) = [s.conv for s in cg._steps if s.conv is not None]
    top, left, bottom, right = pads
    whole = (bottom - top) % dilation[0] == 0 and (right - left) % dilation[1] == 0
    assert (runner.taps is not None) == whole and (runner.crop is not None) == (not whole)  # no F.pad copy
    assert (runner.generated is not None) == (conv_path == "auto")
    for n in (1, 2):
        xs = torch.randn(n, 4, 11, 10)
        want = torch.nn.functional.conv2d(
            torch.nn.functional.pad(xs, (left, right, top, bottom)), w.arg.tensor, None, stride, 0, dilation
        ).clamp(0, 6)
        torch.testing.assert_close(cg(xs)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pads", [(0, 0, 1, 1), (1, 2, 0, 1)])
def test_asymmetric_padding_with_a_residual_runs_as_zero_taps(pads, conv_path):
    """An even kernel with "same" padding keeps the input shape: the residual add stays a post-op."""
    g = Graph()
    x = g.input("x", ("n", 4, 6, 7), "f32")
    w = g.const(torch.randn(4, 4, 2, 2) if pads == (0, 0, 1, 1) else torch.randn(4, 4, 2, 4))
    y = g.clamp(g.add(g.conv(x, w, padding=pads), x), 0, math.inf)
    g.output(y)
    cg = compile_graph(g, backend="cpu", cache=False)
    (runner,) = [s.conv for s in cg._steps if s.conv is not None]
    assert runner.taps is not None and runner.residual and runner.crop is None
    for n in (1, 3):
        xs = torch.randn(n, 4, 6, 7)
        torch.testing.assert_close(cg(xs)[0], evaluate(g, [xs])[0], rtol=1e-4, atol=1e-4)


def _runners(cg):
    return [s.conv for s in cg._steps if s.conv is not None]


def _pointwise_chain(g: Graph, x, cin: int, cout: int, bias: bool, act: str):
    y = _conv(g, x, cin, cout, k=1, pad=0, seed=7)
    if bias:
        y = _bias(g, y, cout, seed=8)
    return {
        "none": lambda: y,
        "relu": lambda: g.clamp(y, 0, math.inf),
        "relu6": lambda: g.clamp(y, 0, 6),
        "sigmoid": lambda: g.sigmoid(y),
        "tanh": lambda: g.tanh(y),
        "swish": lambda: g.mul(y, g.sigmoid(y)),
        "hardswish": lambda: g.mul(y, g.mul(g.clamp(g.add(y, g.const(3.0)), 0, 6), g.const(1 / 6))),
    }[act]()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ["none", "relu", "relu6", "sigmoid", "tanh", "swish", "hardswish"])
def test_pointwise_conv_runs_as_a_gemm_with_its_post_ops(batch, bias, act, onednn):
    g = Graph()
    x = g.input("x", ("n", 5, 7, 9), "f32")
    g.output(_pointwise_chain(g, _conv(g, x, 5, 11, seed=6), 11, 13, bias, act))  # NHWC between the two
    cg = compile_graph(g, backend="cpu", cache=False)
    assert [r.gemm for r in _runners(cg)] == [False, True]
    xs = torch.randn(batch, 5, 7, 9)
    torch.testing.assert_close(cg(xs)[0], evaluate(g, [xs])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_pointwise_conv_with_a_residual_runs_as_a_gemm(batch, bias, onednn):
    g = Graph()
    x = g.input("x", ("n", 13, 5, 3), "f32")
    y = g.clamp(_conv(g, x, 13, 13, seed=2), 0, 6)
    z = _pointwise_chain(g, y, 13, 13, bias, "none")
    g.output(g.add(z, x))  # an inverted-residual block's projection
    cg = compile_graph(g, backend="cpu", cache=False)
    ((first, second),) = [_runners(cg)]
    assert not first.gemm and second.gemm and second.residual
    xs = torch.randn(batch, 13, 5, 3)
    torch.testing.assert_close(cg(xs)[0], evaluate(g, [xs])[0], rtol=1e-4, atol=1e-4)


def test_residual_then_activation_and_strided_1x1_stay_convolutions(monkeypatch, onednn):
    g = Graph()
    x = g.input("x", (2, 6, 7, 7), "f32")
    y = g.clamp(g.add(_conv(g, x, 6, 6, k=1, pad=0, seed=3), x), 0, math.inf)
    w = g.const(torch.randn(4, 6, 1, 1))
    g.output(g.conv(y, w, stride=(2, 2)))
    cg = compile_graph(g, backend="cpu", cache=False)
    assert [r.gemm for r in _runners(cg)] == [False, False]
    xs = torch.randn(2, 6, 7, 7)
    torch.testing.assert_close(cg(xs)[0], evaluate(g, [xs])[0], rtol=1e-4, atol=1e-4)


def test_conv1x1_switch_keeps_convolutions(monkeypatch, onednn):
    monkeypatch.setenv("KERNELIZE_CPU_CONV1X1", "conv")
    g = Graph()
    x = g.input("x", (1, 3, 4, 5), "f32")
    g.output(_pointwise_chain(g, x, 3, 5, True, "relu"))
    cg = compile_graph(g, backend="cpu", cache=False)
    assert [r.gemm for r in _runners(cg)] == [False]
    xs = torch.randn(1, 3, 4, 5)
    torch.testing.assert_close(cg(xs)[0], evaluate(g, [xs])[0], rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("KERNELIZE_CPU_CONV1X1", "matmul")
    with pytest.raises(ValueError, match="KERNELIZE_CPU_CONV1X1"):
        compile_graph(g, backend="cpu", cache=False)
