"""Test kernel repository `activation`: SiluAndMul as a function and as layers."""

from . import layers
from ._ops import CALLS, silu_and_mul

__all__ = ["CALLS", "layers", "silu_and_mul"]
