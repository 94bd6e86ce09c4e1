"""Linear layers with a fused epilogue: `act(x @ weight.T + bias)` as one matmul kernel.

The math once, as plain torch; `forward` runs the kernel generated from it (a matmul kernel whose
epilogue adds the bias and applies the activation before the single store). State from the replaced
module: `weight` (out_features, in_features) and `bias` (may be None), as in `torch.nn.Linear`.
With gradients, `Linear` on f32 CPU tensors runs `kernelize.hub.train_linear` (oneDNN forward and input
gradient, MKL weight gradient: faster than the generated graphs' GEMMs); otherwise training runs the
generated backward graphs (`kernelize.hub.run`).

`Embedding` is the one-hot special case, `weight[input]`: a generated gather kernel; with gradients on the
CPU, `kernelize.hub.train_embedding` (the dense weight gradient on lazily zeroed memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernelize import hub


# ---- the math (plain torch; traced into kernels) ---------------------------------------------------------
def linear_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x @ weight.t() + bias


def linear_nobias_math(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


def linear_relu_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The seed's fused kernel: relu(x @ W.T + b)."""
    return torch.relu(x @ weight.t() + bias)


def linear_gelu_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ weight.t() + bias)


def linear_silu_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ weight.t() + bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"):
    """Functional API: `act(x @ weight.T + bias)` with act in none, relu, gelu, silu."""
    if bias is None:
        if activation != "none":
            raise ValueError(f"linear(activation={activation!r}) needs a bias in this repository.")
        return hub.run(None, linear_nobias_math, [x], [weight])
    return hub.run(None, _ACT[activation], [x], [weight, bias])


def embedding_math(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


_ACT = {"none": linear_math, "relu": linear_relu_math, "gelu": linear_gelu_math, "silu": linear_silu_math}


# ---- kernel layers ----------------------------------------------------------------------------------------
class Linear(nn.Module):
    """`x @ weight.T + bias` (replaces `torch.nn.Linear`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        trained = hub.train_linear(input, self.weight, self.bias)  # with gradients on the CPU: oneDNN
        if trained is not None:
            return trained
        if self.bias is None:
            return hub.run(self, linear_nobias_math, [input], [self.weight])
        return hub.run(self, linear_math, [input], [self.weight, self.bias])


class LinearReLU(nn.Module):
    """`relu(x @ weight.T + bias)` for a module holding `weight` and `bias` whose forward is exactly that."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return hub.run(self, linear_relu_math, [input], [self.weight, self.bias])


class LinearGELU(nn.Module):
    """`gelu(x @ weight.T + bias)`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return hub.run(self, linear_gelu_math, [input], [self.weight, self.bias])


class LinearSiLU(nn.Module):
    """`silu(x @ weight.T + bias)`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return hub.run(self, linear_silu_math, [input], [self.weight, self.bias])


class Embedding(nn.Module):
    """`weight[input]` (replaces `torch.nn.Embedding`): `weight` (num_embeddings, embedding_dim), and
    `padding_idx` (its row gets no gradient), `max_norm`, `scale_grad_by_freq`, `sparse` when present.

    Without gradients: the generated gather kernel, which raises for an id out of range as torch does (an
    IndexError on the CPU; on a GPU, asynchronously). With gradients on the CPU: `hub.train_embedding`.
    Elsewhere, and with `max_norm` (it renormalises the weight in place), `scale_grad_by_freq` or `sparse`:
    `F.embedding` (the IR has no gradient rule for a gather: that is a scatter-add).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        padding_idx = getattr(self, "padding_idx", None)
        options = (getattr(self, "max_norm", None), getattr(self, "norm_type", 2.0))
        options += (getattr(self, "scale_grad_by_freq", False), getattr(self, "sparse", False))
        plain = options[0] is None and not options[2] and not options[3]
        if plain and not (torch.is_grad_enabled() and self.weight.requires_grad):
            # an id outside [0, rows) raises, as in torch: the traced F.embedding sends a negative one out
            # of range, where the CPU kernel raises an IndexError and a GPU kernel sets the flag its
            # launcher asserts on
            return hub.run(self, embedding_math, [input], [self.weight])
        trained = hub.train_embedding(input, self.weight, padding_idx) if plain else None
        return trained if trained is not None else F.embedding(input, self.weight, padding_idx, *options)
