"""Pictures of a fusion plan: the graph with each kernel drawn as a Graphviz cluster.

Values a kernel computes sit in its cluster (bold border: written to memory); inputs, constants and layout
ops sit outside (layout ops are strides, never kernels); values recomputed inside their readers are dashed.

Example:
    >>> plan_to_svg("plan.svg", plan(graph))  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from kernelize.autokernel.plan import Plan
from kernelize.ir.dot import CATEGORIES, category, closing_lines, escape, node_label, write_svg
from kernelize.ir.graph import Node, Op

# cluster background per kernel kind
KIND_COLOUR = {
    "pointwise": "#f3f9ff",
    "row": "#f7f0fb",
    "matmul": "#fff5eb",
    "splitk": "#fff5eb",
    "library": "#eeeeee",
}


def plan_to_dot(plan: Plan, hide_constants: bool = True, title: str | None = None) -> str:
    """Graphviz DOT source of ``plan``: kernels as clusters (``cluster_k0``...) labelled with their kind."""
    graph = plan.graph
    owner: dict[Node, str] = {}
    for k in plan.kernels:
        for n in (*k.computes, *k.writes):
            owner.setdefault(n, k.name)
    written = set(plan.buffers)
    hidden = {n for n in graph.nodes if hide_constants and n.op is Op.CONST}
    lines = [
        "digraph plan {",
        "  rankdir=TB; compound=true;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [color="#555555", arrowsize=0.6];',
    ]
    if title:
        lines.append(f'  labelloc=t; label="{escape(title)}";')

    def box(n: Node, indent: str) -> str:
        i = graph.index(n)
        style = "rounded,filled"
        extra = ""
        if n in written or n in graph.outputs:
            extra = ", penwidth=2.5"
        elif n not in owner and n.op is not Op.INPUT and n.op is not Op.CONST and category(n) != "layout":
            style = "rounded,filled,dashed"
        return (
            f'{indent}n{i} [label="{node_label(graph, n)}", fillcolor="{CATEGORIES[category(n)][0]}", '
            f'style="{style}"{extra}];'
        )

    for k in plan.kernels:
        members = [n for n in graph.nodes if owner.get(n) == k.name]
        lines.append(f"  subgraph cluster_{k.name} {{")
        lines.append(
            f'    label="{k.name}: {k.kind}"; style="rounded,filled"; '
            f'fillcolor="{KIND_COLOUR[str(k.kind)]}"; fontname="Helvetica";'
        )
        lines += [box(n, "    ") for n in members]
        lines.append("  }")
    for n in graph.nodes:
        if n not in owner and n not in hidden:
            lines.append(box(n, "  "))
    for n in graph.nodes:
        if n in hidden:
            continue
        for s in dict.fromkeys(n.src):
            if s not in hidden:
                lines.append(f"  n{graph.index(s)} -> n{graph.index(n)};")
    return "\n".join(lines + closing_lines(graph))


def plan_to_svg(path: str | Path, plan: Plan, hide_constants: bool = True, title: str | None = None) -> Path:
    """Render ``plan`` to an SVG file at ``path`` with Graphviz ``dot``; return the path.

    Raises:
        RuntimeError: ``dot`` is not installed, or it failed (its error output is included).
    """
    return write_svg(
        path,
        plan_to_dot(plan, hide_constants, title),
        "plan_to_svg",
        "kernelize.autokernel.plan_to_dot(plan)",
    )


__all__ = ["plan_to_dot", "plan_to_svg"]
