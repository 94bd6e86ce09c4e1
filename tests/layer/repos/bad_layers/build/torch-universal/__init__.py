"""Test kernel repository `bad_layers`: kernel layers that break one validation rule each."""

from . import layers

__all__ = ["layers"]
