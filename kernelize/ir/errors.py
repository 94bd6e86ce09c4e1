"""Errors shared by the IR front ends."""

from __future__ import annotations


class DTypeError(TypeError):
    """Dtypes of operands do not fit the operation."""


class UnsupportedOpError(NotImplementedError):
    """A front end met an operation the IR cannot express.

    The message names the operation (torch op or ONNX op type), where it came from (source line, or node
    name and opset) and what is supported instead.
    """


class FoldLimitError(ValueError):
    """A value known at load time would exceed the constant-folding cap and the IR cannot compute it at run
    time instead (an ONNX ``Range`` of 10**12 elements). The message names the node, the size and the cap.
    """
