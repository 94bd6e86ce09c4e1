"""Scale kernel layer: multiplies by the repository version, so tests see which version ran."""

import torch
from torch import nn

from . import CALLS, VERSION


class Scale(nn.Module):
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["Scale"] += 1
        return x * VERSION
