"""Test kernel repository `layer_norm`, build variant torch-cuda."""

from collections import Counter

VARIANT = "torch-cuda"
CALLS: Counter = Counter()

from . import layers  # noqa: E402  (layers reads CALLS)

__all__ = ["CALLS", "VARIANT", "layers"]
