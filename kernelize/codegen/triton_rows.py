"""Row kernels for the Triton generator: reductions and row ops (softmax, norms) with one row per program.

Two forms, chosen from the row size:

* **one block** (static rows up to :data:`MAX_FUSED` elements): the row is loaded once into registers;
  reductions are ``tl.sum`` / ``tl.max`` over masked lanes; softmax is max, exp, sum, divide.
* **loop** (longer or symbolic rows): each statistic gets one pass over the row in ``BLOCK`` steps,
  accumulating per lane in f32 and reducing the lanes at the end (two-level sums); softmax keeps an online
  (max, sum) pair per lane; layernorm takes a mean pass then a centred variance pass. A last pass computes
  and stores the full-row values. Loads are recomputed in each pass instead of staged.

Example (rmsnorm over a symbolic row, loop form, abridged)::

    acc3 = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, s_hidden, BLOCK):
        ...
        v0 = tl.load(x_ptr + row * s_hidden + j0, mask=mask, other=0.0)
        acc3 += tl.where(mask, v0 * v0, 0.0)
    v3_r = tl.rsqrt(tl.sum(acc3, axis=0) / s_hidden + 1e-06)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelize.autokernel.kernels import Compute, Kernel, Load, row_invariant
from kernelize.codegen.render import closure
from kernelize.ir.dtypes import DType, compute_dtype
from kernelize.ir.graph import REDUCE, ROW, Op
from kernelize.ir.ops import NormArgs
from kernelize.ir.shapes import Sym, numel

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


def _online_softmax(acc: str, v: str, x: str) -> tuple[list[str], list[str], list[str]]:
    """Per lane a running max and a sum of exponentials rescaled to it; then both over the lanes."""
    init = [
        f'    {acc}_m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)',
        f"    {acc}_s = tl.zeros([BLOCK], dtype=tl.float32)",
    ]
    step = [
        f'        xm = tl.where(mask, {x}, float("-inf"))',
        f"        new_m = tl.maximum({acc}_m, xm)",
        '        safe = tl.where(new_m == float("-inf"), 0.0, new_m)',
        f"        {acc}_s = {acc}_s * tl.exp({acc}_m - safe) + tl.exp(xm - safe)",
        f"        {acc}_m = new_m",
    ]
    fin = [
        f"    {v}_m = tl.max({acc}_m, axis=0)",
        f"    {v}_s = tl.sum({acc}_s * tl.exp({acc}_m - {v}_m), axis=0)",
    ]
    return init, step, fin


def _arg_extreme(
    is_max: bool, acc: str, v: str, x: str, lit: str, tl_dt: str
) -> tuple[list[str], list[str], list[str]]:
    """argmax / argmin: best value and first index per lane, then the first lane index of the best."""
    better, pick = (">", "max") if is_max else ("<", "min")
    init = [
        f"    {acc}_v = tl.full([BLOCK], {lit}, dtype={tl_dt})",
        f"    {acc}_i = tl.zeros([BLOCK], dtype=tl.int64)",
    ]
    step = [
        f"        xm = tl.where(mask, {x}, {lit})",
        f"        upd = xm {better} {acc}_v",
        f"        {acc}_i = tl.where(upd, cols.to(tl.int64), {acc}_i)",
        f"        {acc}_v = tl.where(upd, xm, {acc}_v)",
    ]
    fin = [
        f"    {v}_best = tl.{pick}({acc}_v, axis=0)",
        f"    {v} = tl.min(tl.where({acc}_v == {v}_best, {acc}_i, {2**62}), axis=0)",
    ]
    return init, step, fin


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
            elif e.op in REDUCE:
                x = self._full(e.src[0])
                lines += self._reduce_block(i, e, x)
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

    def _reduce_block(self, i: int, e: Compute, x: str) -> list[str]:
        src_dt = self._dtype(e.src[0])
        z = self.r.literal(0, src_dt)
        one = self.r.literal(1, src_dt)
        op = e.op
        if op in (Op.SUM, Op.MEAN):
            expr = f"tl.sum(tl.where(mask, {x}, {z}), axis=0)"
            if op is Op.MEAN:
                expr = f"{expr} / {self.R}"
        elif op is Op.REDUCE_MAX:
            expr = f"tl.max(tl.where(mask, {x}, {_lowest(self.r, src_dt)}), axis=0)"
        elif op is Op.REDUCE_MIN:
            expr = f"tl.min(tl.where(mask, {x}, {_highest(self.r, src_dt)}), axis=0)"
        elif op is Op.PROD:
            expr = f"tl.reduce(tl.where(mask, {x}, {one}), 0, kz_mul)"
        elif op is Op.ARGMAX:
            expr = f"tl.argmax(tl.where(mask, {x}, {_lowest(self.r, src_dt)}), axis=0).to(tl.int64)"
        else:
            expr = f"tl.argmin(tl.where(mask, {x}, {_highest(self.r, src_dt)}), axis=0).to(tl.int64)"
        return [f"    v{i} = {expr}"]

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
        if e.op is Op.RMSNORM:
            return [
                f"    {v}_r = tl.rsqrt(tl.sum(tl.where(mask, {x} * {x}, 0.0), axis=0) / {R} + {a.eps!r})",
                f"    {v} = {x} * {v}_r" + self._affine(e),
            ]
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
            passes = [("mean", e.src[0]), ("var", e.src[0])] if e.op is Op.LAYERNORM else [(None, e.src[0])]
            for stage, x in passes:
                lines += self._pass(s, e, stage, x)
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

    def _row_op_value(self, i: int, e: Compute) -> str:
        x, v = f"v{e.src[0]}", f"v{i}"
        if e.op is Op.SOFTMAX:
            return f"tl.exp({x} - {v}_m) / {v}_s"
        if e.op is Op.LOG_SOFTMAX:
            return f"{x} - {v}_m - tl.log({v}_s)"
        if e.op is Op.RMSNORM:
            return f"{x} * {v}_r" + self._affine(e)
        return f"({x} - {v}_mean) * {v}_r" + self._affine(e)

    def _pass(self, s: int, e: Compute, stage: str | None, xi: int) -> list[str]:
        """One loop over the row accumulating statistic ``s`` per lane, then the lane reduction."""
        v, R, acc = f"v{s}", self.R, f"acc{s}"
        dt = compute_dtype(self._dtype(xi))
        tl_dt = self.r.ctype(dt)
        x = f"v{xi}" if not self.inv[xi] else f"tl.broadcast_to(v{xi}, [BLOCK])"
        z = self.r.literal(0, dt)
        init: list[str]
        step: list[str]
        fin: list[str]
        op = e.op
        if op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
            init, step, fin = _online_softmax(acc, v, x)
        elif op is Op.RMSNORM:
            init = [f"    {acc} = tl.zeros([BLOCK], dtype=tl.float32)"]
            step = [f"        {acc} += tl.where(mask, {x} * {x}, 0.0)"]
            fin = [f"    {v}_r = tl.rsqrt(tl.sum({acc}, axis=0) / {R} + {e.arg.eps!r})"]
        elif op is Op.LAYERNORM and stage == "mean":
            init = [f"    {acc} = tl.zeros([BLOCK], dtype=tl.float32)"]
            step = [f"        {acc} += tl.where(mask, {x}, 0.0)"]
            fin = [f"    {v}_mean = tl.sum({acc}, axis=0) / {R}"]
        elif op is Op.LAYERNORM:
            init = [f"    {acc} = tl.zeros([BLOCK], dtype=tl.float32)"]
            step = [f"        d = tl.where(mask, {x} - {v}_mean, 0.0)", f"        {acc} += d * d"]
            fin = [f"    {v}_r = tl.rsqrt(tl.sum({acc}, axis=0) / {R} + {e.arg.eps!r})"]
        elif op in (Op.SUM, Op.MEAN):
            init = [f"    {acc} = tl.zeros([BLOCK], dtype={tl_dt})"]
            step = [f"        {acc} += tl.where(mask, {x}, {z})"]
            fin = [f"    {v} = tl.sum({acc}, axis=0)" + (f" / {R}" if op is Op.MEAN else "")]
        elif op in (Op.REDUCE_MAX, Op.REDUCE_MIN):
            big = op is Op.REDUCE_MAX
            fn, lit = ("maximum", _lowest(self.r, dt)) if big else ("minimum", _highest(self.r, dt))
            init = [f"    {acc} = tl.full([BLOCK], {lit}, dtype={tl_dt})"]
            step = [f"        {acc} = tl.{fn}({acc}, tl.where(mask, {x}, {lit}))"]
            fin = [f"    {v} = tl.{fn[:3]}({acc}, axis=0)"]
        elif op is Op.PROD:
            init = [f"    {acc} = tl.full([BLOCK], 1, dtype={tl_dt})"]
            step = [f"        {acc} *= tl.where(mask, {x}, {self.r.literal(1, dt)})"]
            fin = [f"    {v} = tl.reduce({acc}, 0, kz_mul)"]
        else:
            lit = _lowest(self.r, dt) if op is Op.ARGMAX else _highest(self.r, dt)
            init, step, fin = _arg_extreme(op is Op.ARGMAX, acc, v, x, lit, tl_dt)
        need = closure(self.k, [xi], self.inv)
        return [*init, *self._loop_head(), *self._loop_entries(need), *step, *fin]
