"""Classic CNN architectures as small torch modules, exported to ONNX in opset 9.

The op patterns of the pre-transformer model zoo, written here without torchvision (its registry wheels
need a CUDA torch): AlexNet (LRN, a wide fully-connected tail), VGG, GoogLeNet (the LRN op, four-branch
inception concats, ceil-mode max pools), SqueezeNet (fire modules), DenseNet (pre-activation
BN -> ReLU -> conv, concat growth), ShuffleNet v1 (grouped 1x1 convs, channel shuffles, an average-pool
shortcut that counts the padding) and v2 (channel split, shuffles through a batch-sized reshape),
MobileNet v1 (depthwise + pointwise), ResNet-18 and a pre-activation ResNet, plus ``oddities``: a
depthwise conv with channel multiplier 2, grouped convs, average pools with and without
``count_include_pad`` and ``ceil_mode``, reflection padding, nearest upsampling, ReLU6 (``Clip`` with
attributes) and a final softmax.

Widths are reduced (every model is under ~0.5 GFLOP at 224x224) but the layer structure is each
architecture's own. Batch norms stay separate nodes in the export (``TrainingMode.PRESERVE``: torch's
eval-mode export would fold them into the convs) and carry calibrated, non-trivial statistics.

Example:
    >>> from cnn_zoo import ZOO, export  # doctest: +SKIP
    >>> path = export("squeezenet", 224)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

CACHE = Path(__file__).resolve().parent / ".onnx_cache"
OPSETS = (9, 11, 13)  # the lowest the exporter accepts is used


def _conv(cin: int, cout: int, k: int, s: int = 1, p: int | None = None, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, s, k // 2 if p is None else p, groups=groups, bias=False)


def _cbr(cin: int, cout: int, k: int, s: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    """conv -> batch norm (-> ReLU)."""
    layers = [_conv(cin, cout, k, s, groups=groups), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU(inplace=True)) if relu else nn.Sequential(*layers)


def _classifier(
    features: nn.Module, size: int, widths: tuple[int, ...], classes: int = 1000
) -> nn.Sequential:
    """Dropout + Linear + ReLU layers over the flattened ``features`` output (the AlexNet / VGG tail)."""
    with torch.no_grad():
        n = features(torch.zeros(1, 3, size, size)).numel()
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Dropout(), nn.Linear(n, w), nn.ReLU(inplace=True)]
        n = w
    return nn.Sequential(*layers, nn.Linear(n, classes))


class _LRN(torch.autograd.Function):
    """torch's ``local_response_norm`` that exports as one ONNX ``LRN`` node, as Caffe-converted models
    spell it (torch's own export is a padded 3-d average pool of the squares)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, alpha: float, beta: float, k: float) -> torch.Tensor:
        return nn.functional.local_response_norm(x, size, alpha, beta, k)

    @staticmethod
    def symbolic(g, x, size: int, alpha: float, beta: float, k: float):
        return g.op("LRN", x, size_i=size, alpha_f=alpha, beta_f=beta, bias_f=k)


class LRN(nn.LocalResponseNorm):
    """``nn.LocalResponseNorm`` exported as the ONNX ``LRN`` op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LRN.apply(x, self.size, self.alpha, self.beta, self.k)


class AlexNet(nn.Module):
    """Caffe's AlexNet: LRN (torch's export of it) after the first two convs, overlapping 3x3/2 max pools,
    a 2048-wide FC tail; flattened with ``x.view(x.size(0), -1)`` (Shape -> Gather -> Concat -> Reshape in
    the export)."""

    def __init__(self, size: int = 224) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 48, 11, 4, 2),
            nn.ReLU(inplace=True),
            nn.LocalResponseNorm(5, 1e-4, 0.75, 2.0),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(48, 128, 5, padding=2, groups=2),
            nn.ReLU(inplace=True),
            nn.LocalResponseNorm(5, 1e-4, 0.75, 2.0),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(128, 192, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 192, 3, padding=1, groups=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 128, 3, padding=1, groups=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
        )
        self.classifier = _classifier(self.features, size, (2048, 2048))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.classifier(x.view(x.size(0), -1))


class VGG(nn.Module):
    """VGG-11 at a quarter of the width: 3x3 convs + ReLU, five 2x2 max pools, a 1024-wide FC tail."""

    def __init__(
        self, size: int = 224, cfg: tuple = (8, "M", 16, "M", 32, 32, "M", 64, 64, "M", 64, 64, "M")
    ):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = _classifier(self.features, size, (1024, 1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class Inception(nn.Module):
    """GoogLeNet's block: 1x1 | 1x1 -> 3x3 | 1x1 -> 5x5 | 3x3 max pool (ceil mode) -> 1x1, concatenated."""

    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, cp: int) -> None:
        super().__init__()

        def cr(a: int, b: int, k: int) -> list[nn.Module]:
            return [nn.Conv2d(a, b, k, padding=k // 2), nn.ReLU(inplace=True)]

        self.b1 = nn.Sequential(*cr(cin, c1, 1))
        self.b2 = nn.Sequential(*cr(cin, c3r, 1), *cr(c3r, c3, 3))
        self.b3 = nn.Sequential(*cr(cin, c5r, 1), *cr(c5r, c5, 5))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), *cr(cin, cp, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


class GoogLeNet(nn.Module):
    """Inception-v1 at about half width: 7x7/2 stem, LRN (the ONNX op), ceil-mode pools, inception 3a,
    3b, 4a, 4b."""

    def __init__(self, size: int = 224) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 7, 2, 3),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            LRN(5, 1e-4, 0.75),
            nn.Conv2d(32, 32, 1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            LRN(5, 1e-4, 0.75),
            nn.MaxPool2d(3, 2, ceil_mode=True),
        )
        self.blocks = nn.Sequential(
            Inception(64, 32, 48, 64, 8, 16, 16),
            Inception(128, 64, 64, 96, 16, 48, 32),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Inception(240, 96, 48, 104, 8, 24, 32),
            Inception(256, 80, 56, 112, 12, 32, 32),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.4), nn.Linear(256, 1000)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class Fire(nn.Module):
    """SqueezeNet's fire module: a 1x1 squeeze, then 1x1 and 3x3 expands concatenated."""

    def __init__(self, cin: int, s: int, e1: int, e3: int) -> None:
        super().__init__()
        self.squeeze = nn.Sequential(nn.Conv2d(cin, s, 1), nn.ReLU(inplace=True))
        self.e1 = nn.Sequential(nn.Conv2d(s, e1, 1), nn.ReLU(inplace=True))
        self.e3 = nn.Sequential(nn.Conv2d(s, e3, 3, padding=1), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze(x)
        return torch.cat([self.e1(x), self.e3(x)], 1)


class SqueezeNet(nn.Module):
    """SqueezeNet 1.1 at 3/4 width: ceil-mode pools, eight fire modules, a conv classifier, global pool."""

    def __init__(self, size: int = 224) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 48, 3, 2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(48, 12, 48, 48),
            Fire(96, 12, 48, 48),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(96, 24, 96, 96),
            Fire(192, 24, 96, 96),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(192, 36, 144, 144),
            Fire(288, 36, 144, 144),
            Fire(288, 48, 192, 192),
            Fire(384, 48, 192, 192),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Conv2d(384, 1000, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


class DenseLayer(nn.Module):
    """BN -> ReLU -> 1x1 conv (4k) -> BN -> ReLU -> 3x3 conv (k), concatenated onto its input."""

    def __init__(self, cin: int, k: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(cin),
            nn.ReLU(inplace=True),
            _conv(cin, 4 * k, 1),
            nn.BatchNorm2d(4 * k),
            nn.ReLU(inplace=True),
            _conv(4 * k, k, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


class DenseNet(nn.Module):
    """DenseNet-BC with growth 12 and blocks of 4, 6, 8 layers; transitions halve channels with a 1x1
    conv and a 2x2 average pool."""

    def __init__(self, size: int = 224, growth: int = 12, blocks: tuple[int, ...] = (4, 6, 8)) -> None:
        super().__init__()
        c = 2 * growth
        layers: list[nn.Module] = [_conv(3, c, 7, 2), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
        layers.append(nn.MaxPool2d(3, 2, 1))
        for i, n in enumerate(blocks):
            for _ in range(n):
                layers.append(DenseLayer(c, growth))
                c += growth
            if i < len(blocks) - 1:
                layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True), _conv(c, c // 2, 1), nn.AvgPool2d(2, 2)]
                c //= 2
        layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """ShuffleNet's shuffle: view as [N, g, C/g, H, W], swap the group axes, flatten back."""
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(b, -1, h, w)


class ShuffleV1Unit(nn.Module):
    """ShuffleNet v1: grouped 1x1 -> shuffle -> depthwise 3x3 -> grouped 1x1; a 3x3/2 average pool that
    counts the padding (``count_include_pad``) is concatenated on strided units, added otherwise."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int = 3) -> None:
        super().__init__()
        self.stride, self.groups = stride, groups
        mid = cout // 4
        out = cout - cin if stride == 2 else cout
        first_groups = 1 if cin == 24 else groups  # the first unit's input is too narrow to group
        self.gconv1 = _cbr(cin, mid, 1, groups=first_groups)
        self.dw = _cbr(mid, mid, 3, stride, groups=mid, relu=False)
        self.gconv2 = _cbr(mid, out, 1, groups=groups, relu=False)
        self.pool = nn.AvgPool2d(3, 2, 1) if stride == 2 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gconv2(self.dw(channel_shuffle(self.gconv1(x), self.groups)))
        if self.pool is not None:
            return torch.relu(torch.cat([self.pool(x), y], 1))
        return torch.relu(x + y)


class ShuffleNetV1(nn.Module):
    """ShuffleNet v1 (g=3) at half width: stages of 240, 480 channels."""

    def __init__(self, size: int = 224, widths: tuple[int, ...] = (120, 240, 480), repeats=(2, 4, 2)) -> None:
        super().__init__()
        layers: list[nn.Module] = [_cbr(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1)]
        cin = 24
        for w, r in zip(widths, repeats):
            for i in range(r):
                layers.append(ShuffleV1Unit(cin, w, 2 if i == 0 else 1))
                cin = w
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(cin, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class ShuffleV2Unit(nn.Module):
    """ShuffleNet v2: split the channels in two (stride 1) or feed both branches (stride 2), 1x1 ->
    depthwise 3x3 -> 1x1 on one, concat, shuffle with two groups."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = cout // 2
        inner = cin if stride == 2 else half
        self.branch2 = nn.Sequential(
            _cbr(inner, half, 1), _cbr(half, half, 3, stride, groups=half, relu=False), _cbr(half, half, 1)
        )
        self.branch1 = (
            nn.Sequential(_cbr(cin, cin, 3, 2, groups=cin, relu=False), _cbr(cin, half, 1))
            if stride == 2
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch1 is None:
            # sliced by the known width, not chunk(): the shuffle's view leaves the channel count unknown
            # to the exporter, and opset 9 has no Split of an unknown size
            half = self.branch2[0][0].in_channels
            out = torch.cat([x[:, :half], self.branch2(x[:, half:])], 1)
        else:
            out = torch.cat([self.branch1(x), self.branch2(x)], 1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """ShuffleNet v2 1.0x with fewer repeats: stages of 116, 232, 464 channels, a 1x1 to 1024."""

    def __init__(self, size: int = 224, widths=(116, 232, 464), repeats=(2, 4, 2)) -> None:
        super().__init__()
        layers: list[nn.Module] = [_cbr(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1)]
        cin = 24
        for w, r in zip(widths, repeats):
            for i in range(r):
                layers.append(ShuffleV2Unit(cin, w, 2 if i == 0 else 1))
                cin = w
        layers += [_cbr(cin, 1024, 1)]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(1024, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean([2, 3]))


class MobileNetV1(nn.Module):
    """MobileNet v1 at width 0.5: depthwise 3x3 + BN + ReLU then pointwise 1x1 + BN + ReLU, 13 times."""

    def __init__(self, size: int = 224, alpha: float = 0.5) -> None:
        super().__init__()
        cfg = [
            (64, 1),
            (128, 2),
            (128, 1),
            (256, 2),
            (256, 1),
            (512, 2),
            *[(512, 1)] * 5,
            (1024, 2),
            (1024, 1),
        ]
        c = int(32 * alpha)
        layers: list[nn.Module] = [_cbr(3, c, 3, 2)]
        for w, s in cfg:
            w = int(w * alpha)
            layers += [_cbr(c, c, 3, s, groups=c), _cbr(c, w, 1)]
            c = w
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(c, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + BN, ReLU after the residual add; 1x1/2 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_cbr(cin, cout, 3, stride), _cbr(cout, cout, 3, relu=False))
        self.short = _cbr(cin, cout, 1, stride, relu=False) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


class PreActBlock(nn.Module):
    """Pre-activation block (He et al. 2016): BN -> ReLU -> conv, twice; the shortcut projects the
    activated input."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), _conv(cin, cout, 3, stride)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), _conv(cout, cout, 3)
        self.short = _conv(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn1(x))
        y = self.conv2(torch.relu(self.bn2(self.conv1(a))))
        return y + (self.short(a) if self.short is not None else x)


class ResNet(nn.Module):
    """ResNet-18's layout (7x7/2 stem, 3x3/2 max pool, four stages of two blocks) at 3/8 width; with
    ``PreActBlock`` the pre-activation variant (a final BN + ReLU before the pool)."""

    def __init__(self, size: int = 224, block: type = BasicBlock, widths=(24, 48, 96, 192)) -> None:
        super().__init__()
        pre = block is PreActBlock
        stem = [_conv(3, widths[0], 7, 2)] if pre else [_cbr(3, widths[0], 7, 2)]
        layers: list[nn.Module] = [*stem, nn.MaxPool2d(3, 2, 1)]
        c = widths[0]
        for i, w in enumerate(widths):
            layers += [block(c, w, 1 if i == 0 else 2), block(w, w, 1)]
            c = w
        if pre:
            layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(c, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class Oddities(nn.Module):
    """The less common spellings of the era: reflection padding, a depthwise conv with channel multiplier
    2, a grouped conv with more outputs than inputs per group, average pools with and without
    ``count_include_pad`` (and ``ceil_mode``), nearest upsampling, ReLU6, a dilated conv, a softmax."""

    def __init__(self, size: int = 224) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.ReflectionPad2d(2), nn.Conv2d(3, 16, 5, 2), nn.BatchNorm2d(16), nn.ReLU6()
        )
        self.dw2 = nn.Sequential(nn.Conv2d(16, 32, 3, 1, 1, groups=16), nn.BatchNorm2d(32), nn.ReLU6())
        self.pool_in = nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=True)
        self.group = nn.Sequential(nn.Conv2d(32, 64, 3, 1, 1, groups=4), nn.BatchNorm2d(64), nn.ReLU())
        self.pool_ex = nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)
        self.dilated = nn.Sequential(nn.Conv2d(64, 64, 3, 1, 2, dilation=2), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.mix = nn.Conv2d(96, 64, 1)
        self.fc = nn.Linear(64, 100)
        with torch.no_grad():  # the crop after upsampling, as constants (opset 9 has no run-time Slice)
            self.crop = self.pool_in(self.stem(torch.zeros(1, 3, size, size))).shape[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool_in(self.dw2(self.stem(x)))
        y = self.dilated(self.pool_ex(self.group(x)))
        y = torch.cat([self.up(y)[:, :, : self.crop, : self.crop], x], 1)
        y = torch.relu(self.mix(y)).mean([2, 3])
        return torch.softmax(self.fc(y), 1)


# name -> builder(image size); the benchmark and the tests read this table
ZOO: dict[str, Callable[[int], nn.Module]] = {
    "alexnet": AlexNet,
    "vgg11_small": VGG,
    "googlenet": GoogLeNet,
    "squeezenet": SqueezeNet,
    "densenet_small": DenseNet,
    "shufflenet_v1": ShuffleNetV1,
    "shufflenet_v2": ShuffleNetV2,
    "mobilenet_v1": MobileNetV1,
    "resnet18_small": ResNet,
    "preact_resnet": lambda size: ResNet(size, PreActBlock),
    "oddities": Oddities,
}


def build(name: str, size: int = 224, seed: int = 0) -> nn.Module:
    """The model ``name`` for ``size`` x ``size`` images, in eval mode, with weights that keep activations
    at a trained network's scale: He-normal convs and linears, batch-norm scales and shifts drawn at
    random and running statistics of a few random batches (train-mode forwards, no gradients)."""
    torch.manual_seed(seed)
    model = ZOO[name](size)
    gen = torch.Generator().manual_seed(seed + 1)
    bns = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            fan_in = m.weight[0].numel()
            m.weight.data = torch.randn(m.weight.shape, generator=gen) * (2 / fan_in) ** 0.5
            if m.bias is not None:
                m.bias.data = torch.randn(m.bias.shape, generator=gen) * 0.1
        elif isinstance(m, nn.BatchNorm2d):
            m.weight.data = torch.rand(m.weight.shape, generator=gen) + 0.5
            m.bias.data = torch.randn(m.bias.shape, generator=gen) * 0.2
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the calibration batches
            bns.append(m)
    if bns:
        model.train()
        with torch.no_grad():
            for i in range(3):
                model(torch.randn(4, 3, size, size, generator=gen) + 0.1 * i)
    return model.eval()


def _stamp() -> str:
    """Changes whenever this file or torch does, so a stale export is never reused."""
    src = Path(__file__).read_bytes() + torch.__version__.encode()
    return hashlib.sha256(src).hexdigest()[:10]


def export(name: str, size: int = 224, cache: Path = CACHE) -> Path:
    """``name`` exported at ``size`` x ``size`` with a dynamic batch axis (``"batch"``), in the lowest of
    :data:`OPSETS` the exporter takes; cached in ``cache`` under a name that holds the source's digest.

    Input ``x`` [batch, 3, size, size] f32, output ``y``."""
    path = cache / f"{name}.s{size}.{_stamp()}.onnx"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob(f"{name}.s{size}.*.onnx"):  # exports of an earlier version of this file
        stale.unlink(missing_ok=True)
    model = build(name, size)
    x = torch.randn(2, 3, size, size)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    errors = []
    for opset in OPSETS:
        try:
            # the exporter warns about its own deprecation and about folding in PRESERVE mode (it folds)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    model,
                    (x,),
                    str(tmp),
                    input_names=["x"],
                    output_names=["y"],
                    dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
                    opset_version=opset,
                    training=torch.onnx.TrainingMode.PRESERVE,  # keeps the batch norms separate
                    do_constant_folding=True,
                    dynamo=False,
                )
        except Exception as e:  # an op this opset cannot spell: try the next
            errors.append(f"opset {opset}: {type(e).__name__}: {e}")
            continue
        tmp.replace(path)
        return path
    raise RuntimeError(f"cannot export {name}: " + "; ".join(errors))


__all__ = ["CACHE", "OPSETS", "ZOO", "build", "channel_shuffle", "export"]
