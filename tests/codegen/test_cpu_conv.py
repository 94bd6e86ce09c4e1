"""The CPU backend's generated convolutions (kernelize/codegen/cpu_conv.py) against the reference executor."""

from __future__ import annotations

import math

import pytest
import torch

from kernelize.autokernel import KernelKind, PlanSettings, plan
from kernelize.codegen import cpu_conv
from kernelize.codegen.cpu import CpuRenderer
from kernelize.codegen.cpu_build import build_shared_object, load
from kernelize.ir import Graph, Op, evaluate
from kernelize.runtime.compiled import compile_graph

ACTS = {
    "none": lambda g, y: y,
    "relu": lambda g, y: g.clamp(y, 0, math.inf),
    "relu6": lambda g, y: g.clamp(y, 0, 6),
    "sigmoid": lambda g, y: g.sigmoid(y),
    "tanh": lambda g, y: g.tanh(y),
    "swish": lambda g, y: g.mul(y, g.sigmoid(y)),
}


def _graph(
    x_shape, cout, k, *, stride=1, pad=(0, 0, 0, 0), dil=1, groups=1, bias=True, res=False, act="relu"
):
    """conv (+ bias) (+ residual input) (+ activation) over an input of ``x_shape``."""
    g = Graph()
    x = g.input("x", x_shape, "f32")
    gen = torch.Generator().manual_seed(len(x_shape) + cout + k)
    w = g.const(torch.randn(cout, x_shape[1] // groups, k, k, generator=gen) * 0.3)
    b = g.const(torch.randn(cout, generator=gen)) if bias else None
    y = g.conv(x, w, b, stride=(stride, stride), padding=pad, dilation=(dil, dil), groups=groups)
    if res:
        y = g.add(y, g.input("r", tuple(y.shape), "f32"))
    g.output(ACTS[act](g, y))
    return g


def _generated(cg) -> list[bool]:
    return [st.conv.generated is not None for st in cg._steps if st.conv is not None]


def _check(g, inputs, *, generated=True, rtol=1e-4):
    cg = compile_graph(g, backend="cpu", cache=False)
    if generated is not None:
        assert _generated(cg) == [generated]
    want = evaluate(g, inputs)
    for _ in range(2):  # the second call runs with the packed weight and the arena of the first
        got = cg(*inputs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)
    return cg


CASES = [  # (input shape, out channels, kernel, options): awkward sizes, every padding and stride form
    ((1, 16, 14, 14), 96, 1, {}),  # an expansion 1x1
    ((2, 33, 7, 5), 17, 1, {}),  # channels off every vector width; a group of <= 16 outputs
    ((3, 7, 9, 11), 40, 1, dict(stride=2)),  # strided 1x1
    ((1, 3, 33, 31), 32, 3, dict(stride=2, pad=(1, 1, 1, 1))),  # an RGB stem: row segments
    ((1, 3, 32, 32), 24, 3, dict(stride=2, pad=(0, 0, 1, 1))),  # TF "same": asymmetric
    ((2, 8, 9, 10), 64, 3, dict(pad=(1, 2, 0, 1), dil=2)),  # dilation: per-tap rows
    ((1, 64, 6, 6), 64, 3, dict(pad=(1, 1, 1, 1))),
    ((1, 5, 4, 4), 7, 5, dict(pad=(2, 2, 2, 2))),  # a kernel larger than the image
    ((1, 2, 12, 40), 80, 7, dict(stride=2, pad=(3, 3, 3, 3))),  # 49 taps
    ((2, 64, 5, 5), 64, 3, dict(groups=2, pad=(1, 1, 1, 1))),  # groups of 32 channels
    ((1, 60, 7, 9), 48, 1, dict(groups=3)),  # ShuffleNet's groups of 16 outputs
]


@pytest.mark.parametrize("x_shape, cout, k, opts", CASES)
@pytest.mark.parametrize("act", ["relu6", "swish"])
def test_dense_convs_match_the_reference(x_shape, cout, k, opts, act):
    g = _graph(x_shape, cout, k, act=act, **opts)
    _check(g, [torch.randn(x_shape)])


DEPTHWISE = [  # (input shape, kernel, options): the sliding-window shapes, borders, odd channel counts
    ((1, 96, 16, 16), 3, dict(stride=2, pad=(0, 0, 1, 1))),
    ((2, 144, 9, 21), 3, dict(pad=(1, 1, 1, 1))),
    ((1, 40, 12, 12), 5, dict(pad=(2, 2, 2, 2))),
    ((1, 24, 11, 13), 5, dict(stride=2, pad=(1, 1, 2, 2))),
    ((1, 7, 8, 9), 3, dict(pad=(1, 1, 1, 1), dil=2)),  # dilation: the general form
    ((1, 33, 3, 30), 3, dict(pad=(0, 1, 0, 1))),  # a partial channel block
    ((1, 40, 9, 19), 7, dict(pad=(3, 3, 3, 3))),  # ConvNeXt's 7 x 7, sliding; a row of 19 = 2 runs + 3
    ((1, 16, 2, 2), 3, dict(pad=(1, 1, 1, 1))),  # no interior at all
]


@pytest.mark.parametrize("x_shape, k, opts", DEPTHWISE)
@pytest.mark.parametrize("act", ["none", "relu", "sigmoid"])
def test_depthwise_convs_match_the_reference(x_shape, k, opts, act):
    c = x_shape[1]
    g = _graph(x_shape, c, k, groups=c, act=act, **opts)
    _check(g, [torch.randn(x_shape)])


MULTIPLIER = [  # (input shape, multiplier, kernel, options): output channel o reads input channel o // m
    ((1, 16, 12, 13), 2, 3, dict(pad=(1, 1, 1, 1))),  # the sliding window; 32 outputs, two vectors
    ((2, 7, 9, 10), 3, 3, dict(pad=(1, 1, 1, 1))),  # m off every vector width: block 2 starts at c0 % m = 1
    ((1, 12, 11, 9), 4, 3, dict(stride=2, pad=(0, 1, 0, 1))),  # strided: the general form
    ((1, 7, 8, 9), 2, 5, dict(pad=(2, 2, 2, 2), dil=2)),  # dilated
    ((1, 3, 6, 6), 5, 3, dict(pad=(1, 1, 1, 1))),  # 15 outputs: a partial channel block
]


@pytest.mark.parametrize("x_shape, m, k, opts", MULTIPLIER)
@pytest.mark.parametrize("act", ["none", "relu6"])
def test_depthwise_convs_with_a_channel_multiplier_match_the_reference(x_shape, m, k, opts, act):
    c = x_shape[1]
    g = _graph(x_shape, c * m, k, groups=c, act=act, **opts)
    cg = _check(g, [torch.randn(x_shape)])
    assert "depthwise conv" in cpu_conv.render(cg.plan.kernels[0], CpuRenderer())[0]


def test_a_tall_depthwise_kernel_with_a_multiplier_takes_the_general_form():
    """17 x 3 (more kernel rows than the sliding window's 16 row pointers) with multiplier 2."""
    g = Graph()
    x = g.input("x", (1, 2, 24, 7), "f32")
    w = g.const(torch.randn(4, 1, 17, 3, generator=torch.Generator().manual_seed(3)))
    g.output(g.conv(x, w, padding=(8, 1, 8, 1), groups=2))
    _check(g, [torch.randn(1, 2, 24, 7)])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", list(ACTS))
def test_residual_and_every_activation(bias, act):
    g = _graph((2, 12, 6, 7), 12, 1, bias=bias, res=True, act=act)
    x = torch.randn(2, 12, 6, 7)
    _check(g, [x, torch.randn(2, 12, 6, 7)])


NCHW = [  # convs reading the graph's NCHW input as it comes (short kernel rows): every stride form
    ((1, 3, 33, 31), 16, 3, dict(stride=2, pad=(1, 1, 1, 1))),  # a MobileNet stem, odd sizes
    ((2, 3, 9, 20), 8, 3, dict(pad=(1, 1, 1, 1))),  # stride 1, half a panel of outputs, a batch
    ((1, 3, 17, 23), 40, 3, dict(stride=3, pad=(0, 2, 1, 0))),  # stride 3 (read at run time), asymmetric
    ((1, 3, 16, 16), 20, 3, dict(stride=4, pad=(1, 1, 1, 1), dil=2)),  # stride 4, dilated, a partial panel
    ((1, 2, 6, 7), 48, 4, dict(stride=2, pad=(3, 3, 3, 3), dil=3)),  # a kernel wider than the image
    ((3, 7, 9, 11), 24, 1, dict(stride=2)),  # a strided 1x1 over 7 channels
]


@pytest.mark.parametrize("x_shape, cout, k, opts", NCHW)
@pytest.mark.parametrize("res", [False, True])
def test_convs_read_an_nchw_input_as_it_comes(x_shape, cout, k, opts, res):
    g = _graph(x_shape, cout, k, res=res, act="relu6", **opts)
    inputs = [torch.randn(shape) for shape in (i.shape for i in g.inputs)]
    cg = _check(g, inputs)
    (step,) = [st for st in cg._steps if st.conv is not None]
    call = step.compiled.launch.__self__
    assert call.nchw and [key[-1] for key in call._dims] == [True]  # read NCHW, replayed or not
    # the same conv over the input copied channels-last takes the NHWC tiles: the same sums, bit for bit
    cl = torch.channels_last
    w = cg._consts[step.kernel.epilogue.conv.src[1]]
    r = inputs[1].contiguous(memory_format=cl) if res else None
    nhwc = call.fresh([inputs[0].contiguous(memory_format=cl), w, step.conv.bias, r])[0]
    assert [key[-1] for key in call._dims] == [True, False]
    torch.testing.assert_close(nhwc, call.fresh([inputs[0], w, step.conv.bias, r])[0], rtol=0, atol=0)


def test_nan_and_inf_propagate_through_the_vector_epilogue():
    g = _graph((1, 4, 5, 5), 32, 1, act="relu6", bias=False)
    x = torch.randn(1, 4, 5, 5)
    x[0, :, 1, 2] = math.nan
    x[0, 0, 3, 3] = math.inf
    cg = compile_graph(g, backend="cpu", cache=False)
    got, want = cg(x)[0], evaluate(g, [x])[0]
    assert torch.isnan(got[0, :, 1, 2]).all()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_a_batch_of_zero_and_a_symbolic_batch():
    g = Graph()
    x = g.input("x", ("n", 6, 5, 5), "f32")
    g.output(g.conv(x, g.const(torch.randn(8, 6, 3, 3)), padding=(1, 1, 1, 1)))
    cg = compile_graph(g, backend="cpu", cache=False)
    for n in (0, 1, 5):
        x = torch.randn(n, 6, 5, 5)
        torch.testing.assert_close(cg(x)[0], evaluate(g, [x])[0], rtol=1e-4, atol=1e-4)


def test_narrow_groups_and_16_bit_convs_stay_with_the_library(monkeypatch):
    narrow = _graph((1, 48, 8, 8), 48, 3, groups=12, pad=(1, 1, 1, 1))  # 4 output channels per group
    _check(narrow, [torch.randn(1, 48, 8, 8)], generated=False)
    ten = _graph((1, 30, 8, 8), 30, 1, groups=3)  # 10 per group: generated where a panel is 16 wide
    _check(ten, [torch.randn(1, 30, 8, 8)], generated=cpu_conv.panel() == 16)
    monkeypatch.setenv("KERNELIZE_CPU_CONV", "library")
    _check(_graph((1, 16, 8, 8), 32, 1), [torch.randn(1, 16, 8, 8)], generated=False)
    monkeypatch.setenv("KERNELIZE_CPU_CONV", "fast")
    with pytest.raises(ValueError, match="KERNELIZE_CPU_CONV"):
        compile_graph(_graph((1, 16, 8, 8), 32, 1), backend="cpu", cache=False)


def _conv_kernel(g):
    (k,) = [k for k in plan(g, PlanSettings(channels_last=True)).kernels if k.kind is KernelKind.CONV]
    return k


def test_source_names_the_conv_and_renders_the_epilogue_both_ways():
    k = _conv_kernel(_graph((1, 16, 8, 8), 96, 3, stride=2, pad=(1, 1, 1, 1), res=True))
    src, name = cpu_conv.render(k, CpuRenderer())
    assert name == "kz_k0" and "kz_k0: dense conv" in src
    # no size in the source: convs of other sizes with the same epilogue are the same text but for the name
    other = _conv_kernel(_graph((2, 24, 9, 7), 40, 5, stride=1, pad=(2, 2, 2, 2), res=True))
    assert cpu_conv.render(other, CpuRenderer())[0] == src
    assert "static constexpr bool vector = true;" in src and "kz_vclamp(" in src
    assert "bias_first = true" in src
    swish = cpu_conv.render(_conv_kernel(_graph((1, 16, 8, 8), 32, 1, act="swish")), CpuRenderer())[0]
    assert "static constexpr bool vector = true;" in swish and "kz_vsigmoid(" in swish
    tanh = _conv_kernel(_graph((1, 16, 8, 8), 32, 1, act="tanh"))  # no vector spelling: the scalar form
    assert "static constexpr bool vector = false;" in cpu_conv.render(tanh, CpuRenderer())[0]


def test_packed_weights_hold_every_weight_once():
    k = _conv_kernel(_graph((1, 64, 6, 6), 40, 3, groups=2, pad=(1, 1, 1, 1)))
    w = k.node.src[1].arg.tensor
    packed = cpu_conv.pack_weight(w, k)
    # [groups][panels][kh][kw][cig][panel]: 20 outputs per group pad to whole panels (of 16 or 32)
    nr = cpu_conv.panel()
    panels = -(-20 // nr)
    assert packed.shape == (2, panels, 3, 3, 32, nr)
    flat = packed.permute(0, 2, 3, 4, 1, 5).reshape(2, 3, 3, 32, panels * nr)  # the panels side by side
    assert torch.equal(flat[1, 2, 1, 5, :20], w[20:40, 5, 2, 1])
    assert not flat[..., 20:].any()


@pytest.mark.parametrize(
    "x_shape,cout,k,groups,driver",
    [
        ((1, 16, 8, 8), 32, 1, 1, "kz_conv_dense<-1, false>"),  # NHWC, whole panels
        ((1, 32, 8, 8), 8, 1, 1, "kz_conv_dense<-1, true>"),  # a projection to half a panel
        ((1, 3, 12, 12), 24, 3, 1, "kz_conv_dense<1, false>"),  # a stem: reads the NCHW image, stride 1
        ((1, 40, 6, 6), 40, 1, 2, "kz_conv_dense<-1, true>"),  # groups of 20: half an AVX-512 panel
    ],
)
def test_a_dense_conv_compiles_only_the_drivers_it_can_take(x_shape, cout, k, groups, driver):
    """The NCHW-input and half-panel tiles are compiled where a conv can run them (every variant in one
    function took 3.7 s to build cold, the one a ResNet conv takes 1.7); a call the variant cannot serve
    is refused, not miscomputed."""
    g = _graph(x_shape, cout, k, pad=(1, 1, 1, 1) if k == 3 else (0,) * 4, groups=groups, bias=False)
    kernel = _conv_kernel(g)
    src, name = cpu_conv.render(kernel, CpuRenderer())
    if "true>" in driver.split(",")[1] and cout // groups > cpu_conv.panel() // 2:
        driver = driver.replace(", true>", ", false>")  # 20 channels fill more than half a 16-wide panel
    assert f"return {driver}(" in src
    fn = getattr(load(build_shared_object(src, name)), name)
    call = cpu_conv.ConvCall(fn, kernel)
    x = torch.randn(*x_shape)
    w = kernel.node.src[1].arg.tensor
    (y,) = call.fresh([x.contiguous(memory_format=torch.channels_last), w, None, None])
    want = evaluate(g, [x])[0]
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    if "<-1," in driver:  # an NCHW input to a function compiled without that driver: refused
        d = cpu_conv.dims(kernel, x.shape, y.shape, nchw=True)
        ptrs = [x.data_ptr(), call.packed(w).data_ptr(), 0, 0, y.data_ptr()]
        assert call.fn(*ptrs, d, 1) == 1


def test_panel_width_matches_the_kernels():
    """The packer's width is the compiled kernel's KZ_NR: a conv packed with another width is refused."""
    k = _conv_kernel(_graph((1, 16, 8, 8), 32, 1, bias=False, act="none"))
    src, name = cpu_conv.render(k, CpuRenderer())
    fn = getattr(load(build_shared_object(src, name)), name)
    call = cpu_conv.ConvCall(fn, k)
    x = torch.randn(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    w = k.node.src[1].arg.tensor
    (y,) = call.fresh([x, w, None, None])
    torch.testing.assert_close(y, torch.nn.functional.conv2d(x, w), rtol=1e-4, atol=1e-4)
    d = cpu_conv.dims(k, x.shape, y.shape)
    d[16] = 48 - cpu_conv.panel()  # the other width
    ptrs = [x.data_ptr(), call.packed(w).data_ptr(), 0, 0, y.data_ptr()]
    assert call.fn(*ptrs, d, 1) == 1


# ---- conv chains ---------------------------------------------------------------------------------------
def _block(g, x, cin, e, cout, k, stride, *, expand=True, project=True, residual=False, act="relu6", seed=0):
    """MobileNet-style block after ``x``: [1x1 expand] -> depthwise kxk -> [1x1 project] (+ x)."""
    gen = torch.Generator().manual_seed(seed)

    def conv(y, cout, cin, k, **kw):
        w = g.const(torch.randn(cout, cin // kw.get("groups", 1), k, k, generator=gen) * 0.3)
        return g.conv(y, w, g.const(torch.randn(cout, generator=gen)), **kw)

    y = ACTS[act](g, conv(x, e, cin, 1)) if expand else x
    pad = (k // 2,) * 4
    y = ACTS[act](g, conv(y, e, e, k, stride=(stride, stride), padding=pad, groups=e))
    if project:
        y = conv(y, cout, e, 1)
        if residual:
            y = g.add(y, x)
    return y


def _chain_graph(n, hw, cin, e, cout, k, stride, **kw):
    """stem conv -> block -> 1x1 conv: the block's input and output are NHWC buffers read by convs."""
    g = Graph()
    x = g.input("x", ("n", 3, hw, hw), "f32")
    stem = g.clamp(g.conv(x, g.const(torch.randn(cin, 3, 3, 3) * 0.3), padding=(1, 1, 1, 1)), 0, 6)
    y = _block(g, stem, cin, e, cout, k, stride, **kw)
    g.output(g.conv(y, g.const(torch.randn(5, y.shape[1], 1, 1) * 0.3)))
    return g


CHAINS = [  # (batch, size, cin, expanded, cout, kernel, stride, options)
    (1, 9, 8, 48, 8, 3, 1, dict(residual=True)),
    (2, 13, 16, 40, 24, 3, 2, {}),  # odd sizes, channels off the vector width
    (1, 11, 24, 72, 17, 5, 1, dict(act="swish")),
    (1, 8, 16, 32, 16, 3, 1, {}),  # a projection to <= 16 channels: the half-width tiles
    (3, 7, 12, 24, 12, 5, 2, dict(residual=False)),
    (1, 10, 16, 16, 9, 3, 1, dict(expand=False)),  # depthwise -> project
    (2, 9, 8, 32, 0, 3, 2, dict(project=False, act="swish")),  # expand -> depthwise
]


@pytest.mark.parametrize("n, hw, cin, e, cout, k, stride, opts", CHAINS)
def test_conv_chains_match_the_reference_and_the_separate_convs(
    monkeypatch, n, hw, cin, e, cout, k, stride, opts
):
    monkeypatch.setattr("kernelize.autokernel.conv.CHAIN_MIN_BYTES", 0)
    g = _chain_graph(n, hw, cin, e, cout, k, stride, **opts)
    cg = compile_graph(g, backend="cpu", cache=False)
    (chain,) = [k for k in cg.plan.kernels if k.kind is KernelKind.CONV_CHAIN]
    assert len(chain.stages) == 3 - (not opts.get("expand", True)) - (not opts.get("project", True))
    x = torch.randn(n, 3, hw, hw)
    want = evaluate(g, [x])[0]
    for _ in range(2):  # the second run replays with the packed weights
        torch.testing.assert_close(cg(x)[0], want, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("KERNELIZE_CPU_CONV", "library")  # every conv oneDNN's, no chain
    separate = compile_graph(g, backend="cpu", cache=False)
    assert not any(k.kind is KernelKind.CONV_CHAIN for k in separate.plan.kernels)
    torch.testing.assert_close(separate(x)[0], want, rtol=1e-4, atol=1e-4)


def test_blocks_in_a_row_put_each_conv_in_one_chain(monkeypatch):
    """MobileNet v1's depthwise -> 1x1 -> depthwise -> 1x1: the middle 1x1 can close the first chain or open
    the second, never both (the second would read the first's inner value, which nothing stores; planning
    failed on MobileNet v1 at batch 8)."""
    monkeypatch.setattr("kernelize.autokernel.conv.CHAIN_MIN_BYTES", 0)
    g = Graph()
    x = g.input("x", (2, 3, 12, 12), "f32")
    y = g.clamp(g.conv(x, g.const(torch.randn(8, 3, 3, 3) * 0.3), padding=(1, 1, 1, 1)), 0, 6)
    y = _block(g, y, 8, 8, 16, 3, 1, expand=False, seed=1)
    y = _block(g, g.clamp(y, 0, 6), 16, 16, 24, 3, 2, expand=False, seed=2)
    g.output(g.conv(g.clamp(y, 0, 6), g.const(torch.randn(5, 24, 1, 1) * 0.3)))
    cg = compile_graph(g, backend="cpu", cache=False)
    stages = [id(s) for k in cg.plan.kernels if k.kind is KernelKind.CONV_CHAIN for s in k.stages]
    assert stages and len(stages) == len(set(stages))
    xs = torch.randn(2, 3, 12, 12)
    want = evaluate(g, [xs])[0]
    for _ in range(2):
        torch.testing.assert_close(cg(xs)[0], want, rtol=1e-4, atol=1e-4)


def test_a_chain_stops_where_a_value_is_read_twice_or_small(monkeypatch):
    g = Graph()
    x = g.input("x", (1, 3, 12, 12), "f32")
    stem = g.clamp(g.conv(x, g.const(torch.randn(8, 3, 3, 3)), padding=(1, 1, 1, 1)), 0, 6)
    y = _block(g, stem, 8, 32, 8, 3, 1, project=False)  # expand -> depthwise, read by the projection and ...
    squeeze = g.reduce(Op.MEAN, y, (2, 3), keepdim=True)  # ... a squeeze-excite mean: no project stage
    z = g.conv(g.mul(y, g.broadcast(g.sigmoid(squeeze), y.shape)), g.const(torch.randn(8, 32, 1, 1)))
    g.output(g.conv(z, g.const(torch.randn(4, 8, 1, 1))))

    def kinds():
        return [
            [s.node.src[1].shape[2] for s in k.stages]
            for k in compile_graph(g, backend="cpu", cache=False).plan.kernels
            if k.kind is KernelKind.CONV_CHAIN
        ]  # noqa: E731

    assert kinds() == []  # 12 x 12 x 32 floats: too small to pay
    monkeypatch.setattr("kernelize.autokernel.conv.CHAIN_MIN_BYTES", 0)
    assert kinds() == [[1, 3]]  # expand and depthwise; the depthwise output is stored for both readers
    x_in = torch.randn(1, 3, 12, 12)
    torch.testing.assert_close(
        compile_graph(g, backend="cpu", cache=False)(x_in)[0], evaluate(g, [x_in])[0], rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("later_reader", [False, True])
def test_a_residual_conv_writes_over_its_dying_residual(later_reader):
    """conv(conv(x)) + r with r an intermediate: the second conv's output takes r's arena block when
    nothing reads r afterwards (added element by element, as onnxruntime's Conv + Sum), else a block of
    its own; the results match the reference either way."""
    gen = torch.Generator().manual_seed(21)
    g = Graph()
    x = g.input("x", (2, 16, 9, 7), "f32")
    r = g.clamp(g.conv(x, g.const(torch.randn(24, 16, 1, 1, generator=gen) * 0.3)), 0, math.inf)
    y = g.conv(
        g.clamp(x, 0, 6), g.const(torch.randn(24, 16, 3, 3, generator=gen) * 0.2), padding=(1, 1, 1, 1)
    )
    s = g.add(y, r)
    out = g.conv(s, g.const(torch.randn(8, 24, 1, 1, generator=gen) * 0.3))
    g.output(g.add(out, g.conv(r, g.const(torch.randn(8, 24, 1, 1, generator=gen)))) if later_reader else out)
    cg = _check(g, [torch.randn(2, 16, 9, 7, generator=gen)], generated=None)
    (arena,) = cg._arenas.values()
    assert (arena.views[s].data_ptr() == arena.views[r].data_ptr()) is not later_reader
