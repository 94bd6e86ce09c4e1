"""The graph IR: builder, front ends, reference executor, verifier and pictures.

Example:
    >>> from kernelize import ir
    >>> g = ir.Graph()
    >>> x = g.input("x", ("batch", 64), "f32")
    >>> g.output(g.softmax(x))
    >>> ir.evaluate(g, [torch.randn(3, 64)])  # doctest: +SKIP
"""

from kernelize.ir.autodiff import NotDifferentiable, split, vjp
from kernelize.ir.dot import graph_to_svg, to_dot
from kernelize.ir.dtypes import DType
from kernelize.ir.errors import FoldLimitError, UnsupportedOpError
from kernelize.ir.graph import Constant, DTypeError, Graph, Node, Op
from kernelize.ir.onnx_frontend import load_onnx
from kernelize.ir.printer import format_graph, op_counts
from kernelize.ir.reference import evaluate
from kernelize.ir.shapes import ShapeError, Sym
from kernelize.ir.torch_frontend import trace
from kernelize.ir.verify import VerifyError, verify


def __getattr__(name: str):
    # optimize lives in kernelize.passes, which imports this package: resolve it on first use, not at import
    if name in ("optimize", "OptimizerSettings"):
        import importlib

        return getattr(importlib.import_module("kernelize.passes.optimize"), name)
    raise AttributeError(f"module 'kernelize.ir' has no attribute {name!r}")


__all__ = [
    "Constant",
    "DType",
    "DTypeError",
    "FoldLimitError",
    "Graph",
    "Node",
    "NotDifferentiable",
    "Op",
    "OptimizerSettings",
    "ShapeError",
    "Sym",
    "UnsupportedOpError",
    "VerifyError",
    "evaluate",
    "format_graph",
    "graph_to_svg",
    "load_onnx",
    "op_counts",
    "optimize",
    "split",
    "to_dot",
    "trace",
    "verify",
    "vjp",
]
