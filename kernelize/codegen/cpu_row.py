"""Row kernels for the CPU backend: the passes over one row and the statistics each row op needs.

A ROW kernel's reductions and row ops need statistics of the row (a sum of squares, a max and a sum of
exponentials...). Each becomes one or two *passes*: a simd reduction loop over the row that recomputes the
full values it reads (loads hit cache: the row was just read) and a few scalar lines after it. A
statistic runs in the pass after everything it reads is available, so independent statistics share a pass
(add + rmsnorm: one statistics pass, one write pass). The last pass writes the full values that are
stored (and, when the kernel streams, prefetches the next row: :func:`_next_row_prefetch`); per-row values
are stored once after it. Which accumulation each op takes, and the element formulas
of row ops, come from :data:`kernelize.ir.stats.STATS` (its ``cpu`` variants: max then sum of exp for
softmaxes, sum and sum of squares for f32 layernorm); ``_STATS`` writes each accumulation as passes.

Example (rmsnorm, as generated)::

    float kz_a2_0 = 0;
    #pragma omp simd reduction(+: kz_a2_0)
    for (int64_t i1 = 0; i1 < 4096; ++i1) { const float v0 = kz_ld(kz_in0, kz_l0 + i1); kz_a2_0 += v0 * v0; }
    const float kz_r2 = (float)1 / kz_sqrt(...);
    #pragma omp simd
    for (int64_t i1 = 0; i1 < 4096; ++i1) { ...; const float v2 = (v0 * kz_r2 * v1); kz_st(...); }
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernelize.autokernel.kernels import Compute, Load, column_sums
from kernelize.codegen.cpu_chunks import CHUNK, chunked_loop, moved_bytes
from kernelize.codegen.render import closure, deps
from kernelize.ir.dtypes import HALF
from kernelize.ir.graph import REDUCE, ROW, Op
from kernelize.ir.ops import NormArgs
from kernelize.ir.shapes import numel
from kernelize.ir.stats import STATS, Acc, StatSpec, spell, spell_elem

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


@dataclass
class _Stat:
    """The names one row op's statistics are written with: entry ``i`` of the kernel body reads value ``x``;
    ``ct`` is its C type, ``at`` the accumulator type of its sums, ``a`` the accumulator's name."""

    w: Any
    i: int
    e: Compute
    full: dict[int, str]  # full-row formulas of row ops, set by their writers
    split: int
    x: int
    ct: str
    at: str
    spec: StatSpec

    @property
    def a(self) -> str:
        return f"kz_a{self.i}"

    def lit(self, value: float) -> str:
        return self.w.r.literal(value, self.e.dtype)

    def mean(self, acc: str) -> str:
        """``acc`` over the row length (0 for an empty row)."""
        return f"({_N} ? {acc} / ({self.at}){_N} : ({self.at})0)"

    def elem(self) -> str:
        """The row op's element formula (from the statistics table) in C++ names."""
        e, i = self.e, self.i
        return spell_elem(e.op, self.spec, e.src, e.arg, _FUNCS, lambda n: f"kz_{n}{i}", lambda j: f"v{j}")

    def inv_std(self, acc: str, eps: float) -> str:
        """``kz_r{i}``: one over the root of ``acc``'s mean plus ``eps``."""
        ct = self.ct
        return f"const {ct} kz_r{self.i} = ({ct})1 / kz_sqrt(({ct}){self.mean(acc)} + {self.lit(eps)});"


_N = "kz_rowlen"
# every exp of a row formula takes x - max <= 0: the cheaper kz_exp_neg
_FUNCS = {"exp": "kz_exp_neg", "log": "kz_log", "rsqrt": "kz_rsqrt"}


def _stat_passes(w, i: int, e: Compute, full: dict[int, str], split: int) -> list[_Pass]:
    """The passes computing entry ``i``'s statistics; sets ``full[i]`` for row ops."""
    ct = w.r.ctype(e.dtype)
    # float sums: the simd loop keeps one partial sum per lane, so a static row of up to SHORT_ROW elements
    # sums <= 1k values per lane in float (measured 10-30% faster than double on rmsnorm / softmax); longer
    # or symbolic rows accumulate in double to keep f32-level accuracy (torch uses a cascade)
    rowlen = numel(w.k.domain[split:])
    at = "float" if ct == "float" and isinstance(rowlen, int) and rowlen <= SHORT_ROW else ct
    at = "double" if e.dtype.is_float and at != "float" else at
    spec = STATS[e.op].on("cpu")
    writer = _STATS.get(spec.acc)
    if writer is None:
        raise NotImplementedError(f"cpu backend: no row statistics for {e.op} ({spec.acc})")
    return writer(_Stat(w, i, e, full, split, e.src[0], ct, at, spec))


def _sum(c: _Stat) -> list[_Pass]:
    a, x, ct = c.a, c.x, c.ct
    if c.spec.acc is Acc.PROD:
        return [
            _Pass(
                [x],
                [f"{ct} {a} = 1;"],
                [f"{a} *= v{x};"],
                [f"reduction(*: {a})"],
                [f"const {ct} v{c.i} = ({ct})({a});"],
            )
        ]
    fin = f"kz_div_or_nan({a}, {_N})" if c.e.op is Op.MEAN else a
    return [
        _Pass(
            [x],
            [f"{c.at} {a} = 0;"],
            [f"{a} += v{x};"],
            [f"reduction(+: {a})"],
            [f"const {ct} v{c.i} = ({ct})({fin});"],
        )
    ]


def _nan_extreme(c: _Stat, red: str, target: str) -> _Pass:
    """max / min of a float row into ``target``, NaN when any element is NaN (as torch)."""
    a, x, ct = c.a, c.x, c.ct
    cmp = ">" if red == "max" else "<"
    return _Pass(
        [x],
        [f"{ct} {a} = {c.lit(float('-inf') if red == 'max' else float('inf'))};", f"int {a}n = 0;"],
        [f"{a} = v{x} {cmp} {a} ? v{x} : {a};", f"{a}n |= v{x} != v{x};"],
        [f"reduction({red}: {a})", f"reduction(|: {a}n)"],
        [f"const {ct} {target} = {a}n ? ({ct})NAN : {a};"],
    )


def _extreme(c: _Stat) -> list[_Pass]:
    a, x, ct = c.a, c.x, c.ct
    red = "max" if c.spec.acc is Acc.MAX else "min"
    if c.e.dtype.is_float:
        return [_nan_extreme(c, red, f"v{c.i}")]
    init = f"kz_lowest<{ct}>()" if red == "max" else f"kz_highest<{ct}>()"
    cmp = ">" if red == "max" else "<"
    upd = f"{a} = v{x} {cmp} {a} ? v{x} : {a};"
    return [
        _Pass([x], [f"{ct} {a} = {init};"], [upd], [f"reduction({red}: {a})"], [f"const {ct} v{c.i} = {a};"])
    ]


def _arg(c: _Stat) -> list[_Pass]:
    a, x = c.a, c.x
    src_dtype = c.w.k.body[x].dtype
    cmp = ">" if c.spec.acc is Acc.ARGMAX else "<"
    nan = f"v{x} != v{x} || " if src_dtype.is_float else ""
    upd = (
        f"if (!{a}h || ({a} == {a} && ({nan}v{x} {cmp} {a}))) "
        f"{{ {a} = v{x}; {a}i = {_row_pos(c.w, c.split)}; {a}h = true; }}"
    )
    decl = [f"{c.w.r.ctype(src_dtype)} {a} = 0;", f"int64_t {a}i = 0;", f"bool {a}h = false;"]
    return [_Pass([x], decl, [upd], [], [f"const int64_t v{c.i} = {a}i;"], simd=False)]


def _rmsnorm(c: _Stat) -> list[_Pass]:
    a, x, i = c.a, c.x, c.i
    args: NormArgs = c.e.arg
    c.full[i] = c.elem()
    return [
        _Pass(
            [x],
            [f"{c.at} {a} = 0;"],
            [f"{a} += v{x} * v{x};"],
            [f"reduction(+: {a})"],
            [c.inv_std(a, args.eps)],
        )
    ]


def _layernorm(c: _Stat) -> list[_Pass]:
    a, x, i, ct = c.a, c.x, c.i, c.ct
    args: NormArgs = c.e.arg
    eps = args.eps
    c.full[i] = c.elem()
    if ct == "float":
        # one statistics pass: sum and sum of squares in double (var = E[x^2] - E[x]^2 keeps f32
        # accuracy in double unless |mean| / std exceeds ~1e6), so the row is read twice, not three times
        final = [
            f"const double {a}m = {_N} ? {a} / (double){_N} : 0.0;",
            f"const double {a}v = {_N} ? {a}q / (double){_N} - {a}m * {a}m : 0.0;",
            f"const float kz_mean{i} = (float){a}m;",
            f"const float kz_r{i} = (float)(1.0 / sqrt(({a}v > 0.0 ? {a}v : 0.0) + {eps!r}));",
        ]
        decl, upd = (
            [f"double {a} = 0;", f"double {a}q = 0;"],
            [f"{a} += v{x};", f"{a}q += (double)v{x} * (double)v{x};"],
        )
        return [_Pass([x], decl, upd, [f"reduction(+: {a})", f"reduction(+: {a}q)"], final)]
    mean = _Pass(
        [x],
        [f"{c.at} {a} = 0;"],
        [f"{a} += v{x};"],
        [f"reduction(+: {a})"],
        [f"const {ct} kz_mean{i} = ({ct}){c.mean(a)};"],
    )
    upd = [f"const {ct} {a}d = v{x} - kz_mean{i};", f"{a}q += {a}d * {a}d;"]
    var = _Pass([x], [f"{c.at} {a}q = 0;"], upd, [f"reduction(+: {a}q)"], [c.inv_std(f"{a}q", eps)])
    return [mean, var]


def _softmax(c: _Stat) -> list[_Pass]:
    a, x, i, ct, w = c.a, c.x, c.i, c.ct, c.w
    update = [f"{a}s += kz_exp_neg(v{x} - kz_m{i});"]
    decl = [f"{c.at} {a}s = 0;"]
    names = {**_FUNCS, "sumexp": f"{a}s"}
    fin = [f"const {ct} kz_{n}{i} = ({ct})({spell(f, names)});" for n, f in c.spec.finish_by_pass()[1]]
    c.full[i] = c.elem()
    if c.e.op is Op.SOFTMAX and w.scratch_slots < SCRATCH_SLOTS:
        # the sum pass keeps exp(x - max) in a per-thread scratch row (in cache): the write pass
        # scales it instead of computing exp again, which is what bounds softmax on the CPU
        pos = _row_pos(w, c.split)
        decl.append(f"{ct}* __restrict {a}w = kz_scratch<{ct}>({w.scratch_slots}, {_N});")
        update = [f"const {ct} {a}e = kz_exp_neg(v{x} - kz_m{i});", f"{a}w[{pos}] = {a}e;", f"{a}s += {a}e;"]
        c.full[i] = c.full[i].replace(f"kz_exp_neg(v{x} - kz_m{i})", f"{a}w[{pos}]")
        w.scratch_slots += 1
    return [_nan_extreme(c, "max", f"kz_m{i}"), _Pass([x], decl, update, [f"reduction(+: {a}s)"], fin)]


# how each accumulation of the statistics table is written as passes
_STATS: dict[Acc, Callable[[_Stat], list[_Pass]]] = {
    Acc.SUM: _sum,
    Acc.PROD: _sum,
    Acc.MAX: _extreme,
    Acc.MIN: _extreme,
    Acc.ARGMAX: _arg,
    Acc.ARGMIN: _arg,
    Acc.SUMSQ: _rmsnorm,
    Acc.MOMENTS: _layernorm,
    Acc.MAX_THEN_SUMEXP: _softmax,
}


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


def _stat_pass(w, group: list[_Pass], inv: list[bool], written: set[int], full: dict[int, str], split: int):
    """One statistics pass: the simd loop computing what its statistics read (and keeping costly values the
    write pass needs in scratch rows), with the declarations before it and the scalar lines after it."""
    values = closure(w.k, [o for sp in group for o in sp.operands], inv)
    body = [w.value(j, list(range(split, w.rank)), full) for j in values]
    decl, keep = _kept_in_scratch(w, values, written, full, split)
    lines = [line for sp in group for line in sp.decl] + decl
    updates = [u for sp in group for u in sp.update]
    clauses = [c for sp in group for c in sp.clauses]
    lines += _loop(w, split, all(sp.simd for sp in group), clauses, body + updates + keep)
    return lines + [line for sp in group for line in sp.final]


def render_row(w, inv: list[bool]) -> list[str]:
    """The code for one row (inside the loop over rows, after the outer indices and access bases)."""
    k = w.k
    split = w.rank - k.row_rank
    w.scratch_slots = 0
    row_axes = list(range(split, w.rank))
    cols = column_sums(k)
    stage = [0] * len(k.body)
    full: dict[int, str] = {}
    passes: dict[int, list[tuple[int, _Pass]]] = {}
    for i, e in enumerate(k.body):
        start = max((stage[s] for s in deps(e)), default=0)
        if isinstance(e, Compute) and (e.op in REDUCE or e.op in ROW) and i not in cols:
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
    # the write pass: full values stored, and the operands of column sums added to this thread's partials
    full_stores = _full_stores(k, inv)
    roots = [s.value for _, s in full_stores] + [k.body[i].src[0] for i in cols]
    written = set(closure(k, roots, inv))
    for p in range(1, last + 1):
        lines += _stat_pass(w, [sp for _, sp in passes.get(p, [])], inv, written, full, split)
        scalars(p)
    if full_stores or cols:
        values = [w.value(j, row_axes, full) for j in closure(k, roots, inv)]
        sums = [f"kz_c{i}[{_row_pos(w, split)}] += v{k.body[i].src[0]};" for i in cols]
        lines += _write_pass(w, split, values, full_stores, sums)
    if cols:
        lines += _column_fold(cols)
    lines += [w.store(j, s, []) for j, s in enumerate(k.stores) if inv[s.value]]
    return [line for line in lines if line]


def _full_stores(k, inv: list[bool]) -> list[tuple[int, Any]]:
    """The stores of full values (not per-row values, not column sums), with their positions."""
    cols = column_sums(k)
    return [(j, s) for j, s in enumerate(k.stores) if not inv[s.value] and s.value not in cols]


def row_stream_bytes(w, inv: list[bool]) -> str:
    """The ``STREAM_BYTES`` hole of a row kernel: bytes per element it moves when its write pass can
    stream (0: it cannot; see :func:`~kernelize.codegen.cpu_chunks.moved_bytes`)."""
    if w.k.row_rank != 1:
        return "0"
    chunked, stream = w.chunk_plan(w.rank - 1, _full_stores(w.k, inv))
    return str(moved_bytes(w.k, chunked) if stream else 0)


def _write_pass(w, split: int, values: list[str], stores: list[tuple[int, Any]], sums: list[str]):
    """The write pass: ``values``, the full ``stores`` and the column-sum updates ``sums``. Over one row
    axis, contiguous f32 / bf16 stores go through float chunks
    (:func:`~kernelize.codegen.cpu_chunks.chunked_loop`) when the kernel streams its outputs, and bf16 ones
    also when it does not, unless there are column sums: with a row of column partials to update as well,
    bf16 chunks were slower (add+RMSNorm bf16 backward, 2048 x 2048, 1 thread: 2.10 ms plain, 2.53 ms in
    chunks of 64, 2.19 ms of 32)."""
    row_axes = list(range(split, w.rank))
    chunked, stream = w.chunk_plan(split, stores, bf16_chunks=not sums) if w.k.row_rank == 1 else ([], False)
    slots = {c.slot for c in chunked}
    rest = [w.store(j, s, row_axes) for j, s in stores if j not in slots] + sums
    if not chunked:
        return _loop(w, split, True, [], values + rest)
    prefetch = _next_row_prefetch(w, split) if stream else []
    loop = chunked_loop(f"i{split}", "0", w.n(split), values, chunked, rest, not sums, stream, prefetch)
    return ["const int64_t kz_nx = kz_o + 1 < kz_outer;"] + loop if prefetch else loop


def _next_row_prefetch(w, split: int) -> list[str]:
    """Prefetches, per chunk of a streamed write pass, of the same chunk of the next row of every input the
    row reads contiguously (``kz_nx``: 1 unless this is the last row). A streamed kernel reads its rows from
    memory, and the hardware prefetcher, which starts over at each 4 KiB page (a bf16 row of 2048), leaves
    the first pass of every row waiting on memory while the write pass, reading the row from cache, moves
    few bytes. ``benchmarks/row_prefetch.py`` (each training kernel alone, cold caches, 2048 x 2048, 2
    threads): the norms' kernels 8-29% faster in most runs (LayerNorm bf16 forward 17-19%), RMSNorm's
    forward within +-4%, softmax's none (its bf16 backward, two light passes, 0-13% slower)."""
    if split == 0:
        return []
    lines: dict[str, None] = {}
    for i, e in enumerate(w.k.body):
        if not isinstance(e, Load) or e.indirect or i in w.widened or e.strides[split] != 1:
            continue
        step = e.strides[split - 1]
        if step == 0:
            continue
        per_line = max(1, 64 // e.buffer.dtype.itemsize)
        base = f"{w.ptr[e.buffer]} + {w.index(f'kz_l{i}', e, [])} + kz_nx * {w.r.dim(step)} + kz_ch"
        lines.update((f"__builtin_prefetch({base} + {j}, 0, 3);", None) for j in range(0, CHUNK, per_line))
    return list(lines)


# elementwise ops worth a scratch-row store and load rather than computing them again in a later pass
_COSTLY = frozenset({Op.EXP, Op.LOG, Op.TANH, Op.SIGMOID, Op.ERF})


def _kept_in_scratch(w, values: list[int], written: set[int], full: dict[int, str], split: int):
    """Costly elementwise values a statistics pass computes that the write pass needs again (the fused
    loss's ``exp(z - max)``: summed in one pass, scaled in the write pass): each is stored into a per-thread
    scratch row (in cache) as the pass computes it, and later passes load it. Returns the declarations
    before the pass and the stores inside it; ``full`` then names the scratch element for later passes.
    Measured on the fused loss's 256 x 32000 f32 chunk kernel (1 thread, thread CPU time): 10.3 -> 8.0 ms."""
    decl: list[str] = []
    keep: list[str] = []
    pos = _row_pos(w, split)
    for i in values:
        e = w.k.body[i]
        if not (isinstance(e, Compute) and e.op in _COSTLY and i in written and i not in full):
            continue
        if w.scratch_slots >= SCRATCH_SLOTS:
            break
        ct = w.r.ctype(e.dtype)
        decl.append(f"{ct}* __restrict kz_k{i} = kz_scratch<{ct}>({w.scratch_slots}, {_N});")
        keep.append(f"kz_k{i}[{pos}] = v{i};")
        full[i] = f"kz_k{i}[{pos}]"
        w.scratch_slots += 1
    return decl, keep


COLUMN_BLOCK = 64  # rows a thread adds into its float partials before folding them into double totals


WIDEN_MAX = 16384  # floats a thread widens row-invariant 16-bit operands into (64 KiB of its stack)


def widened_loads(w) -> dict[int, str]:
    """Loads of a bf16 / f16 operand that every row reads the same (a norm's weight and bias), by body
    index, with the name of the float row each thread widens it into before its rows: the row passes then
    load floats instead of widening the operand again for every row. A bf16 LayerNorm's write pass loads
    and widens ``w`` and ``b`` with 12 of its ~35 instructions per 32 elements, and the kernel is bound by
    instructions, not memory (2048 x 2048, 2 threads, run in C: forward 0.565 -> 0.455 ms; one thread on
    128 rows in cache 0.072 -> 0.057 ms). Only over a single static row axis, unmasked direct loads, as many
    as fit in WIDEN_MAX floats."""
    k = w.k
    split, n = w.rank - k.row_rank, k.domain[-1]
    if k.row_rank != 1 or not isinstance(n, int):
        return {}
    loads = [
        i
        for i, e in enumerate(k.body)
        if isinstance(e, Load)
        and e.dtype in HALF
        and not e.mask
        and not e.indirect
        and e.strides[-1] != 0
        and all(e.strides[d] == 0 for d in range(split))
    ]
    return {i: f"kz_h{i}" for i in loads[: WIDEN_MAX // max(n, 1)]}


def render_widened(w) -> list[str]:
    """Per thread, before its rows: the float copies of :func:`widened_loads`."""
    d, n, lines = w.rank - 1, w.n(w.rank - 1), []
    for i, name in w.widened.items():
        e = w.k.body[i]
        read = f"kz_ld({w.ptr[e.buffer]}, {w.index(w.r.dim(e.offset), e, [d])})"
        lines += [
            f"alignas(64) float {name}[{n}];",
            "#pragma omp simd",
            f"for (int64_t i{d} = 0; i{d} < {n}; ++i{d}) {name}[i{d}] = {read};",
        ]
    return [" " * 8 + line for line in lines]


def render_columns(w) -> dict[str, str]:
    """The template holes of a row kernel's column sums: ``COL_ALLOC`` (before the parallel region: per
    thread and column sum, a float row of partials and a double row of totals, padded to 64 bytes),
    ``COL_SETUP`` (each thread zeroes its rows) and ``COL_FINISH`` (after every row: the threads split the
    columns, add up the totals and partials and store). The write pass adds into the float partials (one
    simd add per element); every COLUMN_BLOCK rows they fold into the totals, so a column of n rows
    rounds like sums of 64 plus a double sum, not like one float sum of n / threads values."""
    k, cols = w.k, column_sums(w.k)
    widen = render_widened(w)
    if not cols:
        return {"COL_ALLOC": "", "COL_SETUP": "\n".join(widen), "COL_FINISH": "", "COL_TOGETHER": "false"}
    nc, ind = len(cols), " " * 8
    pt = "double" if any(k.body[i].dtype.itemsize > 4 for i in cols) else "float"  # f64 sums stay f64
    alloc = [
        "    const int64_t kz_cpad = (kz_rowlen + 15) / 16 * 16;",
        f"    {pt}* const kz_cp = kz_partials<{pt}>(0, (int64_t)kz_tm.n * {nc} * kz_cpad);",
        f"    double* const kz_cq = kz_partials<double>(1, (int64_t)kz_tm.n * {nc} * kz_cpad);",
    ]
    setup = [
        f"{ind}const int64_t kz_cb = (int64_t)kz_tid * {nc} * kz_cpad;",
        f"{ind}int kz_cn = 0;",
    ]
    for slot, i in enumerate(cols):
        setup += [
            f"{ind}{pt}* __restrict kz_c{i} = kz_cp + kz_cb + {slot} * kz_cpad;",
            f"{ind}double* __restrict kz_q{i} = kz_cq + kz_cb + {slot} * kz_cpad;",
            f"{ind}for (int64_t kz_j = 0; kz_j < kz_rowlen; ++kz_j) kz_c{i}[kz_j] = 0, kz_q{i}[kz_j] = 0;",
        ]
    return {
        "COL_ALLOC": "\n".join(alloc),
        "COL_SETUP": "\n".join(setup + widen),
        "COL_FINISH": "\n".join(ind + line for line in _column_finish(w, cols)),
        "COL_TOGETHER": "true",  # the threads' partials meet at a barrier
    }


def _column_fold(cols: list[int]) -> list[str]:
    """After a row: every COLUMN_BLOCK rows, the float partials go into the double totals."""
    fold = " ".join(f"kz_q{i}[kz_j] += kz_c{i}[kz_j]; kz_c{i}[kz_j] = 0;" for i in cols)
    return [
        f"if (++kz_cn == {COLUMN_BLOCK}) {{",
        "    kz_cn = 0;",
        "#pragma omp simd",
        f"    for (int64_t kz_j = 0; kz_j < kz_rowlen; ++kz_j) {{ {fold} }}",
        "}",
    ]


def _column_finish(w, cols: list[int]) -> list[str]:
    """Per column: the sum of the threads' totals and partials (over the row count for a mean), stored."""
    k = w.k
    split = w.rank - k.row_rank
    body = ["int64_t kz_rem = kz_j;"]
    for d in range(w.rank - 1, split - 1, -1):
        body.append(f"const int64_t i{d} = kz_rem % {w.n(d)}; kz_rem /= {w.n(d)};")
    for slot, i in enumerate(cols):
        e = k.body[i]
        ct = w.r.ctype(e.dtype)
        total = f"kz_div_or_nan(kz_t{i}, kz_outer)" if e.op is Op.MEAN else f"kz_t{i}"
        at = f"(kz_t * {len(cols)} + {slot}) * kz_cpad + kz_j"
        body += [
            f"double kz_t{i} = 0;",
            f"for (int kz_t = 0; kz_t < kz_tn; ++kz_t) kz_t{i} += kz_cq[{at}] + (double)kz_cp[{at}];",
            f"const {ct} v{i} = ({ct})({total});",
        ]
    for j, s in enumerate(k.stores):
        if s.value in cols:
            assert all(s.strides[d] == 0 for d in range(split)), "a column sum stored per row"
            body.append(f"const int64_t kz_s{j} = {w.r.dim(s.offset)};")
            body.append(w.store(j, s, list(range(split, w.rank))))
    loop = [
        "kz_barrier(kz_tn);  // every thread's partials are in",
        "int64_t kz_j0, kz_j1;",
        "kz_range(kz_rowlen, kz_tid, kz_tn, kz_j0, kz_j1);",
        "for (int64_t kz_j = kz_j0; kz_j < kz_j1; ++kz_j) {",
    ]
    return loop + ["    " + b for b in body] + ["}"]


__all__ = ["render_columns", "render_row", "widened_loads"]
