"""Row kernels for the CPU backend: the passes over one row and the statistics each row op needs.

A ROW kernel's reductions and row ops need statistics of the row (a sum of squares, a max and a sum of
exponentials...). Each becomes one or two *passes*: a simd reduction loop over the row that recomputes the
full values it reads (loads hit cache: the row was just read) and a few scalar lines after it. A
statistic runs in the pass after everything it reads is available, so independent statistics share a pass
(add + rmsnorm: one statistics pass, one write pass). The last pass writes the full values that are
stored; per-row values are stored once after it.

Example (rmsnorm, as generated)::

    float kz_a2_0 = 0;
    #pragma omp simd reduction(+: kz_a2_0)
    for (int64_t i1 = 0; i1 < 4096; ++i1) { const float v0 = kz_ld(kz_in0, kz_l0 + i1); kz_a2_0 += v0 * v0; }
    const float kz_r2 = (float)1 / kz_sqrt(...);
    #pragma omp simd
    for (int64_t i1 = 0; i1 < 4096; ++i1) { ...; const float v2 = (v0 * kz_r2 * v1); kz_st(...); }
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernelize.autokernel.kernels import Compute
from kernelize.codegen.render import closure, deps
from kernelize.ir.graph import REDUCE, ROW, Op
from kernelize.ir.shapes import numel

SHORT_ROW = 16384  # static rows up to this length sum in float lanes, longer ones in double
SCRATCH_SLOTS = 4  # per-thread scratch rows a kernel may use (softmaxes beyond that recompute exp)


@dataclass
class _Pass:
    operands: list[int]
    decl: list[str] = field(default_factory=list)
    update: list[str] = field(default_factory=list)
    clauses: list[str] = field(default_factory=list)
    final: list[str] = field(default_factory=list)
    simd: bool = True


def _row_pos(w, split: int) -> str:
    """The flattened position inside the row (for argmax / argmin)."""
    pos = f"i{split}"
    for d in range(split + 1, w.rank):
        pos = f"({pos} * {w.n(d)} + i{d})"
    return pos


def _stat_passes(w, i: int, e: Compute, full: dict[int, str], split: int) -> list[_Pass]:
    """The passes computing entry ``i``'s statistics; sets ``full[i]`` for row ops."""
    r = w.r
    x = e.src[0]
    src_dtype = w.k.body[x].dtype
    ct = r.ctype(e.dtype)
    a = f"kz_a{i}"
    n = "kz_rowlen"
    # float sums: the simd loop keeps one partial sum per lane, so a static row of up to SHORT_ROW elements
    # sums <= 1k values per lane in float (measured 10-30% faster than double on rmsnorm / softmax); longer
    # or symbolic rows accumulate in double to keep f32-level accuracy (torch uses a cascade)
    rowlen = numel(w.k.domain[split:])
    at = "float" if ct == "float" and isinstance(rowlen, int) and rowlen <= SHORT_ROW else ct
    at = "double" if e.dtype.is_float and at != "float" else at
    lit = r.literal
    if e.op in (Op.SUM, Op.MEAN, Op.PROD):
        init, upd, red = ("1", f"{a} *= v{x};", "*") if e.op is Op.PROD else ("0", f"{a} += v{x};", "+")
        fin = f"kz_div_or_nan({a}, {n})" if e.op is Op.MEAN else a
        return [
            _Pass(
                [x],
                [f"{at if red == '+' else ct} {a} = {init};"],
                [upd],
                [f"reduction({red}: {a})"],
                [f"const {ct} v{i} = ({ct})({fin});"],
            )
        ]
    if e.op in (Op.REDUCE_MAX, Op.REDUCE_MIN):
        cmp, red = (">", "max") if e.op is Op.REDUCE_MAX else ("<", "min")
        if e.dtype.is_float:
            init = lit(float("-inf") if e.op is Op.REDUCE_MAX else float("inf"), e.dtype)
            return [
                _Pass(
                    [x],
                    [f"{ct} {a} = {init};", f"int {a}n = 0;"],
                    [f"{a} = v{x} {cmp} {a} ? v{x} : {a};", f"{a}n |= v{x} != v{x};"],
                    [f"reduction({red}: {a})", f"reduction(|: {a}n)"],
                    [f"const {ct} v{i} = {a}n ? ({ct})NAN : {a};"],
                )
            ]
        init = f"kz_lowest<{ct}>()" if e.op is Op.REDUCE_MAX else f"kz_highest<{ct}>()"
        return [
            _Pass(
                [x],
                [f"{ct} {a} = {init};"],
                [f"{a} = v{x} {cmp} {a} ? v{x} : {a};"],
                [f"reduction({red}: {a})"],
                [f"const {ct} v{i} = {a};"],
            )
        ]
    if e.op in (Op.ARGMAX, Op.ARGMIN):
        st = r.ctype(src_dtype)
        cmp = ">" if e.op is Op.ARGMAX else "<"
        nan = f"v{x} != v{x} || " if src_dtype.is_float else ""
        upd = (
            f"if (!{a}h || ({a} == {a} && ({nan}v{x} {cmp} {a}))) "
            f"{{ {a} = v{x}; {a}i = {_row_pos(w, split)}; {a}h = true; }}"
        )
        return [
            _Pass(
                [x],
                [f"{st} {a} = 0;", f"int64_t {a}i = 0;", f"bool {a}h = false;"],
                [upd],
                [],
                [f"const int64_t v{i} = {a}i;"],
                simd=False,
            )
        ]
    if e.op is Op.RMSNORM:
        eps, has_w = e.arg
        full[i] = f"(v{x} * kz_r{i}" + (f" * v{e.src[1]})" if has_w else ")")
        return [
            _Pass(
                [x],
                [f"{at} {a} = 0;"],
                [f"{a} += v{x} * v{x};"],
                [f"reduction(+: {a})"],
                [
                    f"const {ct} kz_r{i} = ({ct})1 / kz_sqrt(({ct})({n} ? {a} / ({at}){n} : ({at})0) + "
                    f"{lit(eps, e.dtype)});"
                ],
            )
        ]
    if e.op is Op.LAYERNORM:
        eps, has_w, has_b = e.arg
        y = f"(v{x} - kz_m{i}) * kz_r{i}"
        if has_w:
            y += f" * v{e.src[1]}"
        if has_b:
            y += f" + v{e.src[1 + has_w]}"
        full[i] = f"({y})"
        if ct == "float":
            # one statistics pass: sum and sum of squares in double (var = E[x^2] - E[x]^2 keeps f32
            # accuracy in double unless |mean| / std exceeds ~1e6), so the row is read twice, not three times
            return [
                _Pass(
                    [x],
                    [f"double {a} = 0;", f"double {a}q = 0;"],
                    [f"{a} += v{x};", f"{a}q += (double)v{x} * (double)v{x};"],
                    [f"reduction(+: {a})", f"reduction(+: {a}q)"],
                    [
                        f"const double {a}m = {n} ? {a} / (double){n} : 0.0;",
                        f"const double {a}v = {n} ? {a}q / (double){n} - {a}m * {a}m : 0.0;",
                        f"const float kz_m{i} = (float){a}m;",
                        f"const float kz_r{i} = (float)(1.0 / sqrt(({a}v > 0.0 ? {a}v : 0.0) + {eps!r}));",
                    ],
                )
            ]
        return [
            _Pass(
                [x],
                [f"{at} {a} = 0;"],
                [f"{a} += v{x};"],
                [f"reduction(+: {a})"],
                [f"const {ct} kz_m{i} = ({ct})({n} ? {a} / ({at}){n} : ({at})0);"],
            ),
            _Pass(
                [x],
                [f"{at} {a}q = 0;"],
                [f"const {ct} {a}d = v{x} - kz_m{i};", f"{a}q += {a}d * {a}d;"],
                [f"reduction(+: {a}q)"],
                [
                    f"const {ct} kz_r{i} = ({ct})1 / kz_sqrt(({ct})({n} ? {a}q / ({at}){n} : ({at})0) + "
                    f"{lit(eps, e.dtype)});"
                ],
            ),
        ]
    if e.op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
        update = [f"{a}s += kz_exp_neg(v{x} - kz_m{i});"]
        decl = [f"{at} {a}s = 0;"]
        if e.op is Op.SOFTMAX and w.scratch_slots < SCRATCH_SLOTS:
            # the sum pass keeps exp(x - max) in a per-thread scratch row (in cache): the write pass
            # scales it instead of computing exp again, which is what bounds softmax on the CPU
            pos = _row_pos(w, split)
            decl.append(f"{ct}* __restrict {a}w = kz_scratch<{ct}>({w.scratch_slots}, {n});")
            update = [
                f"const {ct} {a}e = kz_exp_neg(v{x} - kz_m{i});",
                f"{a}w[{pos}] = {a}e;",
                f"{a}s += {a}e;",
            ]
            full[i] = f"({a}w[{pos}] * kz_r{i})"
            w.scratch_slots += 1
            fin = f"const {ct} kz_r{i} = ({ct})(1 / {a}s);"
        elif e.op is Op.SOFTMAX:
            full[i] = f"(kz_exp_neg(v{x} - kz_m{i}) * kz_r{i})"
            fin = f"const {ct} kz_r{i} = ({ct})(1 / {a}s);"
        else:
            full[i] = f"((v{x} - kz_m{i}) - kz_r{i})"
            fin = f"const {ct} kz_r{i} = ({ct})kz_log({a}s);"
        return [
            _Pass(
                [x],
                [f"{ct} {a} = {lit(float('-inf'), e.dtype)};", f"int {a}n = 0;"],
                [f"{a} = v{x} > {a} ? v{x} : {a};", f"{a}n |= v{x} != v{x};"],
                [f"reduction(max: {a})", f"reduction(|: {a}n)"],
                [f"const {ct} kz_m{i} = {a}n ? ({ct})NAN : {a};"],
            ),
            _Pass([x], decl, update, [f"reduction(+: {a}s)"], [fin]),
        ]
    raise NotImplementedError(f"cpu backend: no row statistics for {e.op}")


def _loop(w, split: int, simd: bool, clauses: list[str], body: list[str]) -> list[str]:
    """Nested loops over the row axes; the innermost one is the simd loop."""
    lines, depth = [], 0
    for d in range(split, w.rank):
        pad = "    " * depth
        if d == w.rank - 1 and simd:
            lines.append("#pragma omp simd" + "".join(" " + c for c in clauses))
        lines.append(f"{pad}for (int64_t i{d} = 0; i{d} < {w.n(d)}; ++i{d}) {{")
        depth += 1
    lines += ["    " * depth + b for b in body]
    for depth in range(w.rank - split - 1, -1, -1):
        lines.append("    " * depth + "}")
    return lines


def render_row(w, inv: list[bool]) -> list[str]:
    """The code for one row (inside the loop over rows, after the outer indices and access bases)."""
    k = w.k
    split = w.rank - k.row_rank
    w.scratch_slots = 0
    row_axes = list(range(split, w.rank))
    stage = [0] * len(k.body)
    full: dict[int, str] = {}
    passes: dict[int, list[tuple[int, _Pass]]] = {}
    for i, e in enumerate(k.body):
        start = max((stage[s] for s in deps(e)), default=0)
        if isinstance(e, Compute) and (e.op in REDUCE or e.op in ROW):
            specs = _stat_passes(w, i, e, full, split)
            for j, p in enumerate(specs):
                passes.setdefault(start + 1 + j, []).append((i, p))
            stage[i] = start + len(specs)
        else:
            stage[i] = start
    last = max(stage, default=0)
    lines: list[str] = []
    emitted: set[int] = set()

    def scalars(p: int) -> None:
        for i, e in enumerate(k.body):
            is_stat = isinstance(e, Compute) and (e.op in REDUCE or e.op in ROW)
            if inv[i] and stage[i] == p and not is_stat and i not in emitted:
                emitted.add(i)
                lines.append(w.value(i, [], full))

    scalars(0)
    for p in range(1, last + 1):
        group = passes.get(p, [])
        operands = [o for _, sp in group for o in sp.operands]
        body = [w.value(j, row_axes, full) for j in closure(k, operands, inv)]
        simd = all(sp.simd for _, sp in group)
        for _, sp in group:
            lines += sp.decl
        lines += _loop(
            w,
            split,
            simd,
            [c for _, sp in group for c in sp.clauses],
            body + [u for _, sp in group for u in sp.update],
        )
        for _, sp in group:
            lines += sp.final
        scalars(p)
    full_stores = [(j, s) for j, s in enumerate(k.stores) if not inv[s.value]]
    if full_stores:
        body = [w.value(j, row_axes, full) for j in closure(k, [s.value for _, s in full_stores], inv)]
        body += [w.store(j, s, row_axes) for j, s in full_stores]
        lines += _loop(w, split, True, [], body)
    lines += [w.store(j, s, []) for j, s in enumerate(k.stores) if inv[s.value]]
    return [line for line in lines if line]


__all__ = ["render_row"]
