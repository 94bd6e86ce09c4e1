"""The CUDA C backend: kernel specs -> CUDA C from ``templates/cuda_*.cu`` -> NVRTC cubin -> driver launch.

Each :class:`~kernelize.autokernel.kernels.Kernel` kind has a template with ``$NAME$`` holes:

* ``POINTWISE`` -> ``cuda_pointwise.cu``: a grid-stride loop; operands are read through compile-time
  strides (broadcast axes have stride 0, symbolic sizes are ``int64_t s_<name>`` arguments), gathers are
  indirect loads, pads and concats are masked loads.
* ``ROW`` -> ``cuda_row.cu``: one block per row. Every reduction or row op of the body is one pass over the
  row (``cuda_row_pass.cu``) feeding an accumulator from ``cuda_prelude.cuh`` (online max/sum for
  softmax and log-softmax, Welford for layernorm, fp32 sum of squares for rmsnorm, sum/prod/max/min/arg
  for reductions), combined across the block (warp shuffles, then shared memory); a last pass computes
  the full values (the normalized row, its fused epilogue) and stores them. A residual add before a norm
  is simply part of the body, so it is fused for free.
* ``ATTENTION`` -> ``cuda_attention.cu`` (:mod:`.cuda_attention`): a warp per query row with an online
  softmax over 32-key steps; decode shapes split the keys and combine the partials.
* ``EXPERTS`` -> ``cuda_experts.cu`` (:mod:`.cuda_experts`): the pairs sorted by expert and padded to
  32-row blocks (torch on the device), two shared-memory tiled grouped GEMMs (gate|up -> act * up, then
  down with the routing weight in the epilogue) and a sum over K.
* ``MATMUL`` -> ``cuda_matmul.cu``: a 64x64 shared-memory tiled matmul with the elementwise epilogue
  (bias, activation) applied to the accumulator before the one store.

The fused scalar body comes from :class:`CudaRenderer`, the shared C++ render table of
:mod:`kernelize.codegen.render` (the prelude defines its ``kz_*`` helpers for device code), so this
backend and the Triton one render the same ops from one table.

Example:
    >>> src = CudaBackend().render(kernel)  # doctest: +SKIP  (no GPU needed)
    >>> ck = CudaBackend(arch="sm_90").compile(kernel)  # doctest: +SKIP  (NVRTC, cached cubin)
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from kernelize.autokernel.kernels import (
    AttentionKernel,
    Compute,
    ExpertsKernel,
    Kernel,
    Load,
    LoopKernel,
    MatmulKernel,
    PointwiseKernel,
    RouterKernel,
    RowKernel,
    SplitKKernel,
    Store,
    dispatch,
    row_invariant,
)
from kernelize.codegen.render import Renderer, c_name, closure, gather_error, gathers
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import REDUCE, ROW, Node, Op
from kernelize.ir.ops import NormArgs
from kernelize.ir.shapes import Dim, bind, numel
from kernelize.ir.stats import STATS, Acc, spell, spell_elem
from kernelize.runtime.backend import Backend, CompiledKernel, gpu_plan_settings

logger = logging.getLogger(__name__)

# indices stay 32-bit unless an extent may not fit (symbolic sizes are unbounded)
_I32_LIMIT = 2**31 - 2**26


class CudaRenderer(Renderer):
    """The shared C++ render table with CUDA storage types and 16-bit rounding casts."""

    STORAGE: ClassVar[dict[DType, str]] = {**Renderer.CTYPE, DType.F16: "__half", DType.BF16: "__nv_bfloat16"}

    def cast(self, value: str, dtype: DType) -> str:
        # a cast to a 16-bit float inside a kernel rounds there, as the reference does
        if dtype is DType.F16:
            return f"kz_round_f16((float)({value}))"
        if dtype is DType.BF16:
            return f"kz_round_bf16((float)({value}))"
        return super().cast(value, dtype)


# -- row statistics: accumulator type, per-element update, and what the pass leaves behind -----------------


def _acc_type(r: CudaRenderer, dtype: DType) -> str:
    """Accumulation type of sums/products: f32 for 16-bit and f32, f64, int64 for integers and bool."""
    if dtype.is_float:
        return r.ctype(dtype)
    return "int64_t"


@dataclass(frozen=True)
class _AccSpelling:
    decl: str  # accumulator C type; {at} (sum accumulation type of the source), {st} (source C type)
    update: str  # update expression; {acc}, {x} (source value); ``j`` is the row index
    fields: dict[str, str]  # the statistics' fields (:data:`kernelize.ir.stats.ACC_FIELDS`) in the state


# one pass, one block-reduced accumulator from cuda_prelude.cuh per accumulation of kernelize.ir.stats
_SUM, _ONE = "{acc}.add(({at}){x})", "{acc}.add({x})"
_ACC: dict[Acc, _AccSpelling] = {
    Acc.SUM: _AccSpelling("KzSum<{at}>", _SUM, {"sum": "{acc}.v"}),
    Acc.PROD: _AccSpelling("KzProd<{at}>", _SUM, {"prod": "{acc}.v"}),
    Acc.MAX: _AccSpelling("KzExt<{st}, true>", _ONE, {"max": "{acc}.v"}),
    Acc.MIN: _AccSpelling("KzExt<{st}, false>", _ONE, {"min": "{acc}.v"}),
    Acc.ARGMAX: _AccSpelling("KzArg<{st}, true>", "{acc}.add({x}, (long long)j)", {"index": "{acc}.i"}),
    Acc.ARGMIN: _AccSpelling("KzArg<{st}, false>", "{acc}.add({x}, (long long)j)", {"index": "{acc}.i"}),
    Acc.SUMSQ: _AccSpelling("KzSum<{st}>", "{acc}.add({x} * {x})", {"sumsq": "{acc}.v"}),
    Acc.ONLINE_SOFTMAX: _AccSpelling("KzSoftmax<{st}>", _ONE, {"max": "{acc}.m", "sumexp": "{acc}.s"}),
    Acc.WELFORD: _AccSpelling(
        "KzWelford<{st}>", _ONE, {"mean": "{acc}.mean", "m2": "{acc}.m2", "count": "{acc}.n"}
    ),
}
_FUNCS = {"exp": "kz_exp", "log": "kz_log", "rsqrt": "kz_rsqrt"}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fits_i32(extents: Sequence[Dim]) -> bool:
    return all(isinstance(e, int) and e < _I32_LIMIT for e in extents)


@dataclass(frozen=True)
class CudaSource:
    """Generated CUDA C of one kernel and how to launch it (shared by the GPU path and host emulation).

    Attributes:
        name: the ``extern "C"`` entry point; source: the complete translation unit.
        block: threads per block; params: ``(C type, name)`` of each parameter, in call order
            (``kernel.reads``, then ``kernel.writes``, then ``kernel.symbols`` as ``int64_t``).
    """

    kernel: Kernel
    name: str
    source: str
    block: int
    params: tuple[tuple[str, str], ...]

    def grid(self, sizes: Mapping[str, int], max_blocks: int = 1 << 16) -> tuple[int, int, int]:
        """The launch grid for bound symbolic ``sizes``; ``max_blocks`` caps grid-stride kernels."""
        k = self.kernel
        return dispatch(GRID, k, "cuda grids")(self, k, bind(k.domain, sizes), sizes, max_blocks)


Grid = tuple[int, int, int]


def _pointwise_grid(src: CudaSource, k: PointwiseKernel, dom, sizes, max_blocks: int) -> Grid:
    return (max(1, min(math.ceil(math.prod(dom) / src.block), max_blocks)), 1, 1)


def _row_grid(src: CudaSource, k: RowKernel, dom, sizes, max_blocks: int) -> Grid:
    return (max(1, min(math.prod(dom[: len(dom) - k.row_rank]), max_blocks)), 1, 1)


def _matmul_grid(src: CudaSource, k: MatmulKernel, dom, sizes, max_blocks: int) -> Grid:
    m, n = dom[-2], dom[-1]
    return (math.ceil(n / 64), math.ceil(m / 64), math.prod(dom[:-2]))


GRID = {
    PointwiseKernel: _pointwise_grid,
    RowKernel: _row_grid,
    MatmulKernel: _matmul_grid,
    SplitKKernel: lambda src, k, dom, sizes, max_blocks: splitk_grid(k, dom, sizes, max_blocks),
}


SPLITK_COLS = 8  # columns per block of cuda_splitk.cu (one 32-thread group each)
SPLITK_MIN_SLICE = 256  # K elements per slice at least: each lane still makes several steps


def splitk_grid(
    k: Kernel, dom: Sequence[int], sizes: Mapping[str, int], max_blocks: int
) -> tuple[int, int, int]:
    """(column blocks, K slices, 1): enough blocks to fill the GPU even for one row."""
    n, kdim = dom[-1], bind((k.body[0].arg,), sizes)[0]
    cols = max(1, math.ceil(n / SPLITK_COLS))
    slices = max(1, min(math.ceil(kdim / SPLITK_MIN_SLICE), max_blocks // cols))
    return (cols, slices, 1)


class _Gen:
    """Renders one kernel; names: operands ``a<i>`` / ``o<i>``, values ``v<i>``, domain indices ``i<d>``."""

    def __init__(self, kernel: Kernel, r: CudaRenderer) -> None:
        self.k, self.r = kernel, r
        reads, writes = kernel.reads, kernel.writes
        aliased = bool(set(reads) & set(writes))
        restrict = "" if aliased else " __restrict__"
        self.params: list[tuple[str, str]] = []
        self.rname: dict[Node, str] = {}
        self.wname: dict[Node, str] = {}
        for i, b in enumerate(reads):
            self.rname[b] = f"a{i}"
            self.params.append((f"const {r.storage(b.dtype)}*{restrict}", f"a{i}"))
        for i, b in enumerate(writes):
            self.wname[b] = f"o{i}"
            self.params.append((f"{r.storage(b.dtype)}*{restrict}", f"o{i}"))
        for s in kernel.symbols:
            self.params.append(("const int64_t", r.sym(s)))
        if gathers(kernel):
            self.params.append(("int*", "kz_err"))
        extents = [numel(kernel.domain), *(numel(b.shape) for b in (*reads, *writes))]
        self.idx = "int" if _fits_i32(extents) else "long long"
        self.rank = len(kernel.domain)

    # -- pieces ---------------------------------------------------------------------------------------------
    def decompose(self, var: str, dims: Sequence[Dim], names: Sequence[str], indent: str) -> str:
        """Row-major split of linear index ``var`` over ``dims`` into the index variables ``names``."""
        if not dims:
            return ""
        if len(dims) == 1:
            return f"{indent}const idx_t {names[0]} = {var};"
        tmp = f"{var}_r"
        lines = [f"{indent}idx_t {tmp} = {var};"]
        for pos in range(len(dims) - 1, -1, -1):
            d, n = dims[pos], names[pos]
            if d == 1:
                lines.append(f"{indent}const idx_t {n} = 0;")
            elif pos == 0:
                lines.append(f"{indent}const idx_t {n} = {tmp};")
            else:
                ds = self.r.dim(d)
                lines.append(f"{indent}const idx_t {n} = {tmp} % {ds};")
                lines.append(f"{indent}{tmp} /= {ds};")
        return "\n".join(lines)

    def offset(self, e: Load | Store, idx: Sequence[str]) -> str:
        terms = [] if e.offset == 0 else [f"(idx_t){self.r.dim(e.offset)}"]
        for s, ix in zip(e.strides, idx):
            if s != 0:
                terms.append(ix if s == 1 else f"{ix} * {self.r.dim(s)}")
        for ind in getattr(e, "indirect", ()):
            terms.append(
                f"(idx_t)kz_wrap(v{ind.value}, {self.r.dim(ind.size)}, kz_err) * {self.r.dim(ind.stride)}"
            )
        return " + ".join(terms) or "0"

    def load(self, e: Load, idx: Sequence[str]) -> str:
        value = f"kz_ld({self.rname[e.buffer]}[{self.offset(e, idx)}])"
        if not e.mask:
            return value
        conds = " && ".join(
            f"{idx[ax]} >= {self.r.dim(lo)} && {idx[ax]} < {self.r.dim(hi)}" for ax, lo, hi in e.mask
        )
        return f"(({conds}) ? {value} : {self.r.literal(e.other, e.dtype)})"

    def store(self, s: Store, idx: Sequence[str]) -> str:
        st = self.r.storage(s.buffer.dtype)
        return f"{self.wname[s.buffer]}[{self.offset(s, idx)}] = kz_cvt<{st}>(v{s.value});"

    def value(self, i: int, idx: Sequence[str]) -> str:
        """The declaration of full (per-element) body value ``i``."""
        e = self.k.body[i]
        if isinstance(e, Load):
            if e.constant is not None:  # a single-valued constant: a literal, no memory traffic
                return f"const {self.r.ctype(e.dtype)} v{i} = {self.r.literal(e.constant, e.dtype)};"
            return f"const {self.r.ctype(e.dtype)} v{i} = {self.load(e, idx)};"
        ct = self.r.ctype(e.dtype)
        if e.op is Op.CONCAT:
            return f"const {ct} v{i} = {self.r.concat(e, idx[e.arg.axis])};"
        if e.op in ROW:
            return f"const {ct} v{i} = {self.row_elem(i, e)};"
        if e.op in REDUCE or e.op is Op.MATMUL:
            raise NotImplementedError(
                f"cuda backend: {e.op} cannot be an element value of kernel {self.k.name}"
            )
        return f"const {ct} v{i} = {self.r.expr(e, [f'v{s}' for s in e.src])};"

    def operand_index(self, e: Load, batch: list[str], m: str, n: str) -> list[str]:
        """Index names of a matmul operand load: strides over ``(*batch, M, N, K)`` (the planner's form,
        A with stride 0 on N and B on M) or ``(*batch, M, K)`` / ``(*batch, K, N)``."""
        if len(e.strides) == len(batch) + 3:
            return [*batch, m, n, "ik"]
        return [*batch, m, "ik"] if n == "0" else [*batch, "ik", n]

    def row_elem(self, i: int, e: Compute) -> str:
        spec = STATS[e.op].on("cuda")
        return spell_elem(e.op, spec, e.src, e.arg, _FUNCS, lambda n: f"{n}{i}", lambda j: f"v{j}")

    # -- kinds ----------------------------------------------------------------------------------------------
    def common(self, block: int) -> dict[str, str]:
        return {
            "KERNEL": str(self.k).splitlines()[0],
            "BLOCK": str(block),
            "PRELUDE": load_template("cuda_prelude.cuh"),
            "NAME": c_name(self.k.name),
            "PARAMS": ", ".join(f"{t} {n}" for t, n in self.params),
            "IDX": self.idx,
        }

    def pointwise(self) -> tuple[str, int]:
        block, ind = 256, " " * 4
        idx = [f"i{d}" for d in range(self.rank)]
        body = [ind + self.value(i, idx) for i in range(len(self.k.body))]
        stores = [ind + self.store(s, idx) for s in self.k.stores]
        src = fill(
            load_template("cuda_pointwise.cu"),
            **self.common(block),
            NUMEL=self.r.dim(numel(self.k.domain)),
            INDEX=self.decompose("i", self.k.domain, idx, ind),
            BODY="\n".join(body),
            STORES="\n".join(stores),
        )
        return src, block

    def stat_pass(self, i: int, e: Compute, idx: list[str], inv: list[bool], inner_index: str) -> str:
        """One statistic of a row: a block-strided loop over the row, then a block reduction."""
        r, ind, ind2 = self.r, " " * 4, " " * 6
        src_dtype = self.k.body[e.src[0]].dtype
        spec = STATS[e.op].on("cuda")
        assert spec.passes == 1, f"cuda backend: {spec.acc} takes {spec.passes} passes"
        acc, ct, at = f"acc{i}", r.ctype(e.dtype), _acc_type(r, src_dtype)
        sp = _ACC[spec.acc]
        names = {**_FUNCS, **{f: v.format(acc=acc) for f, v in sp.fields.items()}, "n": f"({at})rowlen"}
        if isinstance(e.arg, NormArgs):
            names["eps"] = r.literal(e.arg.eps, e.dtype)
        if spec.elem is None:  # a reduction: its one value, converted from the accumulation type
            finish = f"const {ct} v{i} = kz_cvt<{ct}>({spell(spec.finish[0][1], names)});"
        else:
            values = []
            for n, f in spec.finish:
                values.append(f"{n}{i} = {spell(f, names)}")
                names[n] = f"{n}{i}"
            finish = f"const {ct} " + ", ".join(values) + ";"
        acc_t = sp.decl.format(at=at, st=r.ctype(src_dtype))
        return fill(
            load_template("cuda_row_pass.cu"),
            PASS=str(i),
            WHAT=f"v{i} = {e.op}(v{e.src[0]})",
            ACC_DECL=f"{acc_t} {acc} = {acc_t}::init();",
            INNER_INDEX=inner_index,
            BODY="\n".join(ind2 + self.value(j, idx) for j in closure(self.k, [e.src[0]], inv)),
            UPDATE=f"{ind2}{acc} = " + sp.update.format(acc=acc, x=f"v{e.src[0]}", at=at) + ";",
            FINISH=f"{ind}{acc} = kz_block_reduce({acc});\n{ind}{finish}",
        ).rstrip("\n")

    def row(self) -> tuple[str, int]:
        k, r = self.k, self.r
        outer, inner = k.domain[: self.rank - k.row_rank], k.domain[self.rank - k.row_rank :]
        rowlen = numel(inner)
        block = min(512, max(32, _pow2(rowlen))) if isinstance(rowlen, int) else 256
        idx = [f"i{d}" for d in range(self.rank)]
        inv = row_invariant(k)
        ind, ind2 = " " * 4, " " * 6
        inner_index = self.decompose("j", inner, idx[len(outer) :], ind2)
        lines: list[str] = []
        for i, e in enumerate(k.body):
            if isinstance(e, Compute) and (e.op in REDUCE or e.op in ROW):
                lines.append(self.stat_pass(i, e, idx, inv, inner_index))
            elif inv[i]:
                lines.append(ind + self.value(i, idx))
        full_stores = [s for s in k.stores if not inv[s.value]]
        if full_stores:
            lines.append(f"{ind}// output pass")
            lines.append(f"{ind}for (idx_t j = threadIdx.x; j < rowlen; j += blockDim.x) {{")
            lines.append(inner_index)
            lines += [ind2 + self.value(j, idx) for j in closure(k, [s.value for s in full_stores], inv)]
            lines += [ind2 + self.store(s, idx) for s in full_stores]
            lines.append(f"{ind}}}")
        row_stores = [s for s in k.stores if inv[s.value]]
        if row_stores:
            lines.append(f"{ind}if (threadIdx.x == 0) {{")
            lines += [ind2 + self.store(s, idx) for s in row_stores]
            lines.append(f"{ind}}}")
        src = fill(
            load_template("cuda_row.cu"),
            **self.common(block),
            NROWS=r.dim(numel(outer)),
            ROWLEN=r.dim(rowlen),
            OUTER_INDEX=self.decompose("row", outer, idx[: len(outer)], ind),
            ROW_BODY="\n".join(lines),
        )
        return src, block

    def matmul(self) -> tuple[str, int]:
        k, r = self.k, self.r
        mi = next(i for i, e in enumerate(k.body) if isinstance(e, Compute) and e.op is Op.MATMUL)
        mm = k.body[mi]
        a, b = (k.body[s] for s in mm.src)
        if not (isinstance(a, Load) and isinstance(b, Load)) or a.mask or b.mask or a.indirect or b.indirect:
            raise NotImplementedError(f"cuda matmul kernel {k.name}: operands must be plain strided loads")
        nb = self.rank - 2
        idx = [f"i{d}" for d in range(self.rank)]
        batch = idx[:nb]
        ind = " " * 6
        skip = {mi, *mm.src}
        body = [ind + self.value(i, idx) for i in range(len(k.body)) if i not in skip]
        src = fill(
            load_template("cuda_matmul.cu"),
            **{key: v for key, v in self.common(256).items() if key != "BLOCK"},
            ACC_T=r.ctype(mm.dtype),
            M=r.dim(k.domain[-2]),
            N=r.dim(k.domain[-1]),
            K=r.dim(mm.arg),
            BATCH_INDEX=self.decompose("bz", k.domain[:nb], batch, "  "),
            A=f"{self.rname[a.buffer]}[{self.offset(a, self.operand_index(a, batch, 'im', '0'))}]",
            B=f"{self.rname[b.buffer]}[{self.offset(b, self.operand_index(b, batch, '0', 'in'))}]",
            IM=idx[-2],
            IN=idx[-1],
            MM=f"v{mi}",
            BODY="\n".join(body),
            STORES="\n".join(ind + self.store(s, idx) for s in k.stores),
        )
        return src, 256

    def splitk(self) -> tuple[str, int]:
        """A SPLITK kernel (:func:`kernelize.autokernel.matmul.splitk_kernel`): all rows in each block."""
        k, dim = self.k, self.r.dim
        _, a, b = k.body
        last = self.rank - 1
        rows = [f"i{d}" for d in range(last)]
        src = fill(
            load_template("cuda_splitk.cu"),
            **{key: v for key, v in self.common(256).items() if key != "BLOCK"},
            ROWS=dim(numel(k.domain[:last])),
            N=dim(k.domain[last]),
            K=dim(k.body[0].arg),
            ROW_INDEX=self.decompose("kz_row", k.domain[:last], rows, " " * 6),
            A_ROW=self.offset(replace(a, strides=a.strides[:last]), rows),
            A_PTR=self.rname[a.buffer],
            A_SK=dim(a.strides[last + 1]),
            B=f"{self.rname[b.buffer]}[{self.offset(b, ['0'] * last + ['in', 'ik'])}]",
        )
        return src, 256


WRITERS = {
    PointwiseKernel: _Gen.pointwise,
    RowKernel: _Gen.row,
    MatmulKernel: _Gen.matmul,
    SplitKKernel: _Gen.splitk,
}


def render(kernel: Kernel, renderer: CudaRenderer | None = None) -> CudaSource:
    """Generate the CUDA C of ``kernel`` (no GPU or NVRTC needed)."""
    write = dispatch(WRITERS, kernel, "the cuda generator")
    gen = _Gen(kernel, renderer or CudaRenderer())
    source, block = write(gen)
    return CudaSource(kernel, c_name(kernel.name), source, block, tuple(gen.params))


def _render_attention(kernel: AttentionKernel) -> str:
    from kernelize.codegen.cuda_attention import render_attention

    return render_attention(kernel)[0]


def _router():
    from kernelize.codegen import router

    return router


def _render_experts(kernel: ExpertsKernel) -> str:
    from kernelize.codegen.cuda_experts import render_experts

    return render_experts(kernel)[0]


class CudaBackend(Backend):
    """Backend ``"cuda"``: CUDA C compiled with NVRTC for one architecture, launched on torch's stream.

    Args:
        arch: ``"sm_80"``-style target; default: the current GPU's, or ``sm_80`` without one.
    """

    name = "cuda"
    DEFAULT_ARCH = "sm_80"

    @property
    def plan_settings(self):
        return gpu_plan_settings()

    def __init__(self, arch: str | None = None) -> None:
        from kernelize.codegen.nvrtc import device_arch

        if arch is None:
            arch = (
                device_arch(torch.cuda.current_device()) if torch.cuda.is_available() else self.DEFAULT_ARCH
            )
        self.arch = arch

    def render(self, kernel: Kernel) -> str:
        """The CUDA C source of ``kernel`` (for ``kernelize inspect --kernels --backend cuda``)."""
        return dispatch(
            {
                AttentionKernel: _render_attention,
                ExpertsKernel: _render_experts,
                RouterKernel: lambda k: _router().render_cuda(k)[0],
                Kernel: lambda k: render(k).source,
            },
            kernel,
            "the cuda backend",
        )(kernel)

    def device_ok(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def compile(self, kernel: Kernel) -> CompiledKernel:
        """Render and compile ``kernel`` to a cubin (disk-cached); raises KernelCompileError on failure.

        A MATMUL kernel over weights becomes the few-row pair (split-K + epilogue, up to ``FEW_ROWS``
        rows) around the tiled kernel (see :mod:`kernelize.codegen.few_rows`)."""
        compile_kind = {
            AttentionKernel: self._compile_attention,
            ExpertsKernel: self._compile_experts,
            RouterKernel: lambda k: _router().compile_cuda(k, self.arch),
            MatmulKernel: self._compile_matmul,
            LoopKernel: self._compile,
        }
        return dispatch(compile_kind, kernel, "the cuda backend")(kernel)

    def _compile_attention(self, kernel: AttentionKernel) -> CompiledKernel:
        from kernelize.codegen.cuda_attention import compile_attention

        return compile_attention(kernel, self.arch)

    def _compile_experts(self, kernel: ExpertsKernel) -> CompiledKernel:
        from kernelize.codegen.cuda_experts import compile_experts

        return compile_experts(kernel, self.arch)

    def _compile_matmul(self, kernel: MatmulKernel) -> CompiledKernel:
        from kernelize.codegen.few_rows import compile_few_rows, few_rows_apply

        if not few_rows_apply(kernel):
            return self._compile(kernel)
        return compile_few_rows(kernel, self._compile, self.name)

    def _compile(self, kernel: Kernel) -> CompiledKernel:
        from kernelize.codegen.nvrtc import CubinModule, compile_cubin, require_driver, sm_count

        src = render(kernel)
        cubin = compile_cubin(src.source, src.name, self.arch)
        logger.debug(
            "cuda kernel %s: %d-line source, %d-byte %s cubin",
            kernel.name,
            src.source.count("\n"),
            len(cubin),
            self.arch,
        )
        module = CubinModule(cubin, src.name)
        arg_types = [ctypes.c_void_p if "*" in t else ctypes.c_int64 for t, _ in src.params]
        flagged = gathers(kernel)

        def launch(
            reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]
        ) -> None:
            require_driver()
            tensors = [*reads, *writes]
            off_gpu = [i for i, t in enumerate(tensors) if not t.is_cuda]
            if off_gpu:
                raise ValueError(
                    f"cuda kernel {kernel.name}: argument {off_gpu[0]} is on {tensors[off_gpu[0]].device}; "
                    "every tensor must be on the CUDA device (move it with .cuda())"
                )
            dev = tensors[0].device.index or 0 if tensors else torch.cuda.current_device()
            values = [t.data_ptr() for t in tensors] + [int(sizes[s]) for s in kernel.symbols]
            grid = src.grid(sizes, sm_count(dev) * max(1, 2048 // src.block))
            if grid[0] * grid[1] * grid[2] == 0:
                return
            err = torch.zeros(1, dtype=torch.int32, device=tensors[0].device) if flagged else None
            module.launch(
                grid,
                (src.block, 1, 1),
                list(zip(values + ([] if err is None else [err.data_ptr()]), arg_types)),
                dev,
            )
            if err is not None:
                torch._assert_async(err == 0, gather_error(kernel, "cuda"))

        return CompiledKernel(kernel.name, self.name, src.source, launch, kernel)


__all__ = ["CudaBackend", "CudaRenderer", "CudaSource", "render"]
