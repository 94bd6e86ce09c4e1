"""Regenerate the small ONNX models in this folder with torch's (TorchScript) ONNX exporter.

Run from the repository root: ``python tests/ir/data/make_onnx_models.py``. The models have fixed seeds and
dynamic batch (and sequence) axes, so loading them exercises symbolic dims and shape subgraphs.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2),
            nn.BatchNorm2d(16),
            nn.Hardswish(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class TinyBlock(nn.Module):
    """A pre-norm transformer block; ``view`` by the input's own sizes exports as Shape->Gather->Reshape."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def main() -> None:
    torch.manual_seed(0)
    cnn = TinyCNN().eval()
    with torch.no_grad():  # non-trivial batch-norm statistics
        for m in cnn.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    block = TinyBlock().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            cnn,
            (torch.randn(2, 3, 16, 16),),
            str(HERE / "tiny_cnn.onnx"),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        )
        torch.onnx.export(
            block,
            (torch.randn(2, 5, 32),),
            str(HERE / "tiny_block.onnx"),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch", 1: "seq"}, "y": {0: "batch", 1: "seq"}},
        )


if __name__ == "__main__":
    main()
