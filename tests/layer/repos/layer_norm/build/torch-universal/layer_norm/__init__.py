"""Test kernel repository `layer_norm`, build variant torch-universal."""

from collections import Counter

VARIANT = "torch-universal"
CALLS: Counter = Counter()

from . import layers  # noqa: E402  (layers reads CALLS)

__all__ = ["CALLS", "VARIANT", "layers"]
