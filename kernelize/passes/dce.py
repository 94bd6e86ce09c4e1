"""Dead-code elimination: drop every node no output depends on (inputs always stay: they are the signature).

Example:
    before                              after
    %0 = input 'x' : f32[4]             %0 = input 'x' : f32[4]
    %1 = exp(%0) : f32[4]               %1 = neg(%0) : f32[4]
    %2 = neg(%0) : f32[4]               return %1
    return %2
"""

from __future__ import annotations

from kernelize.ir.graph import Graph
from kernelize.passes.rewrite import live_nodes, map_nodes


def dce(graph: Graph) -> Graph:
    """A copy of ``graph`` without dead nodes."""
    return map_nodes(graph, live_nodes(graph).__contains__)


__all__ = ["dce", "live_nodes"]
