"""The CPU backend's code generator: the C++ source of one function per kernel.

The source comes from the shared render table (:class:`~kernelize.codegen.render.Renderer`; the prelude
``templates/cpu_prelude.h`` defines the ``kz_*`` helpers) and the skeletons ``templates/cpu_*.cpp``:

* pointwise kernels run tiles of (one outer index, up to ``BLOCK`` inner elements) across OpenMP threads,
  the inner axis a ``#pragma omp simd`` loop (unit stride when the layout allows; adjacent axes whose
  strides chain are merged first, so a contiguous elementwise kernel is one flat loop; a static inner axis
  whose masks or concat choices change at static bounds is one loop per sub-range, see :func:`inner_pieces`;
  a long sum over a small axis, unrolled into adds, is one loop per term, see :mod:`.cpu_fission`);
* row kernels give each thread whole rows and read a row in passes that stay in cache: the statistics of
  the row's reductions and row ops (simd reductions; independent ones share a pass), then one write pass;
* matmul kernels: a few-row kernel (decode) or torch's GEMM plus the fused epilogue, chosen per call by
  the number of rows (:mod:`kernelize.codegen.cpu_gemv`);
* attention kernels are fused flash-style kernels with an online softmax (:mod:`.cpu_attention`);
* conv kernels (f32) are NHWC implicit GEMMs or depthwise loops with the epilogue fused (:mod:`.cpu_conv`).

16-bit floats are loaded and stored as 16 bits and computed in f32. Static sizes and strides are baked in;
symbolic dims and the thread count are call arguments. :mod:`kernelize.codegen.cpu_build` compiles and
loads the sources (disk-cached), :mod:`kernelize.codegen.cpu_backend` (``CpuBackend``) launches them.

Example:
    >>> source, fn_name = render(kernel)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from kernelize.autokernel.kernels import (
    AttentionKernel,
    Compute,
    ConvChainKernel,
    ConvKernel,
    ExpertsKernel,
    Kernel,
    Load,
    MatmulKernel,
    PointwiseKernel,
    RouterKernel,
    RowKernel,
    Store,
    dispatch,
    row_invariant,
)
from kernelize.codegen import cpu_conv
from kernelize.codegen.cpu_attention import render_attention
from kernelize.codegen.cpu_chunks import (
    CHUNK,
    ChunkStore,
    chunk_store,
    chunked_loop,
    moved_bytes,
    stream_bytes,
)
from kernelize.codegen.cpu_experts import render_experts
from kernelize.codegen.cpu_fission import needed, render_fissioned, sum_chains
from kernelize.codegen.render import Renderer, c_name, closure, deps
from kernelize.codegen.router import render_cpu as render_router
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import REDUCE, Op
from kernelize.ir.shapes import numel

logger = logging.getLogger(__name__)

BLOCK = 8192  # inner elements per pointwise tile
STREAM_MIN = 1 << 20  # a kernel whose static size keeps its outputs smaller never streams them


class CpuRenderer(Renderer):
    """The base C++ table as is; the CPU adds storage types (16-bit floats as bit patterns)."""

    STORAGE = {**Renderer.CTYPE, DType.BF16: "kz_bf16", DType.F16: "kz_f16"}


# ---- kernel normalisation -------------------------------------------------------------------------------
def _accesses(k: Kernel) -> list[Load | Store]:
    return [e for e in k.body if isinstance(e, Load)] + list(k.stores)


def _merge_axes(k: PointwiseKernel | RowKernel) -> PointwiseKernel | RowKernel:
    """Merge adjacent domain axes whose strides chain in every access (``s[d] == s[d+1] * n[d+1]``), or
    whose first has size 1.

    Only within the outer axes and within the row axes, and only without masks, concat or indirect loads
    (whose indexing names axes). A contiguous ``[b, s, h]`` pointwise kernel becomes one flat loop.
    """
    if any(isinstance(e, Compute) and e.op is Op.CONCAT for e in k.body) or any(
        isinstance(e, Load) and (e.mask or e.indirect) for e in k.body
    ):
        return k
    domain = list(k.domain)
    accs = [list(a.strides) for a in _accesses(k)]
    split = len(domain) - k.row_rank  # the first row axis (the domain's rank without rows)
    axis = list(range(len(domain)))  # old axis -> merged axis
    d = len(domain) - 2
    while d >= 0:
        same_group = (d + 1 < split) or (d >= split)
        # an axis of size 1 merges with the next whatever its strides (its index is always 0): a batch of one
        # leaves no index to split off per row, a division when the sizes are arguments (generic.py)
        if same_group and (domain[d] == 1 or all(s[d] == s[d + 1] * domain[d + 1] for s in accs)):
            domain[d : d + 2] = [domain[d] * domain[d + 1]]
            for s in accs:
                s[d : d + 2] = [s[d + 1]]
            axis = [a - 1 if a > d else a for a in axis]
            if d < split:
                split -= 1
        d -= 1
    if len(domain) == len(k.domain):
        return k
    it = iter(accs)
    body = tuple(
        replace(e, strides=tuple(next(it)))
        if isinstance(e, Load)
        else replace(e, arg=tuple(sorted({axis[a] for a in e.arg})))
        if e.op in REDUCE
        else e
        for e in k.body
    )
    stores = tuple(replace(s, strides=tuple(next(it))) for s in k.stores)
    rows = {"row_rank": len(domain) - split} if k.row_rank else {}
    return replace(k, domain=tuple(domain), body=body, stores=stores, **rows)


def _normalize(k: PointwiseKernel | RowKernel) -> PointwiseKernel | RowKernel:
    """Rank-0 domains become ``[1]``; then axes are merged where the layout allows."""
    if not k.domain:
        body = tuple(replace(e, strides=(0,)) if isinstance(e, Load) else e for e in k.body)
        k = replace(k, domain=(1,), body=body, stores=tuple(replace(s, strides=(0,)) for s in k.stores))
    return _merge_axes(k)


def normalized(k: Kernel) -> Kernel:
    """``k`` as its loops are rendered (a pointwise or row kernel with its axes merged, :func:`_normalize`):
    what a kernel whose sizes become arguments is made from, while its strides still show which chain."""
    return dispatch(_NORMALIZED, k, "the cpu generator")(k)


_NORMALIZED = {PointwiseKernel: _normalize, RowKernel: _normalize, MatmulKernel: lambda k: k}


# ---- inner-loop splitting -------------------------------------------------------------------------------
Piece = tuple[int, int]  # a sub-range [start, stop) of the inner axis
MAX_PIECES = 4  # each piece repeats the loop body: past a few, the code grows more than the tests cost
# ... unless every cut is a concat's (its pieces' loads masked at the same bounds): a piece then renders only
# the operand it reads, so the code grows by one load per piece, while one loop with the tests reads every
# operand masked at each element (DenseNet's BN + ReLU over a 5-piece channel concat: 0.27 ms one loop)
MAX_CONCAT_PIECES = 32


def inner_pieces(k: Kernel) -> list[Piece] | None:
    """The sub-ranges of a static inner axis on which every mask and concat choice on that axis is fixed.

    A masked load renders as ``(i2 < 64) ? kz_ld(..) : 0``; unless gcc unrolls the whole loop, the test runs
    as a 64-bit vector compare per element (rotary's bf16 dx kernel, rotate-half of 128-wide heads: 1.9 ms,
    0.9 ms when unrolled). Cut at the bounds, each piece's tests are constants and its loads plain loads or
    literals. ``None`` (one loop with the tests) when a bound is symbolic, no load or concat tests the inner
    index, or there would be more than ``MAX_PIECES`` pieces.

    Example:
        >>> inner_pieces(rotate_half_kernel)  # doctest: +SKIP
        [(0, 64), (64, 128)]
    """
    last = len(k.domain) - 1
    n = k.domain[last]
    if not isinstance(n, int) or n > BLOCK:
        return None
    masks: set = set()
    concats: set = set()
    for e in k.body:
        if isinstance(e, Load):
            masks.update(b for ax, lo, hi in e.mask if ax == last for b in (lo, hi))
        elif e.op is Op.CONCAT and e.arg.axis == last:
            concats.update(e.arg.ends[: len(e.src) - 1])
    cuts = masks | concats
    if not cuts or not all(isinstance(c, int) for c in cuts):
        return None
    points = sorted({0, n} | {c for c in cuts if 0 < c < n})
    pieces = list(zip(points, points[1:]))
    inner = {c for c in masks if 0 < c < n}
    limit = MAX_CONCAT_PIECES if concats and inner <= concats else MAX_PIECES
    return pieces if 1 <= len(pieces) <= limit else None


def concat_pick(e: Compute, piece: Piece) -> int:
    """The operand (a body index) that a concat on the inner axis selects throughout ``piece``."""
    return next((s for s, end in zip(e.src[:-1], e.arg.ends) if piece[0] < end), e.src[-1])


def piece_operands(k: Kernel, piece: Piece) -> Callable[[Load | Compute], Sequence[int]]:
    """The operands an entry reads within ``piece``: a concat on the inner axis reads only the one it
    selects there, anything else :func:`~kernelize.codegen.render.deps`."""
    last = len(k.domain) - 1

    def operands(e: Load | Compute) -> Sequence[int]:
        cut = isinstance(e, Compute) and e.op is Op.CONCAT and e.arg.axis == last
        return [concat_pick(e, piece)] if cut else deps(e)

    return operands


def piece_closure(k: Kernel, roots: Sequence[int], piece: Piece) -> list[int]:
    """:func:`~kernelize.codegen.render.closure` for one piece: a concat on the inner axis needs only the
    operand it selects there, so the loads of the others are not rendered at all."""
    return sorted(needed(k, roots, set(), piece_operands(k, piece)))


# ---- source generation ----------------------------------------------------------------------------------
class _Writer:
    """Renders one kernel's C++ source."""

    def __init__(self, kernel: Kernel, renderer: CpuRenderer) -> None:
        self.k = kernel
        self.r = renderer
        self.rank = len(kernel.domain)
        self.ptr: dict = {}
        params = []
        for n, b in enumerate(kernel.reads):
            self.ptr[b] = f"kz_in{n}"
            params.append(f"const {renderer.storage(b.dtype)}* __restrict kz_in{n}")
        for n, b in enumerate(kernel.writes):
            self.ptr[b] = f"kz_out{n}"
            params.append(f"{renderer.storage(b.dtype)}* __restrict kz_out{n}")
        params += [f"int64_t {renderer.sym(s)}" for s in kernel.symbols]
        self.params = "".join(p + ", " for p in params)
        self.fn_name = c_name(kernel.name)
        self.widened: dict[int, str] = {}  # row kernels: loads read from a per-thread float row
        self.alias: dict[str, str] = {}  # access name -> another access's base plus a constant (bases())

    # -- indexing -------------------------------------------------------------------------------------
    def n(self, axis: int) -> str:
        return self.r.dim(self.k.domain[axis])

    def outer_index(self, outer_axes: int, flat: str, indent: str) -> list[str]:
        """Decompose ``flat`` into the indices ``i0..`` of the first ``outer_axes`` axes."""
        lines = []
        if outer_axes == 0:
            return lines
        if outer_axes == 1:
            return [f"{indent}const int64_t i0 = {flat};"]
        lines.append(f"{indent}int64_t kz_rem = {flat};")
        for d in range(outer_axes - 1, 0, -1):
            lines.append(f"{indent}const int64_t i{d} = kz_rem % {self.n(d)}; kz_rem /= {self.n(d)};")
        lines.append(f"{indent}const int64_t i0 = kz_rem;")
        return lines

    def bases(self, outer_axes: int, indent: str) -> list[str]:
        """Per access, the offset contributed by the outer axes (computed once per tile or row).

        Loads of one buffer with the same outer strides and static offsets share one base, the others
        adding their constant difference (``kz_l0 + 128 + i2``), so gcc can address them from one register
        with a displacement. Rotary's cos / sin gradient kernel (16 heads summed, 32 loads a row) took
        1.14-1.24x the time of the input-gradient kernel beside it with one variable per load, 1.0x
        shared (``perf``, 3000 steps each)."""
        lines = []
        shared: dict[tuple, tuple[str, int]] = {}
        for name, a in self.named_accesses():
            key = (a.buffer, tuple(a.strides[:outer_axes]))
            static = isinstance(a, Load) and isinstance(a.offset, int)  # stores keep their names (cpu_row)
            if static and key in shared:
                first, offset = shared[key]
                delta = a.offset - offset
                self.alias[name] = first if delta == 0 else f"{first} {'+-'[delta < 0]} {abs(delta)}"
                continue
            if static:
                shared[key] = (name, a.offset)
            terms = [self.r.dim(a.offset)] + [
                f"i{d} * {self.r.dim(a.strides[d])}" for d in range(outer_axes) if a.strides[d] != 0
            ]
            lines.append(f"{indent}const int64_t {name} = {' + '.join(terms)};")
        return lines

    def named_accesses(self) -> list[tuple[str, Load | Store]]:
        out = [(f"kz_l{i}", e) for i, e in enumerate(self.k.body) if isinstance(e, Load)]
        return out + [(f"kz_s{i}", s) for i, s in enumerate(self.k.stores)]

    def index(self, base: str, a: Load | Store, loop_axes: Sequence[int]) -> str:
        terms = [self.alias.get(base, base)]
        for d in loop_axes:
            s = a.strides[d]
            if s == 0:
                continue
            terms.append(f"i{d}" if s == 1 else f"i{d} * {self.r.dim(s)}")
        for ind in getattr(a, "indirect", ()):
            terms.append(
                f"kz_wrap((int64_t)v{ind.value}, {self.r.dim(ind.size)}, &kz_err) * {self.r.dim(ind.stride)}"
            )
        return " + ".join(terms)

    # -- values -----------------------------------------------------------------------------------------
    def load(self, i: int, e: Load, loop_axes: Sequence[int], piece: Piece | None = None) -> str:
        if i in self.widened and list(loop_axes) == [self.rank - 1]:  # a row kernel's per-thread float row
            return f"{self.widened[i]}[i{self.rank - 1}]"
        expr = f"kz_ld({self.ptr[e.buffer]}, {self.index(f'kz_l{i}', e, loop_axes)})"
        mask = e.mask
        if piece is not None:  # inside a piece every inner-axis test has one answer
            inner = [(lo, hi) for ax, lo, hi in mask if ax == self.rank - 1]
            if not all(lo <= piece[0] and piece[1] <= hi for lo, hi in inner):
                return self.r.literal(e.other, e.dtype)
            mask = tuple(m for m in mask if m[0] != self.rank - 1)
        if mask:
            # loop indices start at 0, so a lower bound of 0 is no test; written out, it keeps gcc 12 from
            # vectorising a loop with several masked f32 loads (rotary's cos / sin gradients ran scalar)
            cond = " && ".join(
                (f"i{ax} >= {self.r.dim(lo)} && " if lo != 0 else "") + f"i{ax} < {self.r.dim(hi)}"
                for ax, lo, hi in mask
            )
            expr = f"(({cond}) ? {expr} : {self.r.literal(e.other, e.dtype)})"
        return expr

    def value(
        self, i: int, loop_axes: Sequence[int], full: Mapping[int, str], piece: Piece | None = None
    ) -> str:
        """``const T v<i> = ...;`` for an elementwise value, a load, a concat or a row op's full result.

        ``piece``: the inner-axis range being rendered when the inner loop is split (:func:`inner_pieces`).
        """
        e = self.k.body[i]
        ct = self.r.ctype(e.dtype)
        if isinstance(e, Load):
            expr = self.load(i, e, loop_axes, piece)
        elif i in full:
            expr = full[i]
        elif e.op is Op.CONCAT and piece is not None and e.arg.axis == self.rank - 1:
            expr = f"v{concat_pick(e, piece)}"
        elif e.op is Op.CONCAT:
            expr = self.r.concat(e, f"i{e.arg.axis}")
        else:
            expr = self.r.expr(e, [f"v{s}" for s in e.src])
        return f"const {ct} v{i} = {expr};"

    def store(self, s_idx: int, s: Store, loop_axes: Sequence[int]) -> str:
        return f"kz_st({self.ptr[s.buffer]}, {self.index(f'kz_s{s_idx}', s, loop_axes)}, v{s.value});"

    # -- kernels ------------------------------------------------------------------------------------------
    def pointwise(self) -> str:
        k, last = self.k, self.rank - 1
        ind = " " * 8
        outer = self.outer_index(last, "kz_o", ind) + self.bases(last, ind)
        static_inner = isinstance(k.domain[last], int) and k.domain[last] <= BLOCK
        roots = [s.value for s in k.stores]
        pieces = inner_pieces(k)
        chains = sum_chains(k, whole_row=pieces is not None)
        chunked, stream = self.chunk_plan(last)
        streamed = chunked if stream and not chains else []
        j0, j1 = ("0", str(k.domain[last])) if static_inner else ("kz_j0", "kz_j1")
        if chains:  # long sums: a loop per term (cpu_fission)
            cuts = [(str(p[0]), str(p[1]), p, piece_operands(k, p)) for p in pieces or ()]
            lines = render_fissioned(self, cuts or [(j0, j1, None, None)], chains)
            loops = ["\n".join(x if x.startswith("#") else " " * 12 + x for x in lines)]
        elif pieces is not None:
            loops = [self.simd_loop(str(p[0]), str(p[1]), piece_closure(k, roots, p), p) for p in pieces]
        else:
            loops = [self.simd_loop(j0, j1, closure(k, roots, [False] * len(k.body)))]
        return fill(
            load_template("cpu_pointwise.cpp"),
            PRELUDE=load_template("cpu_prelude.h"),
            NAME=self.fn_name,
            DOMAIN=str(list(map(str, k.domain))),
            BLOCK=str(BLOCK),
            PARAMS=self.params,
            INNER=self.n(last),
            OUTER=self.r.dim(numel(k.domain[:last])),
            **element_work(k),
            STREAM_BYTES=str(moved_bytes(k, streamed)),
            OUTER_INDEX="\n".join(outer),
            LOOPS="\n".join(loops),
        )

    def simd_loop(self, j0: str, j1: str, values: Sequence[int], piece: Piece | None = None) -> str:
        """The ``#pragma omp simd`` loop over the inner axis from ``j0`` to ``j1``: ``values``, the stores."""
        last, ind = self.rank - 1, " " * 12
        body = [self.value(i, [last], {}, piece) for i in values]
        short = j0.isdigit() and j1.isdigit() and int(j1) - int(j0) < CHUNK  # no whole chunk to stream
        chunked, stream = self.chunk_plan(last, short=short)
        slots = {c.slot for c in chunked}
        rest = [self.store(n, s, [last]) for n, s in enumerate(self.k.stores) if n not in slots]
        lines = chunked_loop(f"i{last}", j0, j1, body, chunked, rest, stream=stream)
        return "\n".join(line if line.startswith("#") else ind + line for line in lines)

    def chunk_plan(
        self,
        axis: int,
        stores: Sequence[tuple[int, Store]] | None = None,
        short: bool = False,
        bf16_chunks: bool = True,
    ) -> tuple[list[ChunkStore], bool]:
        """The stores (of ``stores``, else all of the kernel's) a simd loop over ``axis`` writes through float
        chunks, and whether it has a streamed loop for them (taken when the kernel streams its outputs).
        Streamed: every contiguous f32 / bf16 store, unless the loop is ``short`` (no whole chunk) or the
        kernel's static size keeps them under :data:`STREAM_MIN` bytes. Else the bf16 ones if
        ``bf16_chunks`` (their conversion is faster in chunks)."""
        pairs = enumerate(self.k.stores) if stores is None else stores
        chunked = [c for n, s in pairs if (c := chunk_store(self, n, s, axis)) is not None]
        size = numel(self.k.domain)
        small = isinstance(size, int) and size * stream_bytes(chunked) < STREAM_MIN
        if chunked and not short and not small:
            return chunked, True
        return [c for c in chunked if c.bf16 and bf16_chunks], False

    def matmul(self) -> str:
        from kernelize.codegen.cpu_gemv import render_gemv

        return render_gemv(self)

    def row(self) -> str:
        from kernelize.codegen.cpu_row import render_columns, render_row, row_stream_bytes, widened_loads

        k = self.k
        self.widened = widened_loads(self)
        split = self.rank - k.row_rank
        inv = row_invariant(k)
        ind = " " * 8
        outer = self.outer_index(split, "kz_o", ind) + self.bases(split, ind)
        return fill(
            load_template("cpu_row.cpp"),
            PRELUDE=load_template("cpu_prelude.h"),
            NAME=self.fn_name,
            DOMAIN=str(list(map(str, k.domain))),
            ROW_RANK=str(k.row_rank),
            PARAMS=self.params,
            OUTER=self.r.dim(numel(k.domain[:split])),
            ROWLEN=self.r.dim(numel(k.domain[split:])),
            **element_work(k),
            OUTER_INDEX="\n".join(outer),
            STREAM_BYTES=row_stream_bytes(self, inv),
            ROW="\n".join(ind + line for line in render_row(self, inv)),
            **render_columns(self),
        )


def element_work(kernel: Kernel) -> dict[str, str]:
    """The template holes ``FLOPS`` and ``BYTES``: a pointwise or row kernel's operations and bytes moved per
    element of its domain, from which ``kz_team_work`` picks the team (``cpu_prelude.h``, "grain"). Masked
    loads (a concat's or pad's pieces) read one piece per element: they count once."""
    loads = [e for e in kernel.body if isinstance(e, Load)]
    masked = [e.buffer.dtype.itemsize for e in loads if e.mask]
    moved = sum(e.buffer.dtype.itemsize for e in loads if not e.mask) + max(masked, default=0)
    moved += sum(s.buffer.dtype.itemsize for s in kernel.stores)
    return {"FLOPS": str(sum(isinstance(e, Compute) for e in kernel.body)), "BYTES": str(moved)}


def _render_pointwise(kernel: PointwiseKernel, r: CpuRenderer) -> tuple[str, str]:
    w = _Writer(_normalize(kernel), r)
    return w.pointwise(), w.fn_name


def _render_row(kernel: RowKernel, r: CpuRenderer) -> tuple[str, str]:
    w = _Writer(_normalize(kernel), r)
    return w.row(), w.fn_name


def _render_matmul(kernel: MatmulKernel, r: CpuRenderer) -> tuple[str, str]:
    w = _Writer(kernel, r)
    return w.matmul(), w.fn_name


def _render_conv(kernel: ConvKernel, r: CpuRenderer) -> tuple[str, str]:
    if cpu_conv.algorithm(kernel) is None:
        raise ValueError(f"kernel {kernel.name} is a library call: the runtime runs those with torch")
    return cpu_conv.render(kernel, r)


RENDER: dict[type, Callable[[Kernel, CpuRenderer], tuple[str, str]]] = {
    PointwiseKernel: _render_pointwise,
    RowKernel: _render_row,
    MatmulKernel: _render_matmul,
    AttentionKernel: lambda k, r: render_attention(k, load_template("cpu_prelude.h")),
    ExpertsKernel: lambda k, r: render_experts(k, load_template("cpu_prelude.h")),
    RouterKernel: lambda k, r: render_router(k, r, load_template("cpu_prelude.h")),
    ConvKernel: _render_conv,
    ConvChainKernel: cpu_conv.render_chain,
}


def render(kernel: Kernel, renderer: CpuRenderer | None = None) -> tuple[str, str]:
    """The C++ source of ``kernel`` and its exported function name."""
    return dispatch(RENDER, kernel, "the cpu generator")(kernel, renderer or CpuRenderer())


__all__ = ["BLOCK", "RENDER", "CpuRenderer", "inner_pieces", "normalized", "render"]
