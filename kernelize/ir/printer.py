"""Readable text form of a graph: one line per value, ``%i = op(%a, %b) {arg} : dtype[shape]``."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kernelize.ir.shapes import shape_str

if TYPE_CHECKING:
    from kernelize.ir.graph import Graph, Node


def format_node(graph: Graph, node: Node) -> str:
    srcs = ", ".join(f"%{graph.index(s)}" for s in node.src)
    arg = "" if node.arg is None else f" {{{node.arg!r}}}" if not isinstance(node.arg, str) else f" {node.arg!r}"
    return f"%{graph.index(node)} = {node.op}({srcs}){arg} : {node.dtype}{shape_str(node.shape)}"


def format_graph(graph: Graph) -> str:
    lines = [f"graph({', '.join(f'%{graph.index(i)}' for i in graph.inputs)}) {{"]
    lines += ["  " + format_node(graph, n) for n in graph.nodes]
    lines.append(f"  return {', '.join(f'%{graph.index(o)}' for o in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines)


def op_counts(graph: Graph) -> Counter:
    """How many nodes of each op the graph holds."""
    return Counter(str(n.op) for n in graph.nodes)
