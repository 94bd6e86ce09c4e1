"""Generated convolutions for the CPU backend: NHWC f32, weights packed once, the plan's epilogue fused.

A ``CONV`` kernel (see :mod:`kernelize.autokernel.conv`) becomes one C++ function: the template
``templates/cpu_conv.cpp`` around one of the drivers of ``templates/cpu_conv.h``, with the kernel's
epilogue (bias, residual, activation: the graph nodes of its :class:`ConvEpilogue`) rendered through the
shared render table into a function applied to every output value while it is in cache:

* ``dense``: any group size, kernel size, stride, padding and dilation, as an implicit GEMM. A tile of
  ``KZ_MR`` output pixels x :func:`panel` output channels accumulates in registers; the input rows of each
  tap are read through row pointers (taps in the padding read a zero row), so nothing is padded or copied.
* ``depthwise``: one input channel per output channel (or per few: a channel multiplier), vectorised over
  output channels.

Why not oneDNN (which the runtime used for every conv before): side by side on one core (AVX-512, batch 1,
thread CPU time), oneDNN's packed linear and conv primitives have ~15-25 us of fixed cost per call, and
its swish post-op costs about as much as the GEMM it follows; the generated GEMM runs the compute-bound
1x1 convs of MobileNetV2 / EfficientNet at ~110 GFLOPS (this core's FMA peak is ~112) and applies the
epilogue in registers. Which convs take the generated path is :func:`algorithm`'s table.

Sizes are run-time arguments, so every conv of a model with the same epilogue shares one compiled
function (a model compiles a handful of conv sources, not one per layer).

Example:
    >>> src, fn_name = render(kernel, CpuRenderer())  # doctest: +SKIP
    >>> y, = ConvCall(lib[fn_name], kernel).fresh([x, w, bias, residual])  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernelize.autokernel.conv import channel_bias
from kernelize.autokernel.kernels import Compute, ConvChainKernel, ConvKernel, Kernel
from kernelize.codegen import cpu_build
from kernelize.codegen.render import Renderer, c_name
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Node, Op
from kernelize.ir.shapes import bind
from kernelize.runtime.backend import CCall

MAX_TAPS = 128  # KZ_MAX_TAPS
MAX_GROUP_CHANNELS = 8192  # KZ_ZERO_ROW: input channels per group

DRIVERS = {"dense": "kz_conv_dense", "depthwise": "kz_conv_depthwise"}
DW_FORMS = (31, 32, 51, 52, 71)  # the depthwise sliding forms (kz_dw_form: width x 10 + stride); 31 first
# Dense convs of every size are generated. Large ones (input channels per group x taps >= 1024) used to stay
# oneDNN's with AVX-512: on an AVX-512 EPYC (1 thread, min of 20 runs) the 27 such convs of ResNet-50,
# MobileNetV2, EfficientNet-B0, RegNetY-400MF and ConvNeXt-tiny took 1.07x oneDNN's time generated. On a
# Xeon with AVX-512 (two FMA ports) the generated ones are level or faster one by one (1 thread: 1024 -> 256
# 1x1 at 14 x 14 124 against 118 GFLOP/s, 2048 -> 512 at 7 x 7 107 / 96, 3x3 128 -> 128 at 28 x 28 147 /
# 141), and on both a graph without oneDNN regions runs on kernelize's workers, which wake before the run
# and never make the caller wait for a sleeping thread: ResNet-50 on the Xeon, kernelize / onnxruntime in
# three alternating runs, 1.23-1.25 -> 1.15-1.19 at 1 thread and 1.32-1.34 -> 1.14-1.26 at 2; ResNet-18
# on the EPYC at 2 threads after a pause 12-14 -> 4.4 ms. On AVX2 (6 x 16 tiles, see cpu_conv.h) the
# generated form of those convs took 0.83-1.0x oneDNN's time.


def algorithm(kernel: Kernel) -> str | None:
    """``"dense"`` or ``"depthwise"`` for a CONV kernel the generated code runs, else None (the library).

    f32 only (16-bit convs go to torch, which computes them in f32 too), static channel and kernel sizes,
    at most :data:`MAX_TAPS` taps and :data:`MAX_GROUP_CHANNELS` input channels per group.
    """
    conv = kernel.node
    x, w = conv.src
    if conv.dtype is not DType.F32 or not all(isinstance(d, int) for d in (*w.shape, x.shape[1])):
        return None
    co, cig, kh, kw = w.shape
    groups = conv.arg.groups
    if kh * kw > MAX_TAPS or cig > MAX_GROUP_CHANNELS or _choice() == "library":
        return None
    # one input channel per group: depthwise, with a channel multiplier co / groups where it is below half a
    # panel (oneDNN took 3.5 ms for a 16 -> 32 one at 112 x 112, 1 thread); wider ones stay dense below
    if cig == 1 and (co == groups or co // groups < panel() // 2):
        return "depthwise"
    # many groups of few output channels each fill a fraction of a panel: RegNet's 8-wide groups ran 4x
    # slower than oneDNN's grouped conv with 32-wide panels (AVX-512); so at least half a panel a group. On
    # AVX2 that takes ShuffleNet's 10-wide groups: oneDNN took 0.45 ms for its 120 -> 30 (3 groups, 28 x 28),
    # 7x onnxruntime's time
    return "dense" if groups == 1 or co // groups >= panel() // 2 else None


def panel() -> int:
    """Output channels per packed weight panel: ``KZ_NR`` of ``cpu_conv.h`` for the instructions the kernels
    are built with (the same predefined macros decide): 16 with AVX2 and FMA but no AVX-512, else 32."""
    m = cpu_build.macros()
    return 16 if {"__AVX2__", "__FMA__"} <= m and "__AVX512F__" not in m else 32


def chains_enabled() -> bool:
    """Whether the planner fuses inverted-residual runs of convs into CONV_CHAIN kernels (off with
    ``KERNELIZE_CPU_CONV=library``, which sends every conv to oneDNN)."""
    return _choice() == "auto"


def _choice() -> str:
    """``KERNELIZE_CPU_CONV``: ``auto`` (default: the table in :func:`algorithm`) or ``library`` (every
    conv through oneDNN, for comparison)."""
    choice = os.environ.get("KERNELIZE_CPU_CONV", "auto").strip() or "auto"
    if choice not in ("auto", "library"):
        raise ValueError(f"KERNELIZE_CPU_CONV={choice!r}: expected `auto` or `library`")
    return choice


def render_chain(kernel: ConvChainKernel, renderer: Renderer) -> tuple[str, str]:
    """The C++ source of a CONV_CHAIN kernel and its exported function name."""
    name = c_name(kernel.name)
    a, c = chain_stages(kernel)
    depthwise = next(s for s in kernel.stages if s.node is kernel.node)
    structs = [_epilogue_struct(s, f"{name}_s{i}", renderer) for i, s in enumerate((a, depthwise, c))]
    source = fill(
        load_template("cpu_conv_chain.cpp"),
        PRELUDE=load_template("cpu_prelude.h"),
        CONV_LIB=load_template("cpu_conv.h"),
        NAME=name,
        WHAT=" -> ".join(f"{algorithm(s)} conv" for s in kernel.stages),
        EPILOGUES="\n".join(structs),
        HAS_A="true" if a is not None else "false",
        HAS_C="true" if c is not None else "false",
        # the variants compiled (cpu_conv.h kz_conv_chain): the depthwise stage's sliding form, 1x1 stages
        # whose outputs fill at most half a panel
        FORM=str(depthwise.node.src[1].shape[3] * 10 + depthwise.node.arg.stride[1]),
        HALF_A=str(a is not None and a.node.src[1].shape[0] <= panel() // 2).lower(),
        HALF_C=str(c is not None and c.node.src[1].shape[0] <= panel() // 2).lower(),
    )
    return source, name


def render(kernel: ConvKernel, renderer: Renderer) -> tuple[str, str]:
    """The C++ source of a generated CONV kernel and its exported function name."""
    name = c_name(kernel.name)
    algo = algorithm(kernel)
    assert algo is not None, f"kernel {kernel.name} is not a generated conv"
    # the driver's variants the conv can take (cpu_conv.h), the rest not compiled: for a dense conv, reading
    # an NCHW input (its stride), groups of half a panel; for a depthwise one, a channel multiplier, the
    # sliding form
    co, _, kh, kw = kernel.node.src[1].shape
    a = kernel.node.arg
    if algo == "dense":
        sw = (a.stride[1] if a.stride[1] in (1, 2, 4) else 0) if reads_nchw(kernel) else -1
        options = (sw, co // a.groups <= panel() // 2)
    else:
        rep = _multiplier(kernel)
        form = 0 if a.dilation[1] != 1 or kh > 16 else kw * 10 + a.stride[1]
        options = (rep, form if form in (DW_FORMS[:1] if rep else DW_FORMS) else 0)
    driver = f"{DRIVERS[algo]}<{', '.join(str(o).lower() for o in options)}>"
    epilogue = _epilogue_struct(kernel, f"{name}_epilogue", renderer)
    return conv_source(name, f"{algo} conv", epilogue, driver), name


def _multiplier(kernel: Kernel) -> bool:
    """Whether a depthwise CONV kernel has a channel multiplier (more output channels than input ones)."""
    return kernel.node.src[1].shape[0] != kernel.node.arg.groups


def chain_stages(chain: Kernel) -> tuple[Kernel | None, Kernel | None]:
    """The expand and project stages of a CONV_CHAIN kernel (None where the chain has none)."""
    stages = list(chain.stages)
    i = next(i for i, s in enumerate(stages) if s.node is chain.node)
    return (stages[i - 1] if i > 0 else None), (stages[i + 1] if i + 1 < len(stages) else None)


def _epilogue_struct(kernel: Kernel | None, struct: str, renderer: Renderer) -> str:
    """The epilogue object of one conv (``templates/cpu_conv_epilogue.cpp``); None: a stage a chain lacks
    (the identity, never called)."""
    stage = kernel
    scalar = ["return v0;"] if stage is None else epilogue_lines(stage, renderer)
    vector = ["return v0;"] if stage is None else epilogue_lines(stage, VECTOR_RENDERER)
    return epilogue_struct(struct, scalar, vector, stage is not None and bias_first(stage))


def epilogue_struct(struct: str, scalar: Sequence[str], vector: Sequence[str] | None, bias: bool) -> str:
    """An epilogue object from its statements (see :func:`epilogue_lines`): ``vector`` None where the
    epilogue has no vector spelling; ``bias``: the accumulators start at the channel bias."""
    return fill(
        load_template("cpu_conv_epilogue.cpp"),
        STRUCT=struct,
        EPILOGUE=_indent(scalar, 8),
        VECTOR="true" if vector is not None else "false",
        BIAS_FIRST="true" if bias else "false",
        VECTOR_EPILOGUE=_indent(vector or ["return v0;"], 8),
    )


def conv_source(name: str, what: str, epilogue: str, driver: str) -> str:
    """The C++ source of one conv function ``name`` (``templates/cpu_conv.cpp``) around a driver of
    ``cpu_conv.h`` and an epilogue object named ``{name}_epilogue``."""
    return fill(
        load_template("cpu_conv.cpp"),
        PRELUDE=load_template("cpu_prelude.h"),
        CONV_LIB=load_template("cpu_conv.h"),
        NAME=name,
        WHAT=what,
        EPILOGUE=epilogue,
        DRIVER=driver,
    )


def epilogue_lines(kernel: Kernel, renderer: Renderer) -> list[str] | None:
    """The epilogue's C++ statements: ``v0`` is the convolution's value at output pixel ``kz_p``, channel
    ``kz_c``; each node of the chain after it becomes ``v1``, ``v2``... through the render table; the bias is
    ``kz_b[kz_c]``, the residual ``kz_r`` at the same NHWC position. With a :class:`VectorRenderer` the same
    over a vector of the ``kz_n`` channels from ``kz_c``, or None when an op of the chain has no vector
    spelling."""
    ep = kernel.epilogue
    channels = ep.conv.shape[1]
    names: dict[Node, str] = {ep.conv: "v0"}
    vector = isinstance(renderer, VectorRenderer)
    ctype, load = ("kz_vec", "kz_vld({}, kz_n)") if vector else ("float", "({})[0]")

    def operand(s: Node) -> str:
        if s in names:
            return names[s]
        if s is ep.residual:
            return load.format("kz_r + kz_p * kz_co + kz_c")
        assert ep.bias is not None and channel_bias(s, channels) is ep.bias, f"epilogue operand {s}"
        return load.format("kz_b + kz_c")

    lines = []
    for i, node in enumerate(ep.nodes[1:], 1):
        if i == 1 and bias_first(kernel):  # the accumulators started at the bias
            names[node] = "v0"
            continue
        args = [operand(s) for s in node.src]
        e = Compute(node.op, node.dtype, tuple(range(len(args))), node.arg)
        if vector and not renderer.has(e):
            return None
        names[node] = f"v{i}"
        lines.append(f"const {ctype} v{i} = {renderer.expr(e, args)};")
    return [*lines, f"return {names[ep.tail]};"]


def bias_first(kernel: Kernel) -> bool:
    """Whether the epilogue starts by adding the channel bias to the convolution: the driver then starts its
    accumulators at the bias (one add fewer per value; the sum rounds in another order)."""
    ep = kernel.epilogue
    return (
        ep.bias is not None and len(ep.nodes) > 1 and ep.nodes[1].op is Op.ADD and ep.conv in ep.nodes[1].src
    )


class VectorRenderer(Renderer):
    """The epilogue ops that have a spelling on ``kz_vec`` (GCC vector arithmetic and ``kz_v*`` helpers in
    ``cpu_conv.h``): bias and residual adds, clamps (ReLU, ReLU6), sigmoid and so swish: the chains of most
    CNN convolutions. A chain with any other op (tanh, say) runs in the scalar form, which the compiler
    vectorises over a buffer."""

    OP_RENDER = {
        Op.ADD: Renderer.OP_RENDER[Op.ADD],
        Op.SUB: Renderer.OP_RENDER[Op.SUB],
        Op.MUL: Renderer.OP_RENDER[Op.MUL],
        Op.SIGMOID: lambda r, e, a: f"kz_vsigmoid({a[0]})",
        Op.CLAMP: lambda r, e, a: (
            f"kz_vclamp({a[0]}, {r.literal(e.arg.lo, e.dtype)}, {r.literal(e.arg.hi, e.dtype)})"
        ),
    }

    def has(self, e: Compute) -> bool:
        """Whether ``e`` has a vector spelling (a clamp to a NaN bound has not: kz_vclamp ignores it)."""
        if e.op is Op.CLAMP and (math.isnan(e.arg.lo) or math.isnan(e.arg.hi)):
            return False
        return e.op in self.OP_RENDER and e.dtype is DType.F32


VECTOR_RENDERER = VectorRenderer()


def _indent(lines: Sequence[str], n: int) -> str:
    return "\n".join(" " * n + line for line in lines)


def pack_weight(w: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """``w`` (``[co, cig, kh, kw]``) in the layout the kernel's driver reads (see ``cpu_conv.h``)."""
    co, cig, kh, kw = w.shape
    nr = panel()
    if algorithm(kernel) == "depthwise":
        cpad = -(-co // nr) * nr
        return F.pad(w.reshape(co, kh * kw).t(), (0, cpad - co)).contiguous()
    return pack_dense(w, kernel.node.arg.groups)


def pack_dense(w: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``w`` (``[co, cig, kh, kw]``) in the dense driver's panels: per group and panel of :func:`panel`
    output channels, ``[kh][kw][cig][panel]``."""
    co, cig, kh, kw = w.shape
    nr = panel()
    cog = co // groups
    panels = -(-cog // nr)
    wg = w.reshape(groups, cog, cig, kh, kw)
    if panels * nr != cog:  # a copy, not made for whole panels
        wg = F.pad(wg, (0, 0, 0, 0, 0, 0, 0, panels * nr - cog))
    return wg.reshape(groups, panels, nr, cig, kh, kw).permute(0, 1, 4, 5, 3, 2).contiguous()


def pack_gemm(w: torch.Tensor) -> torch.Tensor:
    """The GEMM weight ``w`` (``[K, N]``, any strides) in the dense driver's panels of a 1x1 conv of K input
    and N output channels (:func:`pack_dense`'s layout), in one copy."""
    k, n = w.shape
    nr = panel()
    panels = -(-n // nr)
    if panels * nr != n:
        w = F.pad(w, (0, panels * nr - n))
    return w.reshape(k, panels, nr).permute(1, 0, 2).contiguous().reshape(1, panels, 1, 1, k, nr)


ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int]
DIMS = 19  # values in a kz_conv_dims
MAX_NCHW_K = 512  # the most products per output a conv reading an NCHW input takes (KZ_NCHW_MAX_K)
# the longest kernel row (kw x input channels) read NCHW: above it the NHWC tiles' row segments are long
# enough to pay for their pointers and for the image's NHWC copy. Zen 3, 1 thread, hot (`kz_to_nhwc` adds
# ~0.09 ms on the NHWC side): 3 x 3 RGB stems (rows of 9) 0.27 -> 0.20 ms (MobileNet, 16 channels out),
# 0.79 -> 0.37 (8 out, stride 1), 0.72 -> 0.66 (32 out); a 4 x 4 / 4 one (rows of 12) 0.62 -> 0.66; 7 x 7
# ones (21) 3.1 -> 3.7 ms (64 out), 2.1 -> 1.7 (32 out); 11 x 11 / 4 (33) 1.3 -> 1.6
MAX_NCHW_ROW = 9


def reads_nchw(kernel: Kernel) -> bool:
    """Whether the kernel reads an NCHW input as it comes (cpu_conv.h, kz_conv_nchw_tiles) rather than after
    an NHWC copy: a dense conv of one group over few input channels (kernel rows of at most
    :data:`MAX_NCHW_ROW` inputs, at most :data:`MAX_NCHW_K` products per output), such as a network's 3 x 3
    stem over the caller's RGB image."""
    co, cig, kh, kw = kernel.node.src[1].shape
    return (
        algorithm(kernel) == "dense"
        and kernel.node.arg.groups == 1
        and kw * cig <= MAX_NCHW_ROW
        and cig * kh * kw <= MAX_NCHW_K
    )


def dims(
    kernel: Kernel,
    x_shape: Sequence[int],
    y_shape: Sequence[int],
    ly: int | None = None,
    nchw: bool = False,
) -> ctypes.Array:
    """The ``kz_conv_dims`` array for an input and output of these (NCHW) shapes (then the panel width the
    weights were packed with, which the kernel checks against its own, ``ly``: floats between output
    pixels, the output's channels unless it is a channel slice of a wider NHWC buffer, and whether the input
    is stored NCHW rather than NHWC)."""
    a = kernel.node.arg
    n, c, h, w = x_shape
    _, co, oh, ow = y_shape
    kh, kw = kernel.node.src[1].shape[2:]
    top, left = a.padding[:2]
    values = (n, h, w, c, oh, ow, co, kh, kw, *a.stride, top, left, *a.dilation, a.groups, panel(), ly or co)
    values += (int(nchw),)
    return (ctypes.c_int64 * len(values))(*values)


def gemm_dims(m: int, k: int, n: int) -> ctypes.Array:
    """The ``kz_conv_dims`` of a GEMM ``[m, k] @ [k, n]`` (row major) as the dense driver runs it: a 1x1
    conv over ``m`` pixels of ``k`` channels, ``n`` out."""
    values = (1, 1, m, k, 1, m, n, 1, 1, 1, 1, 0, 0, 1, 1, 1, panel(), n, 0)
    return (ctypes.c_int64 * DIMS)(*values)


def output_shape(kernel: Kernel, x: torch.Tensor | Sequence[int]) -> tuple[int, int, int, int]:
    """The NCHW output shape of the conv on input ``x`` (a tensor or its shape)."""
    a = kernel.node.arg
    n, _, h, w = getattr(x, "shape", x)
    co, _, kh, kw = kernel.node.src[1].shape
    sizes = [
        (size + lo + hi - d * (k - 1) - 1) // s + 1
        for size, lo, hi, d, k, s in zip(
            (h, w), a.padding[:2], a.padding[2:], a.dilation, (kh, kw), a.stride, strict=True
        )
    ]
    return (n, co, *sizes)


def pixel_stride(y: torch.Tensor | None) -> int | None:
    """Floats between the pixels of an NHWC conv output: None (its channel count) when ``y`` is dense
    channels-last or filled in later, the wider buffer's channel count when ``y`` is a channel slice of one
    (a concat's buffer, written in place)."""
    if y is None or y.is_contiguous(memory_format=torch.channels_last):
        return None
    n, c, h, w = y.shape
    ly = y.stride(3)
    rows = (h == 1 or y.stride(2) == ly * w) and (n == 1 or y.stride(0) == ly * w * h)
    if y.stride(1) != 1 or ly < c or not rows:
        raise ValueError(
            f"conv output of shape {tuple(y.shape)} and strides {y.stride()} is neither channels-last nor a "
            "channel slice of a channels-last buffer: pass one of those"
        )
    return ly


class ConvCall:
    """The compiled conv: ``launch([x, w, bias, residual], [y], sizes)`` into an NHWC output ``y``, and
    ``fresh([x, w, bias, residual], sizes)`` returning ``[y]`` in a new NHWC buffer. ``x``, ``residual`` and
    ``y`` are NCHW-shaped channels-last tensors (``launch`` copies any other ``x`` channels-last, unless
    the kernel reads it as it is: :meth:`takes_nchw`); ``w`` is the graph's ``[co, cig, kh, kw]`` weight,
    packed on first use and kept (per weight tensor); ``bias`` and ``residual`` are None when the epilogue
    has none."""

    def __init__(self, fn, kernel: Kernel) -> None:
        fn.argtypes, fn.restype = ARGTYPES, ctypes.c_int
        self.fn, self.kernel = fn, kernel
        self.nchw = reads_nchw(kernel)
        self._dims: dict[tuple, ctypes.Array] = {}
        self._packed: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (address, weight, packed)

    def packed(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` packed, made once per weight tensor (the entry keeps ``w``, so its address stays its own)."""
        if self._packed is None or self._packed[0] != w.data_ptr():
            self._packed = (w.data_ptr(), w, pack_weight(w.contiguous(), self.kernel))
        return self._packed[2]

    def takes_nchw(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is read as it is stored, contiguous NCHW (else it must be channels-last)."""
        return self.nchw and x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)

    def fresh(self, reads: Sequence[torch.Tensor | None], sizes=None) -> list[torch.Tensor]:
        n, co, oh, ow = output_shape(self.kernel, reads[0])
        y = torch.empty((n, oh, ow, co), dtype=reads[0].dtype).permute(0, 3, 1, 2)
        self.launch(reads, [y], sizes)
        return [y]

    def launch(
        self, reads: Sequence[torch.Tensor | None], writes: Sequence[torch.Tensor], sizes=None
    ) -> None:
        x, w, b, r = reads
        (y,) = writes
        nchw = self.takes_nchw(x)
        if not nchw:
            x = x.contiguous(memory_format=torch.channels_last)
        d = self._dims_of(x.shape, y.shape, pixel_stride(y), nchw)
        ptrs = [0 if t is None else t.data_ptr() for t in (x, self.packed(w), b, r, y)]
        if self.fn(*ptrs, d, cpu_build.threads()):
            raise RuntimeError(self._error(d))

    def c_call(
        self, reads: Sequence[torch.Tensor | None], writes: Sequence[torch.Tensor | None], sizes
    ) -> CCall | None:
        """The call :meth:`launch` makes, for ``kz_replay``; ``sizes`` binds the input's symbolic dims (a
        None tensor is an argument filled in later: 0). An ``x`` neither channels-last nor read as it is
        (:meth:`takes_nchw`) has no call: None."""
        x, w, b, r = reads
        (y,) = writes
        x_shape = bind(self.kernel.node.src[0].shape, sizes)
        nchw = x is not None and self.takes_nchw(x)
        if x is not None and not nchw and not x.is_contiguous(memory_format=torch.channels_last):
            return None
        d = self._dims_of(x_shape, output_shape(self.kernel, x_shape), pixel_stride(y), nchw)
        ptrs = tuple(0 if t is None else t.data_ptr() for t in (x, self.packed(w), b, r, y))
        return CCall(
            ctypes.cast(self.fn, ctypes.c_void_p).value, (*ptrs, ctypes.addressof(d)), self._error(d)
        )

    def _dims_of(
        self, x_shape: Sequence[int], y_shape: Sequence[int], ly: int | None, nchw: bool
    ) -> ctypes.Array:
        key = (tuple(x_shape), tuple(y_shape), ly, nchw)
        d = self._dims.get(key)
        if d is None:
            d = self._dims[key] = dims(self.kernel, x_shape, y_shape, ly, nchw)
        return d

    def _error(self, d: ctypes.Array) -> str:
        return (
            f"cpu conv kernel {self.kernel.name} rejected its sizes {tuple(d)} (the last: the weights' panel "
            "width, which must be the kernel's KZ_NR)"
        )


class ChainCall:
    """A compiled CONV_CHAIN kernel: ``launch(reads, [y], sizes)`` with ``reads`` in ``kernel.reads`` order
    (the chain's input and residual NHWC, the stages' weights packed on first use, their biases), into the
    NHWC output ``y``; ``c_call`` is the same call for ``kz_replay``."""

    def __init__(self, fn, kernel: Kernel) -> None:
        fn.argtypes, fn.restype = [ctypes.c_void_p] * 10 + [ctypes.c_int], ctypes.c_int
        self.fn, self.kernel = fn, kernel
        a, c = chain_stages(kernel)
        b = next(s for s in kernel.stages if s.node is kernel.node)
        self.stages = (a, b, c)
        reads = kernel.reads
        slot = reads.index
        self.x = slot(kernel.stages[0].inputs[0])
        self.w = tuple(None if s is None else slot(s.inputs[1]) for s in self.stages)
        self.b = tuple(
            None if s is None or s.epilogue.bias is None else slot(s.inputs[2]) for s in self.stages
        )
        self.r = None if c is None or c.epilogue.residual is None else slot(c.inputs[-1])
        self._packed: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # stage -> (address, w, packed)
        self._dims: dict[tuple, ctypes.Array] = {}

    def _weight(self, i: int, w: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(i)
        if entry is None or entry[0] != w.data_ptr():
            entry = self._packed[i] = (w.data_ptr(), w, pack_weight(w.contiguous(), self.stages[i]))
        return entry[2]

    def _args(self, reads: Sequence[torch.Tensor | None], y: torch.Tensor | None, x_shape) -> tuple[int, ...]:
        def ptr(i: int | None) -> int:
            return 0 if i is None or reads[i] is None else reads[i].data_ptr()

        args = [ptr(self.x)]
        for s, (w, b) in enumerate(zip(self.w, self.b, strict=True)):
            args += [0 if w is None else self._weight(s, reads[w]).data_ptr(), ptr(b)]
        args += [ptr(self.r), 0 if y is None else y.data_ptr(), ctypes.addressof(self._dims_of(x_shape))]
        return tuple(args)

    def _dims_of(self, x_shape: Sequence[int]) -> ctypes.Array:
        """The three stages' ``kz_conv_dims`` for a chain input of ``x_shape`` (NCHW)."""
        key = tuple(x_shape)
        d = self._dims.get(key)
        if d is None:
            values, shape = [], tuple(x_shape)
            for s in self.stages:
                if s is None:
                    values += [0] * DIMS
                    continue
                out = output_shape(s, shape)
                values += list(dims(s, shape, out))
                shape = out
            d = self._dims[key] = (ctypes.c_int64 * (3 * DIMS))(*values)
        return d

    def launch(self, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes=None) -> None:
        (y,) = writes
        if self.fn(*self._args(reads, y, reads[self.x].shape), cpu_build.threads()):
            raise RuntimeError(self._error())

    def c_call(
        self, reads: Sequence[torch.Tensor | None], writes: Sequence[torch.Tensor | None], sizes
    ) -> CCall:
        """The call :meth:`launch` makes (a None tensor: an argument filled in later)."""
        x_shape = bind(self.kernel.reads[self.x].shape, sizes)
        slots = [None] * len(reads)
        for arg, i in ((0, self.x), (2, self.b[0]), (4, self.b[1]), (6, self.b[2]), (7, self.r)):
            if i is not None:
                slots[i] = arg
        address = ctypes.cast(self.fn, ctypes.c_void_p).value
        return CCall(address, self._args(reads, writes[0], x_shape), self._error(), (*slots, 8))

    def _error(self) -> str:
        return f"cpu conv chain kernel {self.kernel.name} rejected its sizes"


__all__ = [
    "MAX_TAPS",
    "ChainCall",
    "ConvCall",
    "algorithm",
    "chain_stages",
    "conv_source",
    "dims",
    "epilogue_struct",
    "gemm_dims",
    "output_shape",
    "pack_dense",
    "pack_gemm",
    "pack_weight",
    "panel",
    "render",
]
