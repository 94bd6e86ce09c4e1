"""Float floor division and remainder keep torch's exact semantics (fmod-based), on every backend.

`floor(a / b)` differs from torch where the quotient rounds (5 % 0.1), is infinite (inf // 2 is nan in
torch) or the divisor is infinite (1 // -inf is -1); these cases are the regression guard.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kernelize.ir.reference import evaluate
from kernelize.ir.torch_frontend import trace
from kernelize.runtime.compiled import compile_graph

VALUES = [math.inf, -math.inf, math.nan, 5.0, 1.0, 0.0, -0.0, -7.0, 7.0, 1e10, 3.0, -3.0, 0.1, 2.5, -2.5]
PAIRS = list(itertools.product(VALUES, VALUES))
FUNCS = {
    "floor_divide": torch.floor_divide,
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "remainder": torch.remainder,
    "operator_mod": lambda a, b: a % b,
}


def _same(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Bitwise-equal up to the sign of NaN: value, NaN-ness and the sign of zeros."""
    return torch.equal(want.nan_to_num(9.5), got.nan_to_num(9.5)) and torch.equal(
        want.signbit() | want.isnan(), got.signbit() | got.isnan()
    )


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("name", sorted(FUNCS))
def test_float_floor_division_matches_torch(name: str, backend: str) -> None:
    fn = FUNCS[name]
    a = torch.tensor([p[0] for p in PAIRS])
    b = torch.tensor([p[1] for p in PAIRS])
    graph = trace(fn, a, b)
    if backend == "reference":
        got = evaluate(graph, [a, b])[0]
    else:
        got = compile_graph(graph, backend=backend)(a, b)[0]
    want = fn(a, b)
    bad = [(PAIRS[i], want[i].item(), got[i].item()) for i in range(len(PAIRS)) if not _same(want[i], got[i])]
    assert not bad, f"{name} on {backend}: (a, b), torch, ours: {bad[:6]}"


@pytest.mark.parametrize("divisor", [0.1, -2.5, 0.0, math.inf, 1e-8])
@pytest.mark.parametrize("name", sorted(FUNCS))
def test_python_scalar_divisor(name: str, divisor: float) -> None:
    """A python-number divisor (x // 0.1, x % -2.5) traces and matches torch."""
    fn = FUNCS[name]
    a = torch.tensor(VALUES)
    graph = trace(lambda x: fn(x, divisor), a)
    got = compile_graph(graph, backend="cpu")(a)[0]
    want = fn(a, divisor)
    assert _same(want, got), f"{name} by {divisor}: torch {want.tolist()}, ours {got.tolist()}"
