"""The bundled hub's layer names: which repository provides each layer a model marks (default_mapping)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["HUB_LAYERS", "MAPPED_DEVICES", "default_mapping"]

# repo -> layers it provides, for default_mapping(); the name a model marks its layer with is the key
HUB_LAYERS: Mapping[str, Mapping[str, str]] = {
    "activation": {
        "SiluAndMul": "SiluAndMul",
        "GeluAndMul": "GeluAndMul",
        "GeluTanhAndMul": "GeluTanhAndMul",
        "FastGELU": "FastGELU",
        "QuickGELU": "QuickGELU",
        "NewGELU": "NewGELU",
        "GatedMLP": "GatedMLP",
        "LlamaMLP": "GatedMLP",
        "FusedGatedMLP": "FusedGatedMLP",
        "DenseMLP": "DenseMLP",
    },
    "layer_norm": {
        "RMSNorm": "RMSNorm",
        "LlamaRMSNorm": "RMSNorm",
        "GemmaRMSNorm": "GemmaRMSNorm",
        "LayerNorm": "LayerNorm",
        "FusedAddRMSNorm": "FusedAddRMSNorm",
        "GatedRMSNorm": "GatedRMSNorm",
        "RMSNormGated": "GatedRMSNorm",
    },
    "rotary": {"RotaryEmbedding": "RotaryEmbedding", "rotary_pos_emb": "ApplyRotaryPosEmb"},
    "softmax": {"Softmax": "Softmax", "ScaledMaskedSoftmax": "ScaledMaskedSoftmax"},
    "attention": {"ScaledDotProductAttention": "ScaledDotProductAttention"},
    "llm": {
        "CausalSelfAttention": "CausalSelfAttention",
        "AlibiAttention": "AlibiAttention",
        "ResidualAlibiAttention": "ResidualAlibiAttention",
        "FusedQKVAttention": "FusedQKVAttention",
        "FusedQKVDecoderLayer": "FusedQKVDecoderLayer",
        "PreNormDecoderLayer": "PreNormDecoderLayer",
        "EmbeddingsFirstDecoderLayer": "EmbeddingsFirstDecoderLayer",
        "CausalLMWithLoss": "CausalLMWithLoss",
        "MoECausalLM": "MoECausalLM",
    },
    "linear": {
        "Linear": "Linear",
        "LinearReLU": "LinearReLU",
        "LinearGELU": "LinearGELU",
        "LinearSiLU": "LinearSiLU",
        "Embedding": "Embedding",
    },
}
MAPPED_DEVICES = ("cpu", "cuda", "rocm")


def default_mapping(devices: Sequence[str] = MAPPED_DEVICES, version: int = 1) -> dict[str, dict[str, Any]]:
    """A kernel mapping from the common layer names to the bundled hub, for ``use_kernel_mapping``.

    Every name in :data:`HUB_LAYERS` maps, for each of `devices`, to
    ``LayerRepository("kernelize/<repo>", layer_name=..., version=version)``.

    Example:
        >>> from kernelize import kernelize, use_kernel_mapping, Mode  # doctest: +SKIP
        >>> with use_kernel_mapping(default_mapping()):  # doctest: +SKIP
        ...     model = kernelize(model, device="cpu", mode=Mode.INFERENCE)
    """
    from kernelize.layer.repos import LayerRepository

    mapping: dict[str, dict[str, Any]] = {}
    for repo, layers in HUB_LAYERS.items():
        for name, layer in layers.items():
            repository = LayerRepository(repo_id=f"kernelize/{repo}", layer_name=layer, version=version)
            mapping[name] = {device: repository for device in devices}
    return mapping
