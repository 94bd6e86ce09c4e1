"""Row statistics: what each reduction and row op needs from its row, written once for every backend.

A reduction (sum, max, argmax...) or row op (softmax, layernorm...) first accumulates statistics of its row
(:class:`Acc`: how a running state starts, takes one element, merges with another state), then computes
per-row values from them (``finish``), and a row op finally computes each element from those (``elem``).
Formulas are small expressions over neutral names; a backend supplies the spelling of each name (its
accumulator fields, functions, value names) through :func:`spell` and so contributes syntax only.

Names a formula may use: the accumulator fields of :data:`ACC_FIELDS`, ``n`` (the row length), ``eps``,
the functions ``exp``, ``log`` and ``rsqrt``; ``elem`` also reads ``x`` (the element), the ``finish``
names, and ``w`` / ``b`` (a norm's weight and bias, added by :func:`elem_formula`).

Where a backend deliberately computes a statistic another way, :attr:`StatSpec.variants` names its scheme
and says why; :meth:`StatSpec.on` gives the spec a backend follows.

Example:
    >>> spec = STATS[Op.RMSNORM]
    >>> spell(spec.finish[0][1], {"rsqrt": "tl.rsqrt", "sumsq": "tl.sum(acc)", "n": "N", "eps": "1e-6"})
    'tl.rsqrt(tl.sum(acc) / N + 1e-6)'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kernelize.ir.ops import REDUCE, ROW, NormArgs, Op


class Acc(StrEnum):
    """How statistics accumulate over a row (init / update / combine of a running state)."""

    SUM = "sum"  # 0, s + x, a + b; in the widened type (f32 for 16-bit floats, int64 for integers)
    PROD = "prod"  # 1, p * x, a * b; widened as SUM
    MAX = "max"  # max with NaN propagation; no identity (an empty row has no max)
    MIN = "min"
    ARGMAX = "argmax"  # first index of the max (a NaN counts as the max)
    ARGMIN = "argmin"
    SUMSQ = "sumsq"  # 0, s + x * x, a + b; in f32 at least
    ONLINE_SOFTMAX = "online_softmax"  # (max m, sum of exp(x - m)); a merge rescales both sums to the new max
    WELFORD = "welford"  # (count, mean, m2) updated per element, merged with Chan's formula
    # variants: the same fields, reached in more passes or another order
    CENTRED = "centred"  # pass 1: the mean; pass 2: the sum of squared deviations from it
    MAX_THEN_SUMEXP = "max_then_sumexp"  # pass 1: the max; pass 2: the sum of exp(x - max)
    MOMENTS = "moments"  # one pass: sum and sum of squares in f64 (var = E[x^2] - mean^2)


# accumulations with no identity: an empty row has no value (the reference executor raises, as torch)
NO_IDENTITY = frozenset({Acc.MAX, Acc.MIN, Acc.ARGMAX, Acc.ARGMIN})

# the fields each pass of an accumulation yields, in pass order
ACC_FIELDS: dict[Acc, tuple[tuple[str, ...], ...]] = {
    Acc.SUM: (("sum",),),
    Acc.PROD: (("prod",),),
    Acc.MAX: (("max",),),
    Acc.MIN: (("min",),),
    Acc.ARGMAX: (("index",),),
    Acc.ARGMIN: (("index",),),
    Acc.SUMSQ: (("sumsq",),),
    Acc.ONLINE_SOFTMAX: (("max", "sumexp"),),
    Acc.WELFORD: (("mean", "m2", "count"),),
    Acc.CENTRED: (("mean", "count"), ("m2",)),
    Acc.MAX_THEN_SUMEXP: (("max",), ("sumexp",)),
    Acc.MOMENTS: (("sum", "sumsq"),),
}


@dataclass(frozen=True)
class StatSpec:
    """The statistics of one reduction or row op.

    Attributes:
        acc: how the statistics accumulate.
        finish: per-row values ``(name, formula)`` in order; a reduction's only value is named ``v``.
        elem: a row op's element formula over ``x`` and the finish names (``None`` for reductions).
        variants: backend name -> the spec that backend follows instead, with ``why`` saying the reason.
        why: for a variant, why the backend computes it this way.
    """

    acc: Acc
    finish: tuple[tuple[str, str], ...]
    elem: str | None = None
    variants: Mapping[str, StatSpec] = field(default_factory=dict)
    why: str = ""

    def on(self, backend: str) -> StatSpec:
        """The spec ``backend`` follows: its variant if it has one, else this one."""
        return self.variants.get(backend, self)

    @property
    def passes(self) -> int:
        """Passes over the row the accumulation takes."""
        return len(ACC_FIELDS[self.acc])

    def finish_by_pass(self) -> list[list[tuple[str, str]]]:
        """The finish values to compute after each pass: in order, each as soon as what it reads exists."""
        have: set[str] = set()
        out: list[list[tuple[str, str]]] = []
        todo = list(self.finish)
        for fields in ACC_FIELDS[self.acc]:
            have |= set(fields)
            out.append([])
            while todo and set(_names(todo[0][1])) - _FREE <= have:
                out[-1].append(todo.pop(0))
                have.add(out[-1][-1][0])
        assert not todo, f"finish values {todo} read fields {self.acc} does not yield"
        return out


_FREE = frozenset({"n", "eps", "exp", "log", "rsqrt"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def _names(formula: str) -> list[str]:
    return _NAME.findall(formula)


def spell(formula: str, names: Mapping[str, str]) -> str:
    """``formula`` with every name replaced by a backend's spelling of it (every name must be spelled)."""

    def one(m: re.Match[str]) -> str:
        assert m.group() in names, f"no spelling of {m.group()!r} in {formula!r}"
        return names[m.group()]

    return _NAME.sub(one, formula)


def elem_formula(op: Op, spec: StatSpec, arg: object) -> str:
    """The element formula of row op ``op``; a norm's weight multiplies and its bias adds after it."""
    assert spec.elem is not None, f"{op} is a reduction, not a row op"
    expr = spec.elem
    if isinstance(arg, NormArgs):
        expr = f"({expr} * w)" if arg.has_weight else expr
        expr = f"({expr} + b)" if arg.has_bias else expr
    return expr


def elem_operands(src: tuple[int, ...], arg: object) -> dict[str, int]:
    """Which operand of a row op (indices ``src``) each element-formula name reads."""
    names = {"x": src[0]}
    if isinstance(arg, NormArgs) and arg.has_weight:
        names["w"] = src[1]
    if isinstance(arg, NormArgs) and arg.has_bias:
        names["b"] = src[1 + arg.has_weight]
    return names


def spell_elem(
    e_op: Op,
    spec: StatSpec,
    src: tuple[int, ...],
    arg: object,
    funcs: Mapping[str, str],
    stat: Callable[[str], str],
    value: Callable[[int], str],
) -> str:
    """Row op ``e_op``'s element formula in a backend's names: ``funcs`` spells the functions,
    ``stat(name)`` a finish value, ``value(i)`` body entry ``i`` (its operands ``src``)."""
    names = {**funcs, **{n: stat(n) for n, _ in spec.finish}}
    names |= {n: value(j) for n, j in elem_operands(src, arg).items()}
    return spell(elem_formula(e_op, spec, arg), names)


def _reduce(acc: Acc, value: str) -> StatSpec:
    return StatSpec(acc, (("v", value),))


_CPU_SOFTMAX_WHY = (
    "OpenMP simd reductions combine one variable each: a vectorised max pass, then a sum of exp(x - max) "
    "(an argument <= 0, so the cheaper kz_exp_neg); softmax keeps those exponentials in a per-thread "
    "scratch row (in cache) and the write pass scales them by 1 / sum instead of computing exp again, which "
    "is what bounds softmax on the CPU"
)
_LOG_SOFTMAX_FINISH = (("m", "max"), ("l", "log(sumexp)"))
_LN_FINISH = (("mean", "mean"), ("r", "rsqrt(m2 / count + eps)"))

STATS: dict[Op, StatSpec] = {
    Op.SUM: _reduce(Acc.SUM, "sum"),
    Op.MEAN: _reduce(Acc.SUM, "sum / n"),
    Op.PROD: _reduce(Acc.PROD, "prod"),
    Op.REDUCE_MAX: _reduce(Acc.MAX, "max"),
    Op.REDUCE_MIN: _reduce(Acc.MIN, "min"),
    Op.ARGMAX: _reduce(Acc.ARGMAX, "index"),
    Op.ARGMIN: _reduce(Acc.ARGMIN, "index"),
    Op.SOFTMAX: StatSpec(
        Acc.ONLINE_SOFTMAX,
        (("m", "max"), ("s", "sumexp")),
        "(exp(x - m) / s)",
        {
            "cpu": StatSpec(
                Acc.MAX_THEN_SUMEXP,
                (("m", "max"), ("r", "1 / sumexp")),
                "(exp(x - m) * r)",
                why=_CPU_SOFTMAX_WHY,
            )
        },
    ),
    Op.LOG_SOFTMAX: StatSpec(
        Acc.ONLINE_SOFTMAX,
        _LOG_SOFTMAX_FINISH,
        "((x - m) - l)",
        {"cpu": StatSpec(Acc.MAX_THEN_SUMEXP, _LOG_SOFTMAX_FINISH, "((x - m) - l)", why=_CPU_SOFTMAX_WHY)},
    ),
    Op.LAYERNORM: StatSpec(
        Acc.WELFORD,
        _LN_FINISH,
        "((x - mean) * r)",
        {
            "triton": StatSpec(
                Acc.CENTRED,
                _LN_FINISH,
                "((x - mean) * r)",
                why="lane-wise accumulators that tl.sum reduces (a mean pass, then a centred pass) need no "
                "custom combine; a Welford state per lane would need a tl.reduce with Chan's merge",
            ),
            "cpu": StatSpec(
                Acc.MOMENTS,
                (("mean", "sum / n"), ("r", "rsqrt(sumsq / n - mean * mean + eps)")),
                "((x - mean) * r)",
                why="f32 rows: sum and sum of squares in one OpenMP simd reduction, in double (f32 "
                "accuracy unless |mean| / std exceeds ~1e6), read the row twice instead of three times; f64 "
                "rows, with no wider type to sum in, take the centred two passes",
            ),
        },
    ),
    Op.RMSNORM: StatSpec(Acc.SUMSQ, (("r", "rsqrt(sumsq / n + eps)"),), "(x * r)"),
}
assert set(STATS) == REDUCE | ROW, f"row statistics missing for {(REDUCE | ROW) - set(STATS)}"

__all__ = [
    "ACC_FIELDS",
    "NO_IDENTITY",
    "STATS",
    "Acc",
    "StatSpec",
    "elem_formula",
    "elem_operands",
    "spell",
    "spell_elem",
]
