"""Graphviz pictures of graphs."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernelize import ir
from kernelize.ir import Graph
from kernelize.ir.dot import CATEGORIES, category


def small_graph() -> Graph:
    g = Graph()
    x = g.input("x", ("batch", 8), "f32")
    w = g.const(torch.randn(8, 4))
    h = g.matmul(x, w)
    y = g.softmax(g.add(h, g.const(torch.randn(4))))
    g.output(y, h)
    return g


def test_one_box_per_value_with_op_shape_dtype_and_colour():
    g = small_graph()
    dot = ir.to_dot(g)
    assert dot.startswith("digraph kernelize {") and dot.rstrip().endswith("}")
    for n in g.nodes:
        i = g.index(n)
        line = next(ln for ln in dot.splitlines() if ln.strip().startswith(f"n{i} ["))
        assert f"%{i} " in line and n.dtype in line
        assert f'fillcolor="{CATEGORIES[category(n)][0]}"' in line
    assert (
        "f32[batch, 4]" in dot and "%0 x" in dot and "softmax" in dot and "{1}" not in dot.split("softmax")[0]
    )
    assert dot.count("penwidth") == 2  # both outputs are marked
    assert '"output 0"' in dot and '"output 1"' in dot


def test_categories_cover_every_op():
    g = small_graph()
    cats = {category(n) for n in g.nodes}
    assert {"source", "heavy", "elementwise", "reduce", "layout"} <= cats


def test_hide_constants_drops_constants_and_their_layout():
    g = small_graph()
    full, hidden = ir.to_dot(g), ir.to_dot(g, hide_constants=True)
    assert "const" in full and "const" not in hidden.replace("+1 const", "")
    assert "(+1 const)" in hidden  # the matmul and the add each note their constant operand
    assert hidden.count("->") < full.count("->")


def test_labels_escape_quotes():
    g = Graph()
    x = g.input('we"ird', (2,), "f32")
    g.output(x)
    assert 'we\\"ird' in ir.to_dot(g)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
def test_graph_to_svg_writes_svg(tmp_path):
    out = ir.graph_to_svg(tmp_path / "sub" / "g.svg", small_graph(), title="small")
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and "softmax" in text


def test_missing_dot_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no dot on PATH
    with pytest.raises(RuntimeError, match="needs Graphviz `dot`.*install graphviz"):
        ir.graph_to_svg(tmp_path / "g.svg", small_graph())
