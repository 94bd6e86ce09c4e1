"""Each class breaks exactly one rule a kernel layer must follow."""

import torch
from torch import nn


class NotAModule:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class WithInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class WithHelper(nn.Module):
    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.helper(x)


class WithOverride(nn.Module):
    """Overrides an nn.Module method: a member beyond forward, even though nn.Module has it too."""

    def extra_repr(self) -> str:
        return "overridden"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class KeywordOnly(nn.Module):
    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return x


class NoForward(nn.Module):
    has_backward = True


class InheritsOk(nn.Module):
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Subclassed(InheritsOk):
    """Members inherited from a kernel base class count too; these are all allowed."""

    has_backward = False


class ForwardNotAFunction(nn.Module):
    forward = 3


class StaticForward(nn.Module):
    forward = staticmethod(torch.relu)
