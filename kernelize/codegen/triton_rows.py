"""Row kernels for the Triton generator: reductions and row ops (softmax, norms) with one row per program.

Two forms, chosen from the row size:

* **one block** (static rows up to :data:`MAX_FUSED` elements): the row is loaded once into registers;
  reductions are ``tl.sum`` / ``tl.max`` over masked lanes; softmax is max, exp, sum, divide.
* **loop** (longer or symbolic rows): each statistic gets one pass over the row in ``BLOCK`` steps,
  accumulating per lane in f32 and reducing the lanes at the end (two-level sums); softmax keeps an online
  (max, sum) pair per lane; layernorm takes a mean pass then a centred variance pass. A last pass computes
  and stores the full-row values. Loads are recomputed in each pass instead of staged. What each op
  accumulates, its per-row values and element formula come from :data:`kernelize.ir.stats.STATS`; this
  form spells each accumulation as lane-wise passes (:data:`_LOOP`).

Example (rmsnorm over a symbolic row, loop form, abridged)::

    acc3 = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, s_hidden, BLOCK):
        ...
        v0 = tl.load(x_ptr + row * s_hidden + j0, mask=mask, other=0.0)
        acc3 += tl.where(mask, v0 * v0, 0.0)
    v3_r = tl.rsqrt(tl.sum(acc3, axis=0) / s_hidden + 1e-06)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernelize.autokernel.kernels import Compute, Kernel, Load, row_invariant
from kernelize.codegen.render import closure
from kernelize.ir.dtypes import DType, compute_dtype
from kernelize.ir.graph import REDUCE, ROW, Op
from kernelize.ir.ops import NormArgs
from kernelize.ir.shapes import Sym, numel
from kernelize.ir.stats import STATS, Acc, StatSpec, spell, spell_elem

if TYPE_CHECKING:
    from kernelize.codegen.triton import KernelSource

# the largest row kept in registers (Liger's MAX_FUSED_SIZE); longer rows loop
MAX_FUSED = 65536
# block of the loop form
LOOP_BLOCK = 4096

_IINFO = {
    DType.I8: (-(2**7), 2**7 - 1),
    DType.I16: (-(2**15), 2**15 - 1),
    DType.I32: (-(2**31), 2**31 - 1),
    DType.I64: (-(2**63), 2**63 - 1),
    DType.U8: (0, 255),
    DType.BOOL: (0, 1),
}


def looped(kernel: Kernel) -> bool:
    """Whether the row kernel takes the loop form (symbolic or longer than :data:`MAX_FUSED`)."""
    size = numel(kernel.domain[len(kernel.domain) - kernel.row_rank :])
    return isinstance(size, Sym) or size > MAX_FUSED


def row_block(kernel: Kernel, size: int) -> int:
    """``BLOCK`` for a launch over rows of ``size`` elements."""
    from kernelize.codegen.triton_base import next_power_of_2

    if looped(kernel):
        return min(LOOP_BLOCK, max(16, next_power_of_2(size)))
    return max(1, next_power_of_2(size))


@dataclass(frozen=True)
class _LoopPass:
    """One pass of an accumulation in the loop form: a per-lane state (``init``, ``step`` per block of the
    row), then lines reducing the lanes (``pre``) and each field's expression (:data:`ACC_FIELDS`).

    Holes: ``{acc}`` state, ``{v}`` value name, ``{x}`` element, ``{t}`` / ``{z}`` / ``{one}`` / ``{lo}`` /
    ``{hi}`` the element's type, zero, one, lowest and highest value, ``{R}`` row length, ``{mean}`` the
    finished mean (a centred pass reads it)."""

    init: tuple[str, ...]
    step: tuple[str, ...]
    fields: dict[str, str]
    pre: tuple[str, ...] = ()


def _arg(better: str, pick: str, lit: str) -> tuple[_LoopPass]:
    """argmax / argmin: best value and first index per lane, then the first lane index of the best."""
    return (
        _LoopPass(
            (
                f"{{acc}}_v = tl.full([BLOCK], {lit}, dtype={{t}})",
                "{acc}_i = tl.zeros([BLOCK], dtype=tl.int64)",
            ),
            (
                f"xm = tl.where(mask, {{x}}, {lit})",
                f"upd = xm {better} {{acc}}_v",
                "{acc}_i = tl.where(upd, cols.to(tl.int64), {acc}_i)",
                "{acc}_v = tl.where(upd, xm, {acc}_v)",
            ),
            {"index": f"tl.min(tl.where({{acc}}_v == {{v}}_best, {{acc}}_i, {2**62}), axis=0)"},
            (f"{{v}}_best = tl.{pick}({{acc}}_v, axis=0)",),
        ),
    )


_F32_ZEROS = "{acc} = tl.zeros([BLOCK], dtype=tl.float32)"
_LANE_SUM = "tl.sum({acc}, axis=0)"
# each accumulation of kernelize.ir.stats, spelled as lane-wise passes
_LOOP: dict[Acc, tuple[_LoopPass, ...]] = {
    Acc.SUM: (
        _LoopPass(
            ("{acc} = tl.zeros([BLOCK], dtype={t})",),
            ("{acc} += tl.where(mask, {x}, {z})",),
            {"sum": _LANE_SUM},
        ),
    ),
    Acc.PROD: (
        _LoopPass(
            ("{acc} = tl.full([BLOCK], 1, dtype={t})",),
            ("{acc} *= tl.where(mask, {x}, {one})",),
            {"prod": "tl.reduce({acc}, 0, kz_mul)"},
        ),
    ),
    Acc.MAX: (
        _LoopPass(
            ("{acc} = tl.full([BLOCK], {lo}, dtype={t})",),
            ("{acc} = tl.maximum({acc}, tl.where(mask, {x}, {lo}))",),
            {"max": "tl.max({acc}, axis=0)"},
        ),
    ),
    Acc.MIN: (
        _LoopPass(
            ("{acc} = tl.full([BLOCK], {hi}, dtype={t})",),
            ("{acc} = tl.minimum({acc}, tl.where(mask, {x}, {hi}))",),
            {"min": "tl.min({acc}, axis=0)"},
        ),
    ),
    Acc.ARGMAX: _arg(">", "max", "{lo}"),
    Acc.ARGMIN: _arg("<", "min", "{hi}"),
    Acc.SUMSQ: (
        _LoopPass((_F32_ZEROS,), ("{acc} += tl.where(mask, {x} * {x}, 0.0)",), {"sumsq": _LANE_SUM}),
    ),
    # per lane a running max and a sum of exponentials rescaled to it; then both over the lanes
    Acc.ONLINE_SOFTMAX: (
        _LoopPass(
            (
                '{acc}_m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)',
                "{acc}_s = tl.zeros([BLOCK], dtype=tl.float32)",
            ),
            (
                'xm = tl.where(mask, {x}, float("-inf"))',
                "new_m = tl.maximum({acc}_m, xm)",
                'safe = tl.where(new_m == float("-inf"), 0.0, new_m)',
                "{acc}_s = {acc}_s * tl.exp({acc}_m - safe) + tl.exp(xm - safe)",
                "{acc}_m = new_m",
            ),
            {"max": "{acc}_max", "sumexp": "tl.sum({acc}_s * tl.exp({acc}_m - {acc}_max), axis=0)"},
            ("{acc}_max = tl.max({acc}_m, axis=0)",),
        ),
    ),
    Acc.CENTRED: (
        _LoopPass(
            (_F32_ZEROS,),
            ("{acc} += tl.where(mask, {x}, 0.0)",),
            {"mean": _LANE_SUM + " / {R}", "count": "{R}"},
        ),
        _LoopPass(
            (_F32_ZEROS,), ("d = tl.where(mask, {x} - {mean}, 0.0)", "{acc} += d * d"), {"m2": _LANE_SUM}
        ),
    ),
}
# the one-block form: each one-pass accumulation as a reduction of the row held in registers (same holes)
_BLOCK: dict[Acc, dict[str, str]] = {
    Acc.SUM: {"sum": "tl.sum(tl.where(mask, {x}, {z}), axis=0)"},
    Acc.PROD: {"prod": "tl.reduce(tl.where(mask, {x}, {one}), 0, kz_mul)"},
    Acc.MAX: {"max": "tl.max(tl.where(mask, {x}, {lo}), axis=0)"},
    Acc.MIN: {"min": "tl.min(tl.where(mask, {x}, {hi}), axis=0)"},
    Acc.ARGMAX: {"index": "tl.argmax(tl.where(mask, {x}, {lo}), axis=0).to(tl.int64)"},
    Acc.ARGMIN: {"index": "tl.argmin(tl.where(mask, {x}, {hi}), axis=0).to(tl.int64)"},
    Acc.SUMSQ: {"sumsq": "tl.sum(tl.where(mask, {x} * {x}, 0.0), axis=0)"},
}
_FUNCS = {"exp": "tl.exp", "log": "tl.log", "rsqrt": "tl.rsqrt"}


def _lowest(r, dtype: DType) -> str:
    dtype = compute_dtype(dtype)
    return 'float("-inf")' if dtype.is_float else str(_IINFO[dtype][0])


def _highest(r, dtype: DType) -> str:
    dtype = compute_dtype(dtype)
    return 'float("inf")' if dtype.is_float else str(_IINFO[dtype][1])


class RowRenderer:
    def __init__(self, src: KernelSource) -> None:
        from kernelize.codegen.triton_base import IndexCtx, index_lines

        self.s, self.k, self.r = src, src.k, src.r
        k = self.k
        n_outer = len(k.domain) - k.row_rank
        self.outer, self.rowdims = k.domain[:n_outer], k.domain[n_outer:]
        self.R = self.r.dim(numel(self.rowdims))
        self.outer_lines, onames = index_lines(self.outer, "row", "i", self.r)
        self.row_lines, rnames = index_lines(self.rowdims, "cols", "j", self.r, keep_ones=True)
        self.ctx = IndexCtx([*onames, *rnames], [False] * n_outer + [True] * k.row_rank, "[BLOCK]")
        self.inv = row_invariant(k)
        for i, v in enumerate(self.inv):
            src.vec[i] = not v

    def render(self) -> str:
        if looped(self.k):
            return self.s.header("triton_row_loop.py.tmpl", self.outer_lines, self._loop_body())
        body = self.row_lines + self._block_body()
        return self.s.header("triton_row.py.tmpl", self.outer_lines, body, ROWSIZE=self.R)

    # -- one block ----------------------------------------------------------------------------------------
    def _block_body(self) -> list[str]:
        lines: list[str] = []
        for i, e in enumerate(self.k.body):
            if isinstance(e, Load):
                lines.append(self.s.load(i, e, self.ctx, "mask"))
            elif e.op in REDUCE | ROW and STATS[e.op].on("triton").acc in _BLOCK:
                lines += self._stat_block(i, e)
            elif e.op in ROW:
                lines += self._row_op_block(i, e)
            elif e.op is Op.MATMUL:
                raise NotImplementedError(f"{self.k.name}: matmul inside a row kernel")
            else:
                lines.append(self.s.compute(i, e, self.ctx))
            self.s.vec[i] = not self.inv[i]
        lines += [self.s.store(st, self.ctx, "mask") for st in self.k.stores]
        return lines

    def _full(self, i: int) -> str:
        return f"v{i}" if not self.inv[i] else f"tl.broadcast_to(v{i}, [BLOCK])"

    def _stat_block(self, i: int, e: Compute) -> list[str]:
        """Statistic ``i`` of a row held in registers: its fields, per-row values and element formula."""
        spec = STATS[e.op].on("triton")
        holes, names = self._holes(i, e)
        names |= {f: v.format(**holes) for f, v in _BLOCK[spec.acc].items()}
        lines = self._finish(i, spec, spec.finish, names)
        if spec.elem is not None:
            lines.append(f"    v{i} = {self._row_op_value(i, e, self._full)}")
        return lines

    def _row_op_block(self, i: int, e: Compute) -> list[str]:
        x = self._full(e.src[0])
        v, R = f"v{i}", self.R
        if e.op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
            lines = [
                f'    {v}_m = tl.max(tl.where(mask, {x}, float("-inf")), axis=0)',
                f"    {v}_e = tl.where(mask, tl.exp({x} - {v}_m), 0.0)",
                f"    {v}_s = tl.sum({v}_e, axis=0)",
            ]
            if e.op is Op.SOFTMAX:
                return [*lines, f"    {v} = {v}_e / {v}_s"]
            return [*lines, f"    {v} = {x} - {v}_m - tl.log({v}_s)"]
        a: NormArgs = e.arg
        return [
            f"    {v}_mean = tl.sum(tl.where(mask, {x}, 0.0), axis=0) / {R}",
            f"    {v}_d = tl.where(mask, {x} - {v}_mean, 0.0)",
            f"    {v}_r = tl.rsqrt(tl.sum({v}_d * {v}_d, axis=0) / {R} + {a.eps!r})",
            f"    {v} = {v}_d * {v}_r" + self._affine(e),
        ]

    def _affine(self, e: Compute) -> str:
        """`` * weight + bias`` of a norm, each part present only if the node has it."""
        a: NormArgs = e.arg
        out = f" * v{e.src[1]}" if a.has_weight else ""
        return out + (f" + v{e.src[1 + a.has_weight]}" if a.has_bias else "")

    def _dtype(self, i: int) -> DType:
        return self.k.body[i].dtype

    # -- loop ---------------------------------------------------------------------------------------------
    def _loop_body(self) -> list[str]:
        k, lines = self.k, []
        done: set[int] = set()
        stats = [i for i, e in enumerate(k.body) if isinstance(e, Compute) and e.op in REDUCE | ROW]
        for s in stats:
            lines += self._scalars(range(s), done)
            e = k.body[s]
            lines += self._stat(s, e)
            done.add(s)
        lines += self._scalars(range(len(k.body)), done)
        full_stores = [st for st in k.stores if self.s.vec[st.value]]
        if full_stores:
            need = closure(self.k, [st.value for st in full_stores], self.inv)
            lines += self._loop_head()
            lines += self._loop_entries(need)
            lines += [self.s.store(st, self.ctx, "mask", indent="        ") for st in full_stores]
        lines += [self.s.store(st, self.ctx, "mask") for st in k.stores if not self.s.vec[st.value]]
        return lines

    def _scalars(self, entries, done: set[int]) -> list[str]:
        """Emit per-row entries (not statistics) at the top level, once."""
        lines = []
        for i in entries:
            e = self.k.body[i]
            if i in done or not self.inv[i] or (isinstance(e, Compute) and (e.op in REDUCE or e.op in ROW)):
                continue
            if isinstance(e, Load):
                lines.append(self.s.load(i, e, self.ctx, "mask"))
            else:
                lines.append(self.s.compute(i, e, self.ctx))
            done.add(i)
        return lines

    def _loop_head(self) -> list[str]:
        head = [
            f"    for start in range(0, {self.R}, BLOCK):",
            "        cols = start + tl.arange(0, BLOCK)",
            "        if IDX64:",
            "            cols = cols.to(tl.int64)",
            f"        mask = cols < {self.R}",
            "        zero = cols * 0",
        ]
        return head + ["    " + line for line in self.row_lines]

    def _loop_entries(self, need: list[int]) -> list[str]:
        lines = []
        for i in need:
            e = self.k.body[i]
            if isinstance(e, Load):
                lines.append(self.s.load(i, e, self.ctx, "mask", indent="        "))
            elif e.op in ROW:
                lines.append(f"        v{i} = {self._row_op_value(i, e)}")
            else:
                lines.append(self.s.compute(i, e, self.ctx, indent="        "))
            self.s.vec[i] = True
        return lines

    def _row_op_value(self, i: int, e: Compute, full: Callable[[int], str] | None = None) -> str:
        """Row op ``i``'s element value; ``full`` spells its element operand (the others are ``v<j>``)."""
        spec = STATS[e.op].on("triton")
        x = e.src[0]

        def value(j: int) -> str:
            return full(j) if full is not None and j == x else f"v{j}"

        return spell_elem(e.op, spec, e.src, e.arg, _FUNCS, lambda n: f"v{i}_{n}", value)

    def _holes(self, s: int, e: Compute) -> tuple[dict[str, str], dict[str, str]]:
        """The holes of statistic ``s``'s accumulation spellings and the names of its formulas."""
        xi = e.src[0]
        dt = compute_dtype(self._dtype(xi))
        holes = {
            "acc": f"acc{s}",
            "v": f"v{s}",
            "x": self._full(xi),
            "t": self.r.ctype(dt),
            "z": self.r.literal(0, dt),
            "one": self.r.literal(1, dt),
            "lo": _lowest(self.r, dt),
            "hi": _highest(self.r, dt),
            "R": self.R,
        }
        names = {**_FUNCS, "n": self.R}
        if isinstance(e.arg, NormArgs):
            names["eps"] = repr(e.arg.eps)
        return holes, names

    def _finish(
        self, s: int, spec: StatSpec, finish: list[tuple[str, str]], names: dict[str, str]
    ) -> list[str]:
        """The lines computing ``finish`` values of statistic ``s`` (a reduction's is ``v<s>`` itself)."""
        lines = []
        for n, formula in finish:
            target = f"v{s}" if spec.elem is None else f"v{s}_{n}"
            lines.append(f"    {target} = {spell(formula, names)}")
            names[n] = target
        return lines

    def _stat(self, s: int, e: Compute) -> list[str]:
        """The passes over the row computing statistic ``s``: per pass a loop accumulating per lane, the
        lane reduction, and the per-row values whose fields are then known."""
        spec, xi = STATS[e.op].on("triton"), e.src[0]
        holes, names = self._holes(s, e)
        lines: list[str] = []
        need = closure(self.k, [xi], self.inv)
        for p, finish in zip(_LOOP[spec.acc], spec.finish_by_pass()):
            holes["mean"] = names.get("mean", "")
            lines += ["    " + line.format(**holes) for line in p.init]
            lines += [*self._loop_head(), *self._loop_entries(need)]
            lines += ["        " + line.format(**holes) for line in p.step]
            lines += ["    " + line.format(**holes) for line in p.pre]
            names |= {f: v.format(**holes) for f, v in p.fields.items()}
            lines += self._finish(s, spec, finish, names)
        return lines
