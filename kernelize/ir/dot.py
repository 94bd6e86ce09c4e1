"""Pictures of graphs: Graphviz DOT text and SVG files.

One box per value showing its index, op, dtype, shape and attributes, filled by category: sources (inputs
and constants), layout, matmul/conv/pool, elementwise, reductions and row ops. Outputs get a bold border.

Example:
    >>> g = trace(torch.nn.LayerNorm(8), torch.randn(2, 8))  # doctest: +SKIP
    >>> graph_to_svg("layernorm.svg", g)  # doctest: +SKIP
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kernelize.ir.graph import ELEMENTWISE, LAYOUT, REDUCE, ROW, SOURCE, Graph, Node, Op
from kernelize.ir.printer import format_arg
from kernelize.ir.shapes import shape_str

# category -> (fill colour, legend label), in legend order
CATEGORIES: dict[str, tuple[str, str]] = {
    "source": ("#e0e0e0", "inputs / constants"),
    "layout": ("#cfe2f3", "layout"),
    "heavy": ("#f6b26b", "matmul / conv / pool"),
    "elementwise": ("#fff2cc", "elementwise"),
    "reduce": ("#d9b8e8", "reductions / row ops"),
    "movement": ("#b6d7a8", "gather / concat / pad"),
}
_HEAVY = frozenset({Op.MATMUL, Op.CONV, Op.POOL})
_MOVEMENT = frozenset({Op.GATHER, Op.CONCAT, Op.PAD})
# longest attribute text shown in a box
MAX_ARG_CHARS = 48


def category(node: Node) -> str:
    """The colour category of ``node``'s op."""
    op = node.op
    if op in SOURCE:
        return "source"
    if op in LAYOUT:
        return "layout"
    if op in _HEAVY:
        return "heavy"
    if op in _MOVEMENT:
        return "movement"
    if op in REDUCE or op in ROW:
        return "reduce"
    assert op in ELEMENTWISE, op
    return "elementwise"


def node_label(graph: Graph, node: Node) -> str:
    i = graph.index(node)
    head = f"%{i} {node.arg}" if node.op is Op.INPUT else f"%{i} {node.op}"
    lines = [head, f"{node.dtype}{shape_str(node.shape)}"]
    if node.arg is not None and node.op is not Op.INPUT:
        arg = format_arg(node.arg) if not isinstance(node.arg, str) else node.arg
        lines.append(arg if len(arg) <= MAX_ARG_CHARS else arg[: MAX_ARG_CHARS - 3] + "...")
    return "\\n".join(escape(s) for s in lines)


def escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _hidden(graph: Graph) -> set[Node]:
    """Constants and layout ops that only re-index constants (what ``hide_constants`` leaves out)."""
    hidden: set[Node] = set()
    for n in graph.nodes:
        if n.op is Op.CONST or (n.op in LAYOUT and n.src[0] in hidden):
            hidden.add(n)
    return hidden - set(graph.outputs)


def to_dot(graph: Graph, hide_constants: bool = False, title: str | None = None) -> str:
    """The graph as Graphviz DOT source (top to bottom, one box per value).

    Args:
        graph: the graph to draw.
        hide_constants: leave out constants (and layout ops over them); a consumer's box then notes how
            many constant operands it has.
        title: optional caption above the graph.

    Example:
        >>> print(to_dot(g))  # doctest: +SKIP
        digraph kernelize { ...
    """
    hidden = _hidden(graph) if hide_constants else set()
    outputs = set(graph.outputs)
    lines = [
        "digraph kernelize {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [color="#555555", arrowsize=0.6];',
    ]
    if title:
        lines.append(f'  labelloc=t; label="{escape(title)}";')
    for n in graph.nodes:
        if n in hidden:
            continue
        i = graph.index(n)
        fill = CATEGORIES[category(n)][0]
        label = node_label(graph, n)
        n_const = sum(s in hidden for s in n.src)
        if n_const:
            label += f"\\n(+{n_const} const)"
        extra = ", penwidth=2.5" if n in outputs else ""
        lines.append(f'  n{i} [label="{label}", fillcolor="{fill}"{extra}];')
    for n in graph.nodes:
        if n in hidden:
            continue
        for k, s in enumerate(n.src):
            if s in hidden:
                continue
            attr = f' [label="{k}", fontsize=8]' if len(n.src) > 1 and n.op not in ELEMENTWISE else ""
            lines.append(f"  n{graph.index(s)} -> n{graph.index(n)}{attr};")
    return "\n".join(lines + closing_lines(graph))


def closing_lines(graph: Graph) -> list[str]:
    """The end of a graph's dot source: a marker per output, an edge to it, the closing brace."""
    lines = []
    for k, o in enumerate(graph.outputs):
        lines.append(f'  out{k} [label="output {k}", shape=plaintext, style=""];')
        lines.append(f"  n{graph.index(o)} -> out{k};")
    return [*lines, "}"]


def graph_to_svg(
    path: str | Path, graph: Graph, hide_constants: bool = False, title: str | None = None
) -> Path:
    """Render ``graph`` to an SVG file at ``path`` with Graphviz ``dot``; return the path.

    Raises:
        RuntimeError: ``dot`` is not installed, or it failed (its error output is included).

    Example:
        >>> graph_to_svg("out/rmsnorm.svg", trace(RMSNorm(64), torch.randn(2, 64)))  # doctest: +SKIP
    """
    return write_svg(path, to_dot(graph, hide_constants, title), "graph_to_svg", "kernelize.ir.to_dot(graph)")


def write_svg(path: str | Path, dot_text: str, caller: str, text_api: str) -> Path:
    """Run Graphviz ``dot`` on ``dot_text`` and write the SVG to ``path`` (folders created); return the path.

    ``caller`` and ``text_api`` name the public function and its text-only twin in the error messages.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(
            f"{caller} needs Graphviz `dot`, which is not on PATH: install graphviz "
            "(apt-get install graphviz, brew install graphviz, conda install graphviz) or "
            f"render the text of {text_api} elsewhere"
        )
    proc = subprocess.run(
        [exe, "-Tsvg"], input=dot_text.encode(), capture_output=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"Graphviz dot failed with exit code {proc.returncode}:\n{proc.stderr.decode(errors='replace')}"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(proc.stdout)
    return path


__all__ = [
    "CATEGORIES",
    "category",
    "closing_lines",
    "escape",
    "graph_to_svg",
    "node_label",
    "to_dot",
    "write_svg",
]
