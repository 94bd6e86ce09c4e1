"""Marked layers and repositories shared by the kernelize tests."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernelize import LocalLayerRepository, get_local_kernel, use_kernel_forward_from_hub

REPOS = Path(__file__).parent / "repos"
ACTIVATION = REPOS / "activation"


def act(layer: str = "SiluAndMul") -> LocalLayerRepository:
    return LocalLayerRepository(ACTIVATION, layer_name=layer)


def kernel_calls() -> dict[str, int]:
    return dict(get_local_kernel(ACTIVATION).CALLS)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@use_kernel_forward_from_hub("SiluAndMul")
class SiluAndMul(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_reference(input)


@use_kernel_forward_from_hub("RMSNorm")
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.act = SiluAndMul()
        self.norm = RMSNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.up(x)))


def gated() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), SiluAndMul())
