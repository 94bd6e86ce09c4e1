"""Run a CONV kernel: one convolution with its epilogue (bias, residual, activation) fused.

Where the backend generated the kernel (the CPU backend's NHWC f32 convolutions,
:mod:`kernelize.codegen.cpu_conv`, which packs the weight on first use), the runner hands it channels-last
input, residual and output buffers, and that is the whole call. Otherwise it is a library call. On the CPU
with f32 the convolution goes to oneDNN through torch's mkldnn ops: the weight is reordered into oneDNN's
blocked layout once (per input shape) and kept, activations are channels-last, padding is the
convolution's own (asymmetric padding too: as zero taps that make it symmetric, else as a symmetric pad by
whole strides and a crop), and the bias, residual add and activation are oneDNN post-ops.
Measured on this machine's 2 cores for ResNet-50 convolutions, that is 2-4x faster than ``F.conv2d`` on
NCHW tensors (which reorders the weight on every call and, with an explicit pad, copies the input
first). A 1x1 convolution of stride 1 without padding or groups is a GEMM of the NHWC input viewed
``[N*H*W, Cin]`` by the ``[Cin, Cout]`` weight: that one runs as oneDNN's packed linear with the same
post-ops (:meth:`ConvRunner.gemm`). Elsewhere (GPU through cuDNN, 16-bit floats) it is ``F.conv2d``
followed by the same epilogue in torch.

Example:
    >>> runner = ConvRunner(kernel, bias=b)  # doctest: +SKIP
    >>> y = runner(x, w, residual, channels_last=True)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kernelize.autokernel.kernels import Kernel
from kernelize.runtime.backend import CompiledKernel

_TORCH_ACT = {
    "relu": lambda t, s: torch.relu_(t),
    "hardtanh": lambda t, s: t.clamp_(s[0], s[1]),
    "sigmoid": lambda t, s: torch.sigmoid_(t),
    "tanh": lambda t, s: torch.tanh_(t),
    "swish": lambda t, s: F.silu(t, inplace=True),
}


@functools.cache
def _mkldnn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


@functools.cache
def _linear_ok() -> bool:
    ops = torch.ops.mkldnn
    return hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")


def conv_as_gemm() -> bool:
    """Whether 1x1 convolutions of stride 1 (no padding, no groups) run as oneDNN packed linears on CPU.
    Measured one by one against ``_convolution_pointwise`` (1 thread, thread CPU time, NHWC input, packed
    weights, the same bias / activation / residual post-ops) on every such conv of MobileNetV2,
    EfficientNet-B0 and RegNetY-400MF: at batch 1 the linear takes 0.83-1.01x the conv's time (about
    10 us less per call: the conv op's fixed cost), at batch 8 0.73-1.04x with one outlier at 1.16x (a
    32 -> 48 conv over 112 x 112). ``KERNELIZE_CPU_CONV1X1=conv`` keeps them convolutions."""
    choice = os.environ.get("KERNELIZE_CPU_CONV1X1", "").strip()
    if choice not in ("", "gemm", "conv"):
        raise ValueError(f"KERNELIZE_CPU_CONV1X1={choice!r}: expected `gemm` or `conv`")
    return choice != "conv" and _linear_ok()


class ConvRunner:
    """The compiled form of one CONV kernel (see the module docstring)."""

    def __init__(
        self, kernel: Kernel, bias: torch.Tensor | None, generated: CompiledKernel | None = None
    ) -> None:
        self.kernel = kernel
        self.generated = generated
        ep = kernel.epilogue
        args = kernel.node.arg
        top, left, bottom, right = args.padding
        self.stride, self.dilation, self.groups = list(args.stride), list(args.dilation), args.groups
        self.symmetric = top == bottom and left == right
        self.padding = [top, left] if self.symmetric else [0, 0]
        self.pad = (left, right, top, bottom)
        self.bias = None if bias is None else bias.reshape(-1).contiguous()
        self.act, self.scalars = ep.activation, list(ep.scalars)
        self.residual = ep.residual is not None
        self.crop: tuple[int, int] | None = None
        self.taps: tuple[int, int, int, int] | None = None  # zero taps (left, right, top, bottom) of w
        if not self.symmetric:
            self._pad_by_zero_taps(top, left, bottom, right)
        if not self.symmetric and self.taps is None and not self.residual:
            # a residual post-op needs the exact output shape
            self._pad_by_whole_strides(top, left, bottom, right)
        self._packed: dict[tuple, torch.Tensor] = {}
        self.gemm = self._pointwise(kernel) and conv_as_gemm()
        self._forms: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # (address, weight, form)

    def _pointwise(self, kernel: Kernel) -> bool:
        """A 1x1 convolution of stride 1, no padding and one group, whose epilogue a packed linear's
        post-ops take (oneDNN's linear applies no activation after a residual add)."""
        kh, kw = kernel.node.src[1].shape[2:]
        return (
            (kh, kw) == (1, 1)
            and self.stride == [1, 1]
            and self.groups == 1
            and self.symmetric
            and self.padding == [0, 0]
            and not (self.residual and self.act is not None)
        )

    def _pad_by_zero_taps(self, top: int, left: int, bottom: int, right: int) -> None:
        """Asymmetric padding (TensorFlow-style "same" of stride-2 convs) as a symmetric one: the kernel
        grows by ``|hi - lo| / dilation`` zero taps on the side of the smaller pad, which shifts its window
        onto the same inputs. Measured against the crop of :meth:`_pad_by_whole_strides` on EfficientNet's
        and MobileNetV2's stride-2 depthwise convs: 10-40% faster (the crop copies the output), and the
        output has its exact shape, so a residual post-op fuses too. Needs ``|hi - lo|`` to be a multiple
        of the dilation."""
        taps, pads = [], []
        for lo, hi, d in ((top, bottom, self.dilation[0]), (left, right, self.dilation[1])):
            if (hi - lo) % d:
                return
            t = abs(hi - lo) // d
            taps.append((t, 0) if hi > lo else (0, t))
            pads.append(max(lo, hi))
        (t_top, t_bottom), (t_left, t_right) = taps
        self.taps = (t_left, t_right, t_top, t_bottom)
        self.padding, self.symmetric = pads, True

    def _pad_by_whole_strides(self, top: int, left: int, bottom: int, right: int) -> None:
        """Asymmetric padding (TensorFlow-style "same" of stride-2 convs) without a padded copy of the input:
        pad both sides by ``top + k * stride`` (at least ``bottom``) and drop the ``k`` extra leading output
        rows, whose windows start before the requested padding. A few extra output rows and columns are
        computed; the input is never copied."""
        (sh, sw), ks = self.stride, []
        for lo, hi, step in ((top, bottom, sh), (left, right, sw)):
            ks.append(max(0, -(-(hi - lo) // step)))
        self.padding = [top + ks[0] * sh, left + ks[1] * sw]
        self.crop = (ks[0], ks[1])
        self.wanted = (top + bottom, left + right)

    def _onednn(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32 and _mkldnn_ok()

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        residual: torch.Tensor | None,
        channels_last: bool,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The conv's epilogue output, channels-last or contiguous as asked; into ``out`` (an NHWC buffer of
        the output's shape) when given."""
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        # an `out` kept channels-last is returned as it is: it may be a channel slice of a concat's buffer
        if self.generated is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            y = self._run_generated(x, w, residual, out)
            return y if out is not None and channels_last else y.contiguous(memory_format=fmt)
        if not self.symmetric and self.crop is None:
            x = F.pad(x, self.pad)
        if self._onednn(x, w):
            y = (
                self._run_gemm(x, w, residual)
                if self.gemm and x.numel()
                else self._run_onednn(x, w, residual)
            )
        else:
            y = self._run_torch(x, w, residual)
        if self.crop is not None:
            y = self._cropped(y, x.shape[2:], w.shape[2:])
        if out is not None:  # the caller planned this memory for the output (an arena): keep it so
            out.copy_(y)
            return out if channels_last else out.contiguous(memory_format=fmt)
        return y.contiguous(memory_format=fmt)

    def _run_generated(
        self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The generated kernel (which packs the weight on first use and reads ``x`` NCHW or channels-last)
        into ``out`` or a fresh NHWC buffer."""
        reads = [x, w, self.bias]
        reads.append(None if residual is None else residual.contiguous(memory_format=torch.channels_last))
        if out is None:
            return self.generated.fresh(reads, {})[0]
        self.generated.launch(reads, [out], {})
        return out

    def _cropped(self, y: torch.Tensor, image: Sequence[int], kernel: Sequence[int]) -> torch.Tensor:
        sizes = [
            (n + pad - d * (k - 1) - 1) // s + 1
            for n, pad, d, k, s in zip(image, self.wanted, self.dilation, kernel, self.stride)
        ]
        (kh, kw), (oh, ow) = self.crop, sizes
        return y[:, :, kh : kh + oh, kw : kw + ow]

    def _tapped(self, w: torch.Tensor) -> torch.Tensor:
        if self.taps is None:
            return w
        return self._derived("tapped", w, lambda: F.pad(w, self.taps))

    def _derived(self, what: str, w: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, a form of the weight ``w``, made on first use and kept. The entry keeps the weight it
        was made from, so its memory cannot be reused by another tensor while its address is the key."""
        entry = self._forms.get(what)
        if entry is None or entry[0] != w.data_ptr():
            entry = self._forms[what] = (w.data_ptr(), w, make())
        return entry[2]

    def _packed_weight(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), w.data_ptr())
        pw = self._packed.get(key)
        if pw is None:
            pw = torch.ops.mkldnn._reorder_convolution_weight(
                self._tapped(w), self.padding, self.stride, self.dilation, self.groups, list(x.shape)
            )
            self._packed[key] = pw
        return pw

    def _run_onednn(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        pw = self._packed_weight(x, w)
        args = (self.padding, self.stride, self.dilation, self.groups)
        if residual is None:
            return torch.ops.mkldnn._convolution_pointwise(
                x, pw, self.bias, *args, self.act or "none", self.scalars, ""
            )
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, residual, pw, self.bias, *args, "add", None, self.act, [], None
        )

    def _linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` as a packed oneDNN linear weight, packed on first use."""
        pack = torch.ops.mkldnn._reorder_linear_weight
        return self._derived("linear", w, lambda: pack(w.reshape(w.shape[0], w.shape[1]).contiguous()))

    def _run_gemm(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The conv as ``x[N*H*W, Cin] @ w[Cin, Cout]`` over the NHWC buffer (a view, no copy), the output
        ``[N*H*W, Cout]`` viewed back as an NHWC ``(N, Cout, H, W)``."""
        n, c, h, wd = x.shape
        a = x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(-1, c)
        pw = self._linear_weight(w)
        if residual is None:
            y = torch.ops.mkldnn._linear_pointwise(a, pw, self.bias, self.act or "none", self.scalars, "")
        else:
            r = residual.permute(0, 2, 3, 1).reshape(a.shape[0], -1).contiguous()
            y = torch.ops.mkldnn._linear_pointwise.binary(a, r, pw, self.bias, "add")
        return y.view(n, h, wd, -1).permute(0, 3, 1, 2)

    def _run_torch(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = F.conv2d(x, self._tapped(w), bias, self.stride, self.padding, self.dilation, self.groups)
        if residual is not None:
            y = y.add_(residual)
        if self.act is not None:
            y = _TORCH_ACT[self.act](y, self.scalars)
        return y


__all__ = ["ConvRunner", "conv_as_gemm"]
