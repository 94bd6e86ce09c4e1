"""A small Llama-style decoder whose norms, activation, rotary, attention, projections, embedding are marked.

The model is ordinary eager PyTorch, written the way model code usually is (norms computed in f32 with
several ops, `rotate_half` with a concat, scores, softmax after a scale and an additive causal mask, and
the weighted sum of values). Each marked
layer keeps working unchanged; ``kernelize`` with :func:`kernelize.hub.default_mapping` swaps their
forwards for the bundled hub's generated kernels:

============================  ============================  =================
module                        marked as                     hub repository
============================  ============================  =================
``RMSNorm``                   ``RMSNorm``             kernelize/layer_norm
``ResidualRMSNorm``           ``FusedAddRMSNorm``     kernelize/layer_norm
``SiluAndMul``                ``SiluAndMul``          kernelize/activation
``RotaryEmbedding``           ``RotaryEmbedding``     kernelize/rotary
``ScaledDotProductAttention`` ``ScaledDotProductAttention`` kernelize/attention
``Linear`` (the projections)  ``Linear``                    kernelize/linear
``Embedding`` (the tokens)    ``Embedding``                 kernelize/linear
============================  ============================  =================

``ScaledMaskedSoftmax`` (kernelize/softmax) is kept for models that only mark their softmax.

Example:
    >>> model = LlamaDemo(LlamaDemoConfig.tiny()).eval()
    >>> logits = model(torch.randint(0, 128, (2, 16)))
    >>> tuple(logits.shape)
    (2, 16, 128)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernelize.layer.decorators import use_kernel_forward_from_hub

__all__ = [
    "MARKED_LAYERS",
    "Attention",
    "DecoderLayer",
    "Embedding",
    "LlamaDemo",
    "LlamaDemoConfig",
    "MLP",
    "RMSNorm",
    "ResidualRMSNorm",
    "RotaryEmbedding",
    "ScaledDotProductAttention",
    "ScaledMaskedSoftmax",
    "SiluAndMul",
]


@dataclass(frozen=True)
class LlamaDemoConfig:
    """Sizes of the demo decoder. ``head_dim = hidden // heads``."""

    vocab: int = 512
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    intermediate: int = 512
    max_seq: int = 512
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"LlamaDemoConfig: hidden={self.hidden} must split into {self.heads} heads of an even size."
            )

    @classmethod
    def tiny(cls) -> LlamaDemoConfig:
        """The size used by tests and ``--quick``."""
        return cls(vocab=128, hidden=64, layers=2, heads=4, intermediate=128, max_seq=64)

    @classmethod
    def bench(cls) -> LlamaDemoConfig:
        """The size ``benchmarks/model.py`` uses: hidden 1024, 4 layers."""
        return cls(vocab=1024, hidden=1024, layers=4, heads=16, intermediate=2816, max_seq=512)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@use_kernel_forward_from_hub("RMSNorm")
class RMSNorm(nn.Module):
    """Llama's RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)``, computed in f32."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


@use_kernel_forward_from_hub("FusedAddRMSNorm")
class ResidualRMSNorm(RMSNorm):
    """The residual add followed by the next RMSNorm: returns ``(norm(x + residual), x + residual)``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        return super().forward(total), total


@use_kernel_forward_from_hub("SiluAndMul")
class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]``: the gated activation on a fused gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


@use_kernel_forward_from_hub("RotaryEmbedding")
class RotaryEmbedding(nn.Module):
    """Applies rotary position embeddings (neox style) to ``q``, ``k`` of shape (batch, heads, seq, dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.is_neox_style = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def rotate_half(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@use_kernel_forward_from_hub("Linear")
class Linear(nn.Linear):
    """A projection, ``x @ weight.T`` (no bias): ``nn.Linear`` marked so the hub's ``Linear`` can take it."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)


@use_kernel_forward_from_hub("Embedding")
class Embedding(nn.Embedding):
    """The token embedding, ``weight[ids]``: ``nn.Embedding`` marked (in training the hub's layer makes the
    weight gradient on lazily zeroed memory: the pages of the rows written, no 65 MB zero fill)."""


@use_kernel_forward_from_hub("ScaledMaskedSoftmax")
class ScaledMaskedSoftmax(nn.Module):
    """``softmax(scores * scale + mask)`` over the last axis, in f32."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        logits = scores.to(torch.float32) * self.scale
        if mask is not None:
            logits = logits + mask
        return torch.softmax(logits, dim=-1).to(scores.dtype)


@use_kernel_forward_from_hub("ScaledDotProductAttention")
class ScaledDotProductAttention(nn.Module):
    """``softmax(q @ k^T * scale + mask) @ v``: scores, their softmax in f32, the values' weighted sum."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = (q @ k.transpose(-1, -2)).to(torch.float32) * self.scale
        if mask is not None:
            logits = logits + mask
        return torch.softmax(logits, dim=-1).to(q.dtype) @ v


class MLP(nn.Module):
    def __init__(self, cfg: LlamaDemoConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden, 2 * cfg.intermediate)
        self.act = SiluAndMul()
        self.down_proj = Linear(cfg.intermediate, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaDemoConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden, 3 * cfg.hidden)
        self.o_proj = Linear(cfg.hidden, cfg.hidden)
        self.rotary = RotaryEmbedding()
        self.attn = ScaledDotProductAttention(1.0 / math.sqrt(cfg.head_dim))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv_proj(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(qkv[0], qkv[1], cos, sin)
        out = self.attn(q, k, qkv[2], mask).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaDemoConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = ResidualRMSNorm(cfg.hidden, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask)
        normed, residual = self.post_attention_layernorm(attn, x)
        return residual + self.mlp(normed)


class LlamaDemo(nn.Module):
    """Embedding, ``layers`` decoder layers, final RMSNorm and LM head; random weights (seeded)."""

    def __init__(self, cfg: LlamaDemoConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LlamaDemoConfig()
        gen = torch.random.fork_rng()
        with gen:
            torch.manual_seed(seed)
            self.embed = Embedding(cfg.vocab, cfg.hidden)
            self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
            self.norm = RMSNorm(cfg.hidden, cfg.eps)
            self.lm_head = Linear(cfg.hidden, cfg.vocab)
            for module in self.modules():  # non-trivial norm weights so a wrong weight read shows
                if isinstance(module, RMSNorm):
                    nn.init.normal_(module.weight, 1.0, 0.1)
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        )
        freqs = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        if s > self.cfg.max_seq:
            raise ValueError(f"LlamaDemo: sequence length {s} exceeds max_seq={self.cfg.max_seq}.")
        x = self.embed(input_ids)
        cos, sin = self.cos_cached[:s].to(x.dtype), self.sin_cached[:s].to(x.dtype)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


# module class -> the name it is marked with (what default_mapping() must cover for the demo)
MARKED_LAYERS = {
    cls.__name__: cls.kernel_layer_name
    for cls in (
        RMSNorm,
        ResidualRMSNorm,
        SiluAndMul,
        RotaryEmbedding,
        ScaledDotProductAttention,
        Linear,
        Embedding,
    )
}
