"""Runtime tests run generated Triton kernels under the interpreter on CPU tensors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
