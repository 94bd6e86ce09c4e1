"""NHWC buffers between convolutions: which buffers the planner lays out channels-last, and that generated
kernels reading and writing them compute what the reference executor does."""

from __future__ import annotations

import math

import pytest
import torch

from kernelize.autokernel import KernelKind, PlanSettings, plan
from kernelize.autokernel.layout import channel_map
from kernelize.ir import Graph, Op, evaluate, optimize
from kernelize.runtime.compiled import compile_graph

CPU = PlanSettings(matmul="generate", merge_matmuls=True, column_reduce="library", channels_last=True)


def _conv(g: Graph, x, cin: int, cout: int, k: int = 3, groups: int = 1, stride: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = g.const(torch.randn(cout, cin // groups, k, k, generator=gen) * 0.3)
    return g.conv(x, w, stride=(stride, stride), padding=(k // 2,) * 4, groups=groups)


def _swish(g: Graph, y):
    return g.mul(y, g.sigmoid(y))


def _squeeze_excite(g: Graph, x, c: int, hidden: int, seed: int = 3):
    """``x * sigmoid(relu(mean(x) @ a) @ b)`` over channels, written as exporters do (1x1 convs)."""
    gen = torch.Generator().manual_seed(seed)
    m = g.reduce(Op.MEAN, x, (2, 3), keepdim=True)
    a = g.const(torch.randn(hidden, c, 1, 1, generator=gen) * 0.3)
    b = g.const(torch.randn(c, hidden, 1, 1, generator=gen) * 0.3)
    s = g.sigmoid(g.conv(g.clamp(g.conv(m, a), 0, math.inf), b))
    return g.mul(x, g.broadcast(s, x.shape))


def _block(batch, c: int = 12, h: int = 7, w: int = 9) -> Graph:
    """An EfficientNet block: expand, depthwise, squeeze-excite, project, residual."""
    g = Graph()
    x = g.input("x", (batch, c, h, w), "f32")
    y = _swish(g, _conv(g, x, c, 2 * c, k=1))
    y = _swish(g, _conv(g, y, 2 * c, 2 * c, groups=2 * c, seed=1))
    y = _squeeze_excite(g, y, 2 * c, 3)
    g.output(g.add(_conv(g, y, 2 * c, c, k=1, seed=2), x))
    return optimize(g)


def _check(g: Graph, inputs) -> None:
    want = evaluate(g, inputs)
    got = compile_graph(g, backend="cpu", cache=False)(*inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("c,h,w", [(12, 7, 9), (5, 1, 1), (3, 13, 5), (17, 2, 11)])
@pytest.mark.parametrize("batch", [1, 3])
def test_squeeze_excite_block_matches_reference(batch, c, h, w):
    g = _block("n", c, h, w)
    _check(g, [torch.randn(batch, c, h, w)])


def test_buffers_around_squeeze_excite_are_nhwc_and_pointwise_runs_over_channels():
    g = _block(2, 12, 17, 19)  # rows of 323 pixels: longer than a row kernel reads across NHWC
    p = plan(g, CPU)
    convs = [k for k in p.kernels if k.kind is KernelKind.CONV]
    dw = next(k for k in convs if k.node.arg.groups > 1)
    assert dw.writes[0] in p.channels_last  # read by the mean (ROW) and the excite product (POINTWISE)
    (mul,) = [k for k in p.kernels if k.kind is KernelKind.POINTWISE and k.writes[0].rank == 4]
    assert mul.writes[0] in p.channels_last  # the projection conv reads it without a copy
    assert mul.domain[-1] == mul.writes[0].shape[1]  # channels innermost: the store is contiguous
    assert mul.stores[0].strides[-1] == 1
    (mean,) = [k for k in p.kernels if k.kind is KernelKind.LIBRARY]  # torch reduces NHWC along channels
    assert mean.node.op is Op.MEAN and mean.inputs == (dw.writes[0],)


def test_an_upsample_gather_concatenated_between_convs_runs_over_channels():
    """conv -> nearest 2x upsample (a gather per image axis) -> concat with another conv's output -> conv:
    the concat's NHWC store runs over channels innermost, the gathers' indices per element as before, and
    the result is the reference's."""
    g = Graph()
    x = g.input("x", (2, 6, 9, 11), "f32")
    a = g.clamp(_conv(g, x, 6, 16, stride=2), 0, math.inf)  # 5 x 6
    idx_h = g.const(torch.arange(9) // 2)
    idx_w = g.const(torch.arange(11) // 2)
    up = g.gather(g.gather(a, idx_h, axis=2), idx_w, axis=3)
    b = g.clamp(_conv(g, x, 6, 8, seed=1), 0, math.inf)
    g.output(_conv(g, g.concat([up, b], axis=1), 24, 5, k=1, seed=2))
    p = plan(g, CPU)
    (cat,) = [k for k in p.kernels if k.kind is KernelKind.POINTWISE and k.writes[0].rank == 4]
    assert cat.writes[0] in p.channels_last and cat.domain[-1] == 24 and cat.stores[0].strides[-1] == 1
    assert any(getattr(e, "indirect", ()) for e in cat.body)
    _check(g, [torch.randn(2, 6, 9, 11)])


@pytest.mark.parametrize("c,library", [(2048, True), (1280, True), (240, False), (440, False)])
def test_a_short_mean_across_pixels_is_torchs_when_its_loads_alias_in_l1(c, library):
    """A global mean over 7 x 7 pixels of NHWC buffers: a step of 8 KiB (ResNet-50's 2048 channels) or
    5 KiB (MobileNetV2's 1280) keeps the row's loads in 1-4 L1 sets, so torch reduces it; 960 B or
    1760 B steps spread over every set and stay a generated row kernel."""
    g = Graph()
    x = g.input("x", (1, 16, 7, 7), "f32")
    g.output(g.reduce(Op.MEAN, g.clamp(_conv(g, x, 16, c, k=1), 0, math.inf), (2, 3)))
    p = plan(g, CPU)
    (conv,) = [k for k in p.kernels if k.kind is KernelKind.CONV]
    assert conv.writes[0] in p.channels_last
    (mean,) = [k for k in p.kernels if k is not conv]
    assert (mean.kind is KernelKind.LIBRARY) == library and mean.computes[0].op is Op.MEAN
    _check(g, [torch.randn(1, 16, 7, 7)])


def test_default_settings_keep_every_buffer_dense():
    p = plan(_block(2))
    assert p.channels_last == frozenset()


def test_graph_outputs_stay_dense():
    g = Graph()
    x = g.input("x", (2, 4, 5, 5), "f32")
    y = _swish(g, _conv(g, x, 4, 6))
    g.output(y, _conv(g, y, 6, 6, seed=4))
    p = plan(g, CPU)
    assert not set(g.outputs) & p.channels_last
    _check(g, [torch.randn(2, 4, 5, 5)])


def test_reader_through_a_split_view_keeps_the_buffer_dense():
    """A group-norm-like view splits the channels: no load can index that NHWC, so the buffer is NCHW."""
    g = Graph()
    x = g.input("x", (2, 6, 5, 3), "f32")
    y = _conv(g, x, 6, 6)
    grouped = g.view(y, (2, 2, 3 * 5 * 3))
    m = g.view(g.reduce(Op.MEAN, grouped, (2,), keepdim=True), (2, 2, 1, 1, 1))
    centered = g.view(g.sub(g.view(y, (2, 2, 3, 5, 3)), g.broadcast(m, (2, 2, 3, 5, 3))), (2, 6, 5, 3))
    g.output(_conv(g, g.clamp(centered, 0, math.inf), 6, 4, seed=5))
    p = plan(g, CPU)
    assert y not in p.channels_last
    (r,) = p.reasons  # the planned graph is a canonical copy: its conv is another node
    assert (r.node.op, r.node.shape, r.kind) == (Op.CONV, y.shape, "dense") and "reshape" in r.why
    _check(g, [torch.randn(2, 6, 5, 3)])


def test_row_kernel_across_pixels_keeps_its_buffer_dense():
    """A mean over H, W with an elementwise prologue over long rows would read an NHWC row with a stride
    of C: the buffer stays dense. Over short rows it is read NHWC."""
    for hw, nhwc in (((17, 19), False), ((5, 7), True)):
        g = Graph()
        x = g.input("x", (2, 6, *hw), "f32")
        y = _conv(g, x, 6, 6)
        m = g.reduce(Op.MEAN, g.exp(g.neg(y)), (2, 3), keepdim=True)
        g.output(g.add(_conv(g, y, 6, 6, seed=8), g.broadcast(m, (2, 6, *hw))))
        g = optimize(g)
        p = plan(g, CPU)
        assert [k.kind for k in p.kernels].count(KernelKind.ROW) == 1
        assert any(k.kind is KernelKind.ROW and set(k.reads) & p.channels_last for k in p.kernels) == nhwc
        whys = {(r.kind, r.why) for r in p.reasons}
        assert whys == (set() if nhwc else {("dense", "a row kernel would read it across channels")})
        _check(g, [torch.randn(2, 6, *hw)])


def test_layernorm_over_channels_reads_nhwc_rows():
    """ConvNeXt: depthwise conv, permute to NHWC, layernorm over channels, permute back, conv."""
    g = Graph()
    x = g.input("x", (3, 8, 5, 7), "f32")
    y = _conv(g, x, 8, 8, k=7, groups=8)
    t = g.layernorm(g.permute(y, (0, 2, 3, 1)), g.const(torch.rand(8) + 0.5), g.const(torch.randn(8)))
    g.output(_conv(g, g.permute(t, (0, 3, 1, 2)), 8, 8, k=1, seed=6))
    p = plan(g, CPU)
    assert y in p.channels_last
    (row,) = [k for k in p.kernels if k.kind is KernelKind.ROW]
    (load,) = [e for e in row.body if getattr(e, "buffer", None) is y]
    assert load.strides[-1] == 1  # the row runs along channels: contiguous in NHWC
    _check(g, [torch.randn(3, 8, 5, 7)])


def test_pool_and_strided_depthwise_chain():
    g = Graph()
    x = g.input("x", ("n", 5, 11, 9), "f32")
    y = g.clamp(_conv(g, x, 5, 10, stride=2), 0, 6)
    y = g.pool(y, "max", (2, 2))
    y = _swish(g, _conv(g, y, 10, 10, groups=10, seed=7))
    g.output(g.reduce(Op.MEAN, g.add(y, g.exp(g.neg(y))), (2, 3)))
    for batch in (1, 3):
        _check(g, [torch.randn(batch, 5, 11, 9)])


def _convnext_block(g: Graph, x, c: int, seed: int):
    """Depthwise 7 x 7 conv, then over (N, H, W, C) a layernorm and two linears, permuted back and added
    to the block's input."""
    gen = torch.Generator().manual_seed(seed)
    y = g.permute(_conv(g, x, c, c, k=7, groups=c, seed=seed), (0, 2, 3, 1))
    y = g.layernorm(y, g.const(torch.rand(c, generator=gen) + 0.5), g.const(torch.randn(c, generator=gen)))
    y = g.gelu(g.matmul(y, g.const(torch.randn(c, 4 * c, generator=gen) / 5)))
    y = g.matmul(y, g.const(torch.randn(4 * c, c, generator=gen) / 10))
    return g.add(x, g.permute(y, (0, 3, 1, 2)))


def test_a_linear_over_nhwc_activations_writes_its_nhwc_output_in_place():
    """Two ConvNeXt blocks and a depthwise conv: the blocks' sums are laid out NHWC, so each second linear
    stores row major, the next block's depthwise conv reads the sum as it is, and oneDNN writes the second
    block's sum itself with the first one as its residual post-op."""
    from kernelize.codegen.cpu_gemv import direct_gemm

    c = 24
    g = Graph()
    x = g.input("x", ("n", c, 6, 5), "f32")
    s1 = _convnext_block(g, x, c, 1)
    s2 = _convnext_block(g, s1, c, 2)
    g.output(_conv(g, s2, c, c, k=7, groups=c, seed=3))
    p = plan(g, CPU)
    assert {s1, s2} <= p.channels_last
    (second,) = [k for k in p.kernels if k.kind is KernelKind.MATMUL and k.writes[0] is s2]
    how = direct_gemm(second)
    assert how is not None and how.nhwc and how.residual is not None
    for n in (1, 3):  # 30 and 90 rows: oneDNN's direct path, past the few-row kernel
        _check(g, [torch.randn(n, c, 6, 5)])


def test_a_buffer_read_as_a_matmul_operand_is_dense_from_the_start():
    """A matmul loads its operands row-major: a conv output it reads (a linear over pixels) is kept dense
    by the layout rule itself, so no lowering has to ask for it and the plan carries no reason."""
    g = Graph()
    x = g.input("x", (2, 4, 5, 5), "f32")
    y = _conv(g, x, 4, 6)
    w = g.const(torch.randn(6, 3, generator=torch.Generator().manual_seed(6)))
    g.output(_conv(g, y, 6, 6, seed=7), g.matmul(g.permute(y, (0, 2, 3, 1)), w))
    p = plan(g, CPU)
    convs = [b for b in p.buffers if b.op is Op.CONV]
    assert len(convs) == 2 and not set(convs) & p.channels_last and p.reasons == ()
    _check(g, [torch.randn(2, 4, 5, 5)])


def _shuffle(g: Graph, y, groups: int):
    """ShuffleNet's channel shuffle: reshape to (N, groups, C / groups, H, W), swap those, reshape back."""
    n, c, h, w = y.shape
    return g.view(g.transpose(g.view(y, (n, groups, c // groups, h, w)), 1, 2), (n, c, h, w))


def test_channel_map_of_a_shuffle_a_slice_and_of_views_that_are_none():
    g = Graph()
    x = g.input("x", (2, 6, 4, 5), "f32")
    assert channel_map(_shuffle(g, x, 2), x) == (0, 3, 1, 4, 2, 5)
    assert channel_map(g.slice(x, 1, 2, 5), x) == (2, 3, 4)
    assert channel_map(g.transpose(x, 2, 3), x) is None  # moves pixels, not channels
    assert channel_map(g.view(x, (1, 12, 4, 5)), x) is None  # mixes the batch into channels
    assert channel_map(x, x) is None


def test_a_conv_reading_a_channel_shuffle_keeps_its_producer_nhwc():
    """A grouped 1x1 conv, the shuffle, a depthwise conv: the shuffled buffer stays NHWC (the replayed run
    gathers its channels into the next conv's input) and the result matches the reference."""
    g = Graph()
    x = g.input("x", (2, 6, 7, 5), "f32")
    y = g.clamp(_conv(g, x, 6, 12, k=1, groups=3), 0, math.inf)
    z = _conv(g, _shuffle(g, y, 3), 12, 12, groups=12, seed=1)
    g.output(g.clamp(_conv(g, z, 12, 6, k=1, groups=3, seed=2), 0, 6))
    p = plan(g, CPU)
    conv_outputs = [k.writes[0] for k in p.kernels if k.kind is KernelKind.CONV]
    assert conv_outputs[0] in p.channels_last
    _check(g, [torch.randn(2, 6, 7, 5)])
