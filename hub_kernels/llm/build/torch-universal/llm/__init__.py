"""Decoder-model layers for transformers models: attention with fused rotary and the generated kernel."""

from . import layers
from .layers import project_qkv

__all__ = ["layers", "project_qkv"]
