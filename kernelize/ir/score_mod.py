"""Attention variants as IR subgraphs: a *score modification* maps one attention score to a new one.

A :class:`ScoreMod` is a small scalar graph of four inputs: the score (f32, already multiplied by the
scale), the query's position ``q_pos``, the key's position ``k_pos`` and the query head ``head`` (i64). It
returns the new score; ``-inf`` drops the key (a mask). It is applied after the scale and before the
causal cut and the mask operand, so ``softmax(mod(scale * q @ k^T) + mask) @ v``.

Positions count keys from 0; a query's position is ``i + Lk - Lq`` (the last ``Lq`` positions of the keys,
as with a key/value cache), so a window measured in positions is right for prefill and decode alike.

The same steps render into every backend's attention template through the shared per-op table
(:func:`kernelize.codegen.render.score_mod_lines`), and the reference executor evaluates them with torch
(:meth:`ScoreMod.apply`). A variant is a builder here, not an edit of three templates.

Example:
    >>> mod = chain(softcap(50.0), sliding_window(4))
    >>> mod.name
    'softcap(50.0)+sliding_window(4)'
    >>> s = torch.zeros(1, 1, 6, 6)
    >>> mod.apply(s).isinf().sum().item()  # keys at least 4 positions before their query
    3
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Graph, Node
from kernelize.ir.ops import Op

INPUTS = (("score", DType.F32), ("q_pos", DType.I64), ("k_pos", DType.I64), ("head", DType.I64))


class Step(NamedTuple):
    """One op of a score modification: ``src`` are positions of earlier values (0-3: the inputs)."""

    op: Op
    dtype: DType
    src: tuple[int, ...] = ()
    arg: Any = None  # Op.CONST: the python scalar; other ops: the IR node's arg


@dataclass(frozen=True)
class ScoreMod:
    """A traced score modification: ``steps`` compute values 4, 5, ...; the last one is the new score."""

    name: str
    steps: tuple[Step, ...]

    def __repr__(self) -> str:
        return f"ScoreMod({self.name})"

    @staticmethod
    def trace(name: str, fn: Callable[[Graph, Node, Node, Node, Node], Node]) -> ScoreMod:
        """Build ``fn(graph, score, q_pos, k_pos, head)`` on scalar nodes and keep its steps."""
        g = Graph()
        inputs = [g.input(n, (), dt) for n, dt in INPUTS]
        out = g.cast(fn(g, *inputs), DType.F32)
        index = {n: i for i, n in enumerate(inputs)}
        steps: list[Step] = []
        for node in g.nodes:
            if node in index:
                continue
            if node.op is Op.CONST:
                step = Step(Op.CONST, node.dtype, (), node.arg.tensor.item())
            else:
                step = Step(node.op, node.dtype, tuple(index[s] for s in node.src), node.arg)
            index[node] = len(INPUTS) + len(steps)
            steps.append(step)
        if index[out] != len(INPUTS) + len(steps) - 1:  # the output is an input or an earlier value
            steps.append(Step(Op.ADD, DType.F32, (index[out], _zero(steps))))
        return ScoreMod(name, tuple(steps))

    def apply(self, score: torch.Tensor, head_axis: int = 1) -> torch.Tensor:
        """The reference: the steps with torch on scores ``[..., H, Lq, Lk]`` (heads at ``head_axis``)."""
        from kernelize.ir.reference import EVAL

        lq, lk = score.shape[-2:]
        shape = [1] * score.dim()
        shape[head_axis] = score.shape[head_axis]
        values: list[torch.Tensor] = [
            score.float(),
            torch.arange(lk - lq, lk, device=score.device)[:, None],
            torch.arange(lk, device=score.device)[None, :],
            torch.arange(score.shape[head_axis], device=score.device).view(shape),
        ]
        dtypes = [dt for _, dt in INPUTS]
        for st in self.steps:
            if st.op is Op.CONST:
                values.append(torch.tensor(st.arg, dtype=st.dtype.torch, device=score.device))
            else:  # EVAL reads the operands' dtypes off the node's sources
                src = tuple(Node(Op.INPUT, dtypes[i], ()) for i in st.src)
                values.append(
                    EVAL[st.op](Node(st.op, st.dtype, (), src, st.arg), [values[i] for i in st.src], {})
                )
            dtypes.append(st.dtype)
        return values[-1].to(score.dtype)


def _zero(steps: list[Step]) -> int:
    steps.append(Step(Op.CONST, DType.F32, (), 0.0))
    return len(INPUTS) + len(steps) - 1


def softcap(cap: float) -> ScoreMod:
    """``cap * tanh(score / cap)`` (Gemma 2's attention logit soft-capping)."""
    cap = float(cap)
    if not cap > 0:
        raise ValueError(f"softcap must be positive, got {cap}")
    return ScoreMod.trace(f"softcap({cap})", lambda g, s, i, j, h: g.mul(g.tanh(g.div(s, cap)), cap))


def sliding_window(window: int) -> ScoreMod:
    """Keep key ``j`` for a query at position ``i`` iff ``i - window < j`` (transformers' sliding window)."""
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding window must be >= 1 key, got {window}")
    return ScoreMod.trace(
        f"sliding_window({window})",
        lambda g, s, i, j, h: g.where(g.gt(j, g.sub(i, window)), s, -math.inf),
    )


def alibi(heads: int, max_bias: float = 8.0, slopes: str = "mpt") -> ScoreMod:
    """``score + slope(head) * (k_pos - q_pos)``: ALiBi's linear position bias (BLOOM, MPT, Falcon).

    With ``n`` the largest power of two ``<= heads``, head ``h`` has the slope ``2 ** -(max_bias * (h + 1) /
    n)`` for ``h < n`` and ``2 ** -(max_bias * (2 * (h - n) + 1) / (2 * n))`` for the rest: the interleaved
    slopes of a ``2n``-head model, as BLOOM's ``_get_alibi_slopes`` and MPT's ``build_mpt_alibi_tensor``
    (``alibi_bias_max``) both define them. ``slopes`` picks the family's arithmetic, so the f32 slopes are
    its own bit for bit (up to libm's pow rounding the other way): ``"mpt"`` computes ``1 / 2 ** exponent``,
    ``"bloom"`` (BLOOM, Falcon) raises the f32 base ``2 ** -(max_bias / n)`` to the power ``h + 1`` (the two
    differ by a few ulps when ``max_bias / n`` is no integer). The families add ``slope * k_pos`` (BLOOM:
    counted over the unpadded keys) or ``slope * (k_pos - last key)`` (MPT); those differ from the bias here
    by a constant per query row, which softmax cancels.

    Example:
        >>> alibi(4).apply(torch.zeros(1, 4, 1, 3))[0, :, 0]  # slopes 1/4, 1/16, 1/64, 1/256
        tensor([[-0.5000, -0.2500,  0.0000],
                [-0.1250, -0.0625,  0.0000],
                [-0.0312, -0.0156,  0.0000],
                [-0.0078, -0.0039,  0.0000]])
    """
    heads, max_bias = int(heads), float(max_bias)
    if heads < 1 or not max_bias > 0 or slopes not in ("mpt", "bloom"):
        raise ValueError(
            f"alibi needs >= 1 head, max_bias > 0 and slopes 'mpt' or 'bloom', got {heads}, {max_bias}, "
            f"{slopes!r}"
        )
    n = 1 << (heads.bit_length() - 1)

    def bias(g: Graph, s: Node, i: Node, j: Node, h: Node) -> Node:
        hf = g.cast(h, DType.F32)
        first, rest = g.add(hf, 1.0), g.add(g.mul(hf, 2.0), 1.0 - 2 * n)  # powers of the two bases
        if slopes == "bloom":  # pow(f32 base, power), as torch.pow of the families' base tensors
            base = g.where(
                g.lt(h, n), g.const(2.0 ** (-max_bias / n), DType.F32), 2.0 ** (-max_bias / (2 * n))
            )
            slope = g.pow(base, g.where(g.lt(h, n), first, rest))
        else:
            exponent = g.where(g.lt(h, n), g.mul(first, max_bias / n), g.mul(rest, max_bias / (2 * n)))
            slope = g.reciprocal(g.pow(2.0, exponent))  # as MPT: 1 / 2 ** exponent
        return g.add(s, g.mul(slope, g.cast(g.sub(j, i), DType.F32)))

    name = f"alibi({heads}, {max_bias})" if slopes == "mpt" else f"alibi({heads}, {max_bias}, {slopes})"
    return ScoreMod.trace(name, bias)


def chain(*mods: ScoreMod | None) -> ScoreMod | None:
    """The modifications applied in order (None entries skipped; None when none is left)."""
    mods = tuple(m for m in mods if m is not None)
    if len(mods) <= 1:
        return mods[0] if mods else None
    steps = list(mods[0].steps)
    for mod in mods[1:]:
        score = len(INPUTS) + len(steps) - 1  # the previous result is this one's score input
        base = len(INPUTS) + len(steps) - len(INPUTS)  # this one's own values follow
        remap = {0: score, **{i: i for i in range(1, len(INPUTS))}}
        steps += [st._replace(src=tuple(remap.get(i, base + i) for i in st.src)) for st in mod.steps]
    return ScoreMod("+".join(m.name for m in mods), tuple(steps))


__all__ = ["INPUTS", "ScoreMod", "Step", "alibi", "chain", "sliding_window", "softcap"]
