"""The planner's reasons to plan again: values, named by kind, printed for logs."""

from __future__ import annotations

import pytest

from kernelize.autokernel.reasons import Rejection
from kernelize.ir import Graph


def test_rejections_are_values_that_print_their_change_and_reason():
    g = Graph()
    x = g.input("x", (4, 6), "f32")
    p = g.permute(x, (1, 0))
    m, d = Rejection.materialize(p, "a split index"), Rejection.dense(x, "a matmul operand")
    assert (m.kind, d.kind) == ("materialize", "dense") and m == Rejection(p, "materialize", "a split index")
    assert str(m) == f"materialize {p}: a split index" and str(d) == f"keep dense {x}: a matmul operand"
    with pytest.raises(AttributeError):
        m.node = x  # frozen
