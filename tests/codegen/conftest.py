"""Shared by the code generator tests. Kept minimal: each backend's own fixtures live in its test file."""

import os

# Triton decides between compiling and interpreting when `@triton.jit` decorates, so this must be set
# before any generated Triton module is loaded: no GPU here, the kernels run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
