"""Fused linear + cross-entropy: the LM-head loss without materialising the logits matrix."""

from . import layers
from .layers import LinearCrossEntropy, fused_linear_cross_entropy

__all__ = ["LinearCrossEntropy", "fused_linear_cross_entropy", "layers"]
