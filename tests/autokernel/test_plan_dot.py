"""Plan pictures: kernels as Graphviz clusters."""

from __future__ import annotations

import shutil

import pytest

from kernelize.autokernel import plan, plan_to_dot, plan_to_svg
from kernelize.ir import Graph


def _plan():
    g = Graph()
    x, w = g.input("x", ("t", 16), "f32"), g.input("w", (16, 8), "f32")
    g.output(g.softmax(g.max(g.matmul(x, w), 0.0)))
    return plan(g)


def test_dot_has_one_cluster_per_kernel():
    p = _plan()
    text = plan_to_dot(p, title="mlp")
    assert text.count("subgraph cluster_") == len(p.kernels) == 2
    assert 'label="k0: matmul"' in text and 'label="k1: row"' in text and "penwidth=2.5" in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
def test_svg_is_written(tmp_path):
    out = plan_to_svg(tmp_path / "p.svg", _plan())
    assert out.read_text().lstrip().startswith(("<?xml", "<svg")) and "k0: matmul" in out.read_text()


def test_missing_dot_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="Graphviz"):
        plan_to_svg(tmp_path / "p.svg", _plan())
