"""The CPU backend: one C++ function per kernel, compiled with the system compiler and called via ctypes.

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
symbolic dims and the thread count (``torch.get_num_threads()``) are call arguments. Shared objects go
through the disk cache (:mod:`kernelize.runtime.diskcache`), keyed by source, compiler version, flags and
host CPU.

Example:
    >>> ck = CpuBackend().compile(kernel)  # doctest: +SKIP
    >>> ck.launch([x, w], [y], {"batch": 4})  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from kernelize.autokernel.kernels import (
    AttentionKernel,
    Compute,
    ConvChainKernel,
    ConvKernel,
    Kernel,
    LibraryKernel,
    Load,
    MatmulKernel,
    PointwiseKernel,
    RowKernel,
    Store,
    dispatch,
    row_invariant,
)
from kernelize.codegen import cpu_conv
from kernelize.codegen.cpu_attention import ARGTYPES as ATTENTION_ARGTYPES
from kernelize.codegen.cpu_attention import attention_launcher, render_attention
from kernelize.codegen.cpu_chunks import (
    CHUNK,
    ChunkStore,
    chunk_store,
    chunked_loop,
    moved_bytes,
    stream_bytes,
)
from kernelize.codegen.cpu_fission import needed, render_fissioned, sum_chains
from kernelize.codegen.render import Renderer, c_name, closure, deps, gather_error
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import REDUCE, Op
from kernelize.ir.shapes import numel
from kernelize.runtime.backend import Backend, CCall, CompiledKernel, KernelCompileError
from kernelize.runtime.diskcache import get_or_build

logger = logging.getLogger(__name__)

BLOCK = 8192  # inner elements per pointwise tile
PARALLEL_MIN = 32768  # below this many elements one thread beats waking the team
# The flags naming this CPU's instructions, by ``platform.machine()``: ``-march=native`` on x86 (with zmm
# registers for gcc's vector loops), ``-mcpu=native`` on Arm (Linux says aarch64, macOS arm64); an unknown
# machine gets neither (baseline instructions). Arm compilers reject the x86 flags.
NATIVE_FLAGS = {
    "x86_64": ("-march=native", "-mprefer-vector-width=512"),
    "AMD64": ("-march=native", "-mprefer-vector-width=512"),
    "aarch64": ("-mcpu=native",),
    "arm64": ("-mcpu=native",),
}


def platform_flags(
    machine: str | None = None, system: str | None = None, compiler_version: str = ""
) -> tuple[str, ...]:
    """The compiler flags for a host (``platform.machine()`` / ``platform.system()`` unless given) and a
    compiler (its ``--version`` line): :data:`NATIVE_FLAGS`, and ``-fopenmp`` except for Apple clang on
    macOS, which has no OpenMP (kernels then run on the calling thread; cpu_prelude.h stubs the calls).

    Example:
        >>> platform_flags("aarch64", "Linux")[:3]
        ('-O3', '-mcpu=native', '-fopenmp')
    """
    machine = platform.machine() if machine is None else machine
    system = platform.system() if system is None else system
    apple_clang = system == "Darwin" and "Apple clang" in compiler_version
    return (
        "-O3",
        *NATIVE_FLAGS.get(machine, ()),
        *(() if apple_clang else ("-fopenmp",)),
        "-fno-math-errno",
        "-fno-trapping-math",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
    )


DEFAULT_FLAGS = platform_flags()  # this host's, for a compiler with OpenMP


class CompilerNotFoundError(RuntimeError):
    """No C++ compiler was found for the CPU backend."""


class CpuRenderer(Renderer):
    """The base C++ table as is; the CPU adds storage types (16-bit floats as bit patterns)."""

    STORAGE = {**Renderer.CTYPE, DType.BF16: "kz_bf16", DType.F16: "kz_f16"}


# ---- kernel normalisation -------------------------------------------------------------------------------
def _accesses(k: Kernel) -> list[Load | Store]:
    return [e for e in k.body if isinstance(e, Load)] + list(k.stores)


def _merge_axes(k: PointwiseKernel | RowKernel) -> PointwiseKernel | RowKernel:
    """Merge adjacent domain axes whose strides chain in every access (``s[d] == s[d+1] * n[d+1]``).

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
        if same_group and all(s[d] == s[d + 1] * domain[d + 1] for s in accs):
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


# ---- inner-loop splitting -------------------------------------------------------------------------------
Piece = tuple[int, int]  # a sub-range [start, stop) of the inner axis
MAX_PIECES = 4  # each piece repeats the loop body: past a few, the code grows more than the tests cost


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
    cuts: set = set()
    for e in k.body:
        if isinstance(e, Load):
            cuts.update(b for ax, lo, hi in e.mask if ax == last for b in (lo, hi))
        elif e.op is Op.CONCAT and e.arg.axis == last:
            cuts.update(e.arg.ends[: len(e.src) - 1])
    if not cuts or not all(isinstance(c, int) for c in cuts):
        return None
    points = sorted({0, n} | {c for c in cuts if 0 < c < n})
    pieces = list(zip(points, points[1:]))
    return pieces if 1 <= len(pieces) <= MAX_PIECES else None


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
            PARALLEL_MIN=str(PARALLEL_MIN),
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
            PARALLEL_MIN=str(PARALLEL_MIN),
            OUTER_INDEX="\n".join(outer),
            STREAM_BYTES=row_stream_bytes(self, inv),
            ROW="\n".join(ind + line for line in render_row(self, inv)),
            **render_columns(self),
        )


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
    ConvKernel: _render_conv,
    ConvChainKernel: cpu_conv.render_chain,
}


def render(kernel: Kernel, renderer: CpuRenderer | None = None) -> tuple[str, str]:
    """The C++ source of ``kernel`` and its exported function name."""
    return dispatch(RENDER, kernel, "the cpu generator")(kernel, renderer or CpuRenderer())


# ---- compiler and loading -------------------------------------------------------------------------------
@functools.cache
def compiler() -> tuple[str, str]:
    """The C++ compiler (``$KERNELIZE_CXX``, else ``$CXX``, else g++ / c++ / clang++) and its version."""
    names = [os.environ.get("KERNELIZE_CXX"), os.environ.get("CXX"), "g++", "c++", "clang++"]
    for name in filter(None, names):
        path = shutil.which(name)
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
            return path, out.stdout.splitlines()[0] if out.stdout else name
    raise CompilerNotFoundError(
        "the cpu backend needs a C++ compiler with OpenMP and none was found (looked for $KERNELIZE_CXX, "
        "$CXX, g++, c++, clang++); install one (e.g. `apt-get install g++`) or set KERNELIZE_CXX to its path"
    )


@functools.cache
def _host_id() -> str:
    """What -march / -mcpu=native depends on: machine and CPU flags (x86: model name and flags; Arm: Features
    and the CPU's implementer and part), so a cache shared by different hosts stays safe."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name", "Features", "CPU implementer", "CPU part")):
                flags += line
                if line.startswith(("flags", "CPU part")):
                    break
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def flags() -> tuple[str, ...]:
    """Compiler flags: ``$KERNELIZE_CPU_FLAGS`` (shell syntax) or :func:`platform_flags` for this host and
    :func:`compiler`."""
    env = os.environ.get("KERNELIZE_CPU_FLAGS")
    return tuple(shlex.split(env)) if env else platform_flags(compiler_version=compiler()[1])


_LOADED: dict[str, ctypes.CDLL] = {}
_LOCK = threading.Lock()


def build_shared_object(source: str, kernel_name: str = "kernel") -> Path:
    """Compile ``source`` to a shared object through the disk cache; returns its path."""
    cxx, version = compiler()
    opts = flags()
    parts = (source, version, " ".join(opts), _host_id())

    def build(out: Path) -> None:
        cmd = [cxx, *opts, "-x", "c++", "-", "-o", str(out)]
        proc = subprocess.run(cmd, input=source, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            from kernelize.runtime.diskcache import cache_key

            log = f"$ {' '.join(cmd)}\n{proc.stderr}"
            raise KernelCompileError(kernel_name, cache_key(parts), log, source, "cpu")

    return get_or_build(parts, build, ".so")


# One deadline for every kernel library: after a parallel region whose workers started late (other processes
# hold the cores), regions run on one thread until then (see "thread teams under load" in cpu_prelude.h).
TEAM_DEADLINE = ctypes.c_int64(0)
STREAM_MIN = 1 << 20  # a kernel whose static size keeps its outputs smaller never streams them


def stream_threshold() -> int:
    """Bytes moved (outputs written plus inputs read at full size, :func:`cpu_chunks.moved_bytes`) from which
    a pointwise or row kernel writes its contiguous outputs with non-temporal stores (see "non-temporal
    stores" in cpu_prelude.h): ``$KERNELIZE_CPU_NT_BYTES`` (a byte count, or ``off``), else half the
    last-level cache (from sysfs; 16 MiB when unreadable). Measured on LayerNorm's forward, 2048 x 2048 f32
    (16 MiB out; 32 MiB L3), 2 threads: 1.0 -> 0.8 ms; a small output, which the cache keeps for the next op,
    was slower streamed (2 MiB: 0.25 -> 0.31 ms)."""
    env = os.environ.get("KERNELIZE_CPU_NT_BYTES", "").strip().lower()
    if env == "off":
        return 2**63 - 1
    if env:
        try:
            return max(int(env), 1)
        except ValueError:
            raise ValueError(f"KERNELIZE_CPU_NT_BYTES={env!r}: expected a byte count or `off`") from None
    return _last_level_cache() // 2


def _last_level_cache() -> int:
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KkMm")
        if digits.isdigit():
            sizes[level] = int(digits) * scale
    return sizes[max(sizes)] if sizes else 32 << 20


# Shared by every kernel library, like the deadline: tests and tools may change it at run time.
NT_BYTES = ctypes.c_int64(stream_threshold())


def load(path: Path) -> ctypes.CDLL:
    with _LOCK:
        lib = _LOADED.get(str(path))
        if lib is None:
            lib = _LOADED[str(path)] = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
            for name, value in (("kz_bind_team_state", TEAM_DEADLINE), ("kz_bind_nt_bytes", NT_BYTES)):
                bind = getattr(lib, name, None)
                if bind is not None:
                    bind.argtypes = [ctypes.POINTER(ctypes.c_int64)]
                    bind(ctypes.byref(value))
        return lib


def _launcher(fn, kernel: Kernel):
    symbols = kernel.symbols
    n_reads, n_writes = len(kernel.reads), len(kernel.writes)
    get_threads = torch.get_num_threads

    def launch(
        reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]
    ) -> None:
        assert len(reads) == n_reads and len(writes) == n_writes, "launch arity"
        rc = fn(
            *[t.data_ptr() for t in reads],
            *[t.data_ptr() for t in writes],
            *[sizes[s] for s in symbols],
            get_threads(),
        )
        if rc:
            raise IndexError(gather_error(kernel, "cpu"))

    return launch


def _c_caller(fn, kernel: Kernel) -> Callable[..., CCall]:
    """``c_call`` of a kernel launched by :func:`_launcher`: the same arguments, for ``kz_replay``."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    symbols, error = kernel.symbols, gather_error(kernel, "cpu")

    def c_call(reads, writes, sizes: Mapping[str, int]) -> CCall:
        ptrs = tuple(0 if t is None else t.data_ptr() for t in (*reads, *writes))
        return CCall(address, ptrs + tuple(sizes[s] for s in symbols), error, raises=IndexError)

    return c_call


class CpuBackend(Backend):
    """Generates, compiles (disk-cached) and launches C++ kernels on CPU tensors.

    Example:
        >>> ck = CpuBackend().compile(kernel)  # doctest: +SKIP
        >>> ck.launch(reads, writes, sizes)  # doctest: +SKIP
    """

    name = "cpu"

    def __init__(self, renderer: CpuRenderer | None = None) -> None:
        self.renderer = renderer or CpuRenderer()

    @property
    def plan_settings(self):
        """Matmuls are MATMUL kernels with the epilogue fused, and matmuls sharing their left operand share a
        kernel (``silu(x @ Wg) * (x @ Wu)``): :meth:`compile` runs them as the few-row kernel for up to
        ``FEW_ROWS`` rows and as torch's GEMM plus the epilogue kernel above (see ``cpu_gemv``). Column sums
        over leading axes (weight gradients) accumulate inside the row kernel over the same rows: each thread
        adds its rows into partial sums in the write pass, so the summed operand (``dy * xhat``) is never
        written; other column sums go to torch (a generated kernel walking each column with a row stride
        was measured 6x slower than torch's blocked partial sums on 2048x2048 f32)."""
        from kernelize.autokernel.plan import PlanSettings

        return PlanSettings(
            matmul="generate",
            merge_matmuls=True,
            column_reduce="accumulate",
            channels_last=True,
            conv_chains=cpu_conv.chains_enabled(),
        )

    def device_ok(self, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    def generates(self, kernel: Kernel) -> bool:
        """Everything but LIBRARY kernels, and the convolutions :func:`cpu_conv.algorithm` takes."""
        return dispatch(_KINDS, kernel, "the cpu backend").generates(kernel)

    def render(self, kernel: Kernel) -> str:
        """The C++ source :meth:`compile` builds (a MATMUL kernel: its few-row function, then the epilogue
        kernel run after torch's GEMM)."""
        return dispatch(_KINDS, kernel, "the cpu backend").source(kernel, self.renderer)

    def compile(self, kernel: Kernel) -> CompiledKernel:
        return self.compile_many([kernel])[0]

    def compile_many(self, kernels: Sequence[Kernel], progress: Callable[[int], None] | None = None):
        """Compile ``kernels`` as a few translation units (one per core) built in parallel.

        A compiler run costs ~0.3 s of start-up and prelude parsing before any kernel code, so dozens of
        kernels in one unit build many times faster than one unit each (a matmul kernel brings its few-row
        function and its epilogue); units of one graph share one cache entry, so a warm start is one lookup
        per unit. Kernels whose source differs only in their name (the same block in each of a
        transformer's layers: ViT-base has 159 kernels, 15 distinct) are compiled once and share the
        function. Kernels whose kind builds alone (attention) get a unit of their own each. ``progress(n)``
        is called as kernels finish.
        """
        kinds = [dispatch(_KINDS, k, "the cpu backend") for k in kernels]
        parts = {i: kind.parts(k) for i, (k, kind) in enumerate(zip(kernels, kinds, strict=True))}
        rendered = {p.name: render(p, self.renderer) for ps in parts.values() for p, _ in ps}
        assert len({name for _, name in rendered.values()}) == len(rendered), "kernel names collide"
        together = [i for i, kind in enumerate(kinds) if not kind.alone]
        groups = same_source_groups(together, parts, rendered)
        units = [[i] for i, kind in enumerate(kinds) if kind.alone]
        units += unit_chunks(
            list(groups), [sum(len(rendered[k.name][0]) for k, _ in parts[i]) for i in groups]
        )
        groups.update({i: [i] for i, kind in enumerate(kinds) if kind.alone})
        shared = [load_template(name) for name in ("cpu_prelude.h", "cpu_gemv.h", "cpu_conv.h")]
        out: list[CompiledKernel | None] = [None] * len(kernels)

        def build(chunk: list[int]) -> tuple[list[int], Path]:
            sources = [rendered[k.name][0] for i in chunk for k, _ in parts[i]]
            what = kernels[chunk[0]].name if len(chunk) == 1 else f"{len(chunk)} kernels"
            return chunk, build_shared_object(_unit_source(sources, shared), what)

        with ThreadPoolExecutor(max_workers=max(1, len(units))) as pool:
            for chunk, path in pool.map(build, units):
                lib = load(path)
                for rep in chunk:
                    fns = [lib[rendered[k.name][1]] for k, _ in parts[rep]]
                    for i in groups[rep]:
                        out[i] = kinds[i].assemble(self.name, kernels[i], parts[i], fns, rendered)
                    if progress is not None:
                        progress(len(groups[rep]))
        return out


# ---- per kind: what a kernel compiles to, and how its functions become one CompiledKernel -----------------
Parts = list[tuple[Kernel, tuple]]  # the kernels a kernel's functions are rendered from, with temporaries


class _LoopKind:
    """POINTWISE and ROW kernels: one generated function, launched with (reads, writes, sizes, threads)."""

    alone = False  # built in a translation unit of its own

    def generates(self, kernel: Kernel) -> bool:
        return True

    def parts(self, kernel: Kernel) -> Parts:
        return [(kernel, ())]

    def source(self, kernel: Kernel, renderer: CpuRenderer) -> str:
        return render(kernel, renderer)[0]

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        fn = _typed(fns[0], kernel)
        source = rendered[kernel.name][0]
        return CompiledKernel(
            kernel.name, backend, source, _launcher(fn, kernel), kernel, c_call=_c_caller(fn, kernel)
        )


class _AttentionKind(_LoopKind):
    """ATTENTION kernels: a template with its own arguments (operand strides), built alone."""

    alone = True

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        fn = fns[0]
        fn.restype, fn.argtypes = ctypes.c_int, ATTENTION_ARGTYPES
        launch = attention_launcher(fn, kernel)
        return CompiledKernel(kernel.name, backend, rendered[kernel.name][0], launch, kernel)


class _ConvKind(_LoopKind):
    """CONV kernels: generated when :func:`cpu_conv.algorithm` takes them, else run by the library."""

    def generates(self, kernel: Kernel) -> bool:
        return cpu_conv.algorithm(kernel) is not None

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        call = cpu_conv.ConvCall(fns[0], kernel)
        source = rendered[kernel.name][0]
        return CompiledKernel(kernel.name, backend, source, call.launch, kernel, call.fresh, call.c_call)


class _ConvChainKind(_LoopKind):
    """CONV_CHAIN kernels: the stages as one generated function (``kz_conv_chain``)."""

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        chain = cpu_conv.ChainCall(fns[0], kernel)
        source = rendered[kernel.name][0]
        return CompiledKernel(kernel.name, backend, source, chain.launch, kernel, c_call=chain.c_call)


class _LibraryKind(_LoopKind):
    """LIBRARY kernels: the runtime runs them with torch."""

    def generates(self, kernel: Kernel) -> bool:
        return False


class _MatmulKind(_LoopKind):
    """MATMUL kernels: the few-row function (up to ``FEW_ROWS`` rows) and the epilogue kernel run after
    torch's GEMM (more rows). A matmul whose row count is static and above ``FEW_ROWS`` never runs its
    few-row function, so only the epilogue is built (the few-row functions were two thirds of ViT-base's
    and ConvNeXt's C++)."""

    def parts(self, kernel: Kernel) -> Parts:
        if _static_rows(kernel) is not None:
            return [_epilogue_of(kernel)]
        return [(kernel, ()), _epilogue_of(kernel)]

    def source(self, kernel: Kernel, renderer: CpuRenderer) -> str:
        epi, _ = _epilogue_of(kernel)
        return _matmul_source(render(kernel, renderer)[0], render(epi, renderer)[0])

    def assemble(self, backend: str, kernel: Kernel, parts: Parts, fns: list, rendered) -> CompiledKernel:
        built = [
            (rendered[k.name][0], _launcher(_typed(fn, k), k)) for fn, (k, _) in zip(fns, parts, strict=True)
        ]
        epi, temps = parts[-1]
        few, few_call = (
            (built[0], _c_caller(fns[0], kernel)) if len(parts) == 2 else (_never_few(kernel), None)
        )
        return _matmul_kernel(backend, kernel, few, built[-1], epi, temps, few_call)


_KINDS = {
    PointwiseKernel: _LoopKind(),
    RowKernel: _LoopKind(),
    MatmulKernel: _MatmulKind(),
    AttentionKernel: _AttentionKind(),
    ConvKernel: _ConvKind(),
    ConvChainKernel: _ConvChainKind(),
    LibraryKernel: _LibraryKind(),
}


def _typed(fn, kernel: Kernel):
    """``fn`` with the argument types of a loop kernel's function: buffers, sizes, the thread count."""
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * (len(kernel.reads) + len(kernel.writes))
        + [ctypes.c_int64] * len(kernel.symbols)
        + [ctypes.c_int]
    )
    return fn


def _parts(kernel: Kernel) -> Parts:
    """The kernels ``kernel``'s functions are rendered from (a matmul: its few-row function and epilogue)."""
    return dispatch(_KINDS, kernel, "the cpu backend").parts(kernel)


def _static_rows(kernel: Kernel) -> int | None:
    """A matmul kernel's row count when it is static and too large for the few-row path, else None."""
    from kernelize.autokernel.matmul import FEW_ROWS

    dims = kernel.domain[:-1]
    if not all(isinstance(d, int) for d in dims) or math.prod(dims) <= FEW_ROWS:
        return None
    return math.prod(dims)


def _never_few(kernel: Kernel) -> tuple[str, Callable]:
    """The few-row half of a matmul kernel that always has more rows (never called; said so if it is)."""
    rows = _static_rows(kernel)

    def few(reads, writes, sizes) -> None:
        raise AssertionError(f"cpu kernel {kernel.name}: the few-row path of a kernel of {rows} rows")

    return f"// always {rows} rows: no few-row function", few


_NAME_HOLE = "KZ_SAME_SOURCE_NAME"


def same_source_groups(
    order: Sequence[int], parts: Mapping[int, list[tuple[Kernel, tuple]]], rendered: Mapping[str, tuple]
) -> dict[int, list[int]]:
    """The kernels of ``order`` grouped by their parts' source with each function's own name blanked
    out: ``{first index: [indices]}``, in order. A kernel's name is in its source only as its entry
    point's C name (``kz_<name>``, an epilogue ``kz_<name>_epilogue``), so two kernels of one group are the
    same text up to that name and any one's compiled function serves them all."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i in order:
        key = tuple(_blank_name(*rendered[k.name]) for k, _ in parts[i])
        groups.setdefault(key, []).append(i)
    return {members[0]: members for members in groups.values()}


def _blank_name(src: str, fn: str) -> str:
    """``src`` with the identifier ``fn`` blanked out; ``src`` itself (a group of its own) when ``fn`` also
    appears inside a longer identifier. A split, not a regex: a transformer's sources are ~6 MB."""
    assert _NAME_HOLE not in src
    pieces = src.split(fn)
    for before, after in zip(pieces, pieces[1:]):
        if (before and (before[-1].isalnum() or before[-1] == "_")) or (after and after[0].isalnum()):
            return src
    return _NAME_HOLE.join(pieces)


def unit_chunks(items: Sequence[int], sizes: Sequence[int], most: int = 4) -> list[list[int]]:
    """``items`` split into up to one unit per core (at most ``most``), balanced by source size (largest
    first, each to the smallest unit); each unit keeps the items' order so its source is deterministic."""
    units = max(1, min(os.cpu_count() or 1, len(items), most))
    loads = [0] * units
    chunks: list[list[int]] = [[] for _ in range(units)]
    for pos in sorted(range(len(items)), key=lambda p: -sizes[p]):
        u = loads.index(min(loads))
        loads[u] += sizes[pos]
        chunks[u].append(pos)
    return [[items[p] for p in sorted(c)] for c in chunks if c]


def _unit_source(sources: Sequence[str], shared: Sequence[str]) -> str:
    """One translation unit of ``sources``: each shared header once at the top, not in every kernel."""
    head = "".join(text for text in shared if any(text in src for src in sources))
    body = []
    for src in sources:
        for text in shared:
            src = src.replace(text, "")
        body.append(src)
    return head + "\n".join(body)


def _epilogue_of(kernel: Kernel) -> tuple[Kernel, tuple]:
    """The pointwise kernel a matmul kernel runs after torch's GEMM (its own function name), and the
    temporaries it reads."""
    from kernelize.autokernel.matmul import epilogue_kernel

    epi, temps = epilogue_kernel(kernel)
    return replace(epi, name=f"{kernel.name}_epilogue"), temps


def _matmul_kernel(
    backend: str, kernel: Kernel, few_built, epi_built, epi: Kernel, temps, few_call=None
) -> CompiledKernel:
    """A matmul kernel: up to FEW_ROWS rows the generated few-row function (``few_call``: its C call, for
    replay); more, torch's GEMM then the epilogue function."""
    from kernelize.autokernel.matmul import FEW_ROWS, rows_of
    from kernelize.codegen.cpu_gemv import direct_gemm, library_matmuls, run_direct

    (source, few), (epi_source, epi_launch) = few_built, epi_built
    slots = [(b in temps, temps.index(b) if b in temps else kernel.reads.index(b)) for b in epi.reads]
    packs: dict = {}  # oneDNN-packed constant weights of this kernel, made on first use

    def launch(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]):
        if rows_of(kernel, sizes) <= FEW_ROWS:
            return few(reads, writes, sizes)
        mms = library_matmuls(kernel, reads, sizes, packs)
        epi_launch([mms[i] if t else reads[i] for t, i in slots], writes, sizes)

    direct = direct_gemm(kernel)

    def fresh(reads: Sequence[torch.Tensor], sizes: Mapping[str, int]) -> list[torch.Tensor] | None:
        if direct is None or rows_of(kernel, sizes) <= FEW_ROWS:
            return None
        return run_direct(kernel, direct, reads, sizes, packs)

    def c_call(reads, writes, sizes: Mapping[str, int]) -> CCall | None:
        return few_call(reads, writes, sizes) if rows_of(kernel, sizes) <= FEW_ROWS else None

    return CompiledKernel(
        kernel.name,
        backend,
        _matmul_source(source, epi_source),
        launch,
        kernel,
        fresh if direct is not None else None,
        c_call if few_call is not None else None,
    )


def _matmul_source(few_rows: str, epilogue: str) -> str:
    """The source of a MATMUL kernel as it reads: the few-row function, then the epilogue kernel."""
    from kernelize.autokernel.matmul import FEW_ROWS

    return f"{few_rows}\n// more than {FEW_ROWS} rows: torch's matmul, then\n{epilogue}"


__all__ = [
    "BLOCK",
    "CompilerNotFoundError",
    "CpuBackend",
    "CpuRenderer",
    "build_shared_object",
    "compiler",
    "platform_flags",
    "render",
]
