"""Readable text form of a graph: one line per value, ``%i = op(%a, %b) {arg} : dtype[shape]``.

Example:
    >>> print(g)  # doctest: +SKIP
    graph(%0 x: f32[batch, 64]) {
      %0 = input 'x' : f32[batch, 64]
      %1 = softmax(%0) {1} : f32[batch, 64]
      return %1
    }
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING

from kernelize.ir.ops import TYPED_ARGS
from kernelize.ir.shapes import shape_str

if TYPE_CHECKING:
    from kernelize.ir.graph import Graph, Node


def format_arg(arg: object) -> str:
    """An op's attribute for reading: floats with 7 significant digits (a f32 ``1e-6`` prints as ``1e-06``,
    not ``9.999999974752427e-07``), containers recursively, everything else by ``repr``."""
    if isinstance(arg, float):
        return f"{arg:.7g}"
    if isinstance(arg, TYPED_ARGS):  # an optional field left at its default is not printed
        shown = [
            f
            for f in dataclasses.fields(arg)
            if not (f.metadata.get("optional") and getattr(arg, f.name) == f.default)
        ]
        fields = ", ".join(f"{f.name}={format_arg(getattr(arg, f.name))}" for f in shown)
        return f"{type(arg).__name__}({fields})"
    if isinstance(arg, tuple):
        inner = ", ".join(format_arg(a) for a in arg)
        return f"({inner},)" if len(arg) == 1 else f"({inner})"
    return repr(arg)


def format_node(graph: Graph, node: Node) -> str:
    """One node as ``%i = op(%a, %b) {arg} : dtype[shape]`` (sources without parentheses)."""
    head = f"%{graph.index(node)} = {node.op}"
    if node.src:
        head += "(" + ", ".join(f"%{graph.index(s)}" for s in node.src) + ")"
    if isinstance(node.arg, str):
        head += f" {node.arg!r}"
    elif node.arg is not None:
        head += f" {{{format_arg(node.arg)}}}"
    return f"{head} : {node.dtype}{shape_str(node.shape)}"


def format_graph(graph: Graph) -> str:
    """The whole graph: a signature line, one line per node, and the returned values."""
    sig = ", ".join(f"%{graph.index(i)} {i.arg}: {i.dtype}{shape_str(i.shape)}" for i in graph.inputs)
    lines = [f"graph({sig}) {{"]
    lines += ["  " + format_node(graph, n) for n in graph.nodes]
    lines.append(f"  return {', '.join(f'%{graph.index(o)}' for o in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines)


def op_counts(graph: Graph) -> Counter:
    """How many nodes of each op the graph holds."""
    return Counter(str(n.op) for n in graph.nodes)
