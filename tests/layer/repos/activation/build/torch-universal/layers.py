"""Kernel layers: stateless, forward only, same signature as the layers they replace."""

import torch
from torch import nn

from ._ops import CALLS, silu_and_mul


class SiluAndMul(nn.Module):
    """Supports every mode: has a backward (autograd through torch ops) and compiles."""

    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["SiluAndMul"] += 1
        return silu_and_mul(x)


class SiluAndMulEager(nn.Module):
    """Does not declare `can_torch_compile`: not for Mode.TORCH_COMPILE."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["SiluAndMulEager"] += 1
        return silu_and_mul(x)


class SiluAndMulNoBackward(nn.Module):
    """Inference only: `has_backward = False`."""

    has_backward = False
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["SiluAndMulNoBackward"] += 1
        return silu_and_mul(x).detach()
