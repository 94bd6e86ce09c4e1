"""The row-statistics table: every formula reads only names its accumulation and position provide."""

from __future__ import annotations

import re

import pytest

from kernelize.ir.ops import REDUCE, ROW, NormArgs, Op
from kernelize.ir.stats import ACC_FIELDS, STATS, Acc, StatSpec, elem_formula, elem_operands, spell

FUNCS = {"exp", "log", "rsqrt"}


def _specs():
    for op, spec in STATS.items():
        yield op, "default", spec
        for backend, variant in spec.variants.items():
            yield op, backend, variant


def _names(formula: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", formula))


def test_every_reduction_and_row_op_has_statistics() -> None:
    assert set(STATS) == REDUCE | ROW
    assert all(STATS[op].elem is None for op in REDUCE)
    assert all(STATS[op].elem is not None for op in ROW)


@pytest.mark.parametrize(("op", "backend", "spec"), list(_specs()))
def test_formulas_read_only_what_is_there(op: Op, backend: str, spec: StatSpec) -> None:
    fields = {f for fs in ACC_FIELDS[spec.acc] for f in fs}
    seen: set[str] = set()
    for name, formula in spec.finish:
        assert _names(formula) <= fields | seen | FUNCS | {"n", "eps"}, (op, backend, name)
        seen.add(name)
    if spec.elem is not None:
        assert _names(spec.elem) <= seen | FUNCS | {"x"}, (op, backend)
    assert sum(len(f) for f in spec.finish_by_pass()) == len(spec.finish)
    assert spec.variants == {} or backend == "default", "a variant has no variants of its own"
    assert (backend == "default") == (spec.why == ""), "a variant says why; the default needs no reason"


def test_finish_values_follow_the_pass_that_yields_their_fields() -> None:
    spec = StatSpec(Acc.CENTRED, (("mean", "mean"), ("r", "rsqrt(m2 / count + eps)")), "((x - mean) * r)")
    assert spec.passes == 2
    assert spec.finish_by_pass() == [[("mean", "mean")], [("r", "rsqrt(m2 / count + eps)")]]


def test_spell_replaces_every_name_and_rejects_an_unspelled_one() -> None:
    assert spell("(exp(x - m) / s)", {"exp": "tl.exp", "x": "v0", "m": "v3_m", "s": "v3_s"}) == (
        "(tl.exp(v0 - v3_m) / v3_s)"
    )
    with pytest.raises(AssertionError, match="no spelling of 's'"):
        spell("(exp(x - m) / s)", {"exp": "tl.exp", "x": "v0", "m": "v3_m"})


def test_norm_weight_and_bias_follow_the_element_formula() -> None:
    spec = STATS[Op.LAYERNORM]
    args = NormArgs(1e-5, True, True)
    assert elem_formula(Op.LAYERNORM, spec, args) == "((((x - mean) * r) * w) + b)"
    assert elem_operands((4, 5, 6), args) == {"x": 4, "w": 5, "b": 6}
    assert elem_operands((4, 6), NormArgs(1e-5, False, True)) == {"x": 4, "b": 6}
    assert elem_formula(Op.SOFTMAX, STATS[Op.SOFTMAX], -1) == "(exp(x - m) / s)"
