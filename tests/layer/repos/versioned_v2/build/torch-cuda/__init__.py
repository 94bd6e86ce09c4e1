"""Test kernel repository `versioned`, version 2, build variant torch-cuda."""

from collections import Counter

VERSION = 2
VARIANT = "torch-cuda"
CALLS: Counter = Counter()


def scale(x):
    """x * VERSION: the version shows in the result."""
    return x * VERSION


from . import layers  # noqa: E402  (layers reads VERSION)

__all__ = ["CALLS", "VARIANT", "VERSION", "layers", "scale"]
