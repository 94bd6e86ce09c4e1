"""Triton code generator: one readable ``@triton.jit`` function per :class:`Kernel`.

Rendering is split the usual way: :class:`TritonRenderer` overrides the shared per-op table with Triton
expressions, the kernel skeletons live in ``templates/triton_*.py.tmpl`` and :func:`render` fills their
holes with the index, load, compute and store lines of one kernel. Generated names are deterministic
(``v<i>`` for body values, ``<input>_ptr`` / ``in<i>_ptr`` / ``out<i>_ptr`` for buffers, ``s_<name>`` for
symbolic dims), so the same kernel spec always gives the same source and the same cache key.

Kernel shapes:

* POINTWISE: ``BLOCK`` flat indices per program over the whole domain.
* ROW: one row per program. While the row fits one block (up to 64K elements) it is loaded once and
  reduced in registers; beyond that, or for a symbolic row size, the loop form walks the row in blocks
  (online max/sum for softmax, running sums for norms), recomputing loads rather than staging them.
* EXPERTS (:mod:`.triton_experts`): vLLM's fused-MoE layout, two grouped GEMMs over the pairs sorted by
  expert (gate|up -> act * up, then down with the routing weight in the epilogue) and a sum over K.
* MATMUL: ``BM x BN`` tiles with an f32 accumulator over ``BK`` steps, then the elementwise epilogue.
  A MATMUL kernel over weights also compiles a few-row form, taken for up to ``FEW_ROWS`` rows: a
  ``SPLITK`` kernel per matmul (every row in one tile, a grid of column tiles x K slices so one row still
  fills the GPU, partial sums added to a zeroed f32 temporary) and the epilogue as a pointwise kernel.

Symbolic dims are runtime ``int`` arguments marked ``do_not_specialize``, so one compiled kernel serves
every batch and sequence length. ``IDX64`` (a ``constexpr`` chosen at launch) widens index math to int64
only when a tensor has 2**31 elements or more.

Example:
    >>> src = TritonBackend().render(kernel)  # doctest: +SKIP
    >>> ck = TritonBackend().compile(kernel); ck.launch([x, w], [y], {"batch": 4})  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
)
from kernelize.codegen.render import gather_error, gathers
from kernelize.codegen.template import fill, load_template
from kernelize.codegen.triton_base import (
    TL,
    IndexCtx,
    TritonRenderer,
    index_lines,
    interpreting,
    load_module,
    next_power_of_2,
)
from kernelize.codegen.triton_rows import RowRenderer, row_block
from kernelize.ir.dtypes import HALF, DType, compute_dtype
from kernelize.ir.graph import REDUCE, ROW, Op
from kernelize.ir.shapes import Dim, bind, numel
from kernelize.runtime.backend import Backend, CompiledKernel, KernelCompileError, gpu_plan_settings
from kernelize.runtime.cache import KERNELS

logger = logging.getLogger(__name__)


class KernelSource:
    """Renders one kernel to source; ``args`` are the function's pointer and size parameters in order."""

    def __init__(self, kernel: Kernel, renderer: TritonRenderer | None = None) -> None:
        self.k = kernel
        self.r = renderer or TritonRenderer()
        self.ptr: dict[Any, str] = {}
        taken: set[str] = set()
        for i, b in enumerate(kernel.reads):
            name = f"{b.arg}_ptr" if b.op is Op.INPUT and str(b.arg).isidentifier() else f"in{i}_ptr"
            if name in taken:
                name = f"in{i}_ptr"
            self.ptr[b] = name
            taken.add(name)
        for i, b in enumerate(kernel.writes):
            self.ptr[("w", b)] = f"out{i}_ptr"
        self.args = [self.ptr[b] for b in kernel.reads] + [f"out{i}_ptr" for i in range(len(kernel.writes))]
        self.args += [self.r.sym(s) for s in kernel.symbols]
        if gathers(kernel):
            self.args.append("kz_err_ptr")
        self.vec: dict[int, bool] = {}

    # -- shared pieces ------------------------------------------------------------------------------------
    def offset(
        self, ctx: IndexCtx, strides: Sequence[Dim], offset: Dim, extra: Sequence[str] = ()
    ) -> tuple[str, set[int]]:
        """The offset expression and the domain axes it uses."""
        terms = [] if offset == 0 else [self.r.dim(offset)]
        used: set[int] = set()
        for a, (ax, st) in enumerate(zip(ctx.axes, strides)):
            if ax is None or st == 0:
                continue
            terms.append(ax if st == 1 else f"{ax} * {self.r.dim(st)}")
            used.add(a)
        terms += extra
        return (" + ".join(terms) or "0"), used

    def load(self, i: int, e: Load, ctx: IndexCtx, base_mask: str, indent: str = "    ") -> str:
        const = e.constant
        if const is not None:  # a single-valued constant: inline it (its pointer stays an unused argument)
            self.vec[i] = False
            return f"{indent}v{i} = tl.full([], {self.r.literal(const, e.dtype)}, {self.r.ctype(e.dtype)})"
        extra, ind_vec, inside = [], False, []
        for ind in e.indirect:
            v, size = f"v{ind.value}", self.r.dim(ind.size)
            # a negative index wraps once; one still out of range reads element 0, never outside the table,
            # and sets the error flag the launcher asserts is 0 (as kz_wrap in the CUDA prelude)
            wrapped = f"tl.where({v} < 0, {v} + {size}, {v})"
            inside.append(f"({v} >= -{size}) & ({v} < {size})")
            extra.append(f"tl.where({inside[-1]}, {wrapped}, 0) * {self.r.dim(ind.stride)}")
            ind_vec |= self.vec[ind.value]
        off, used = self.offset(ctx, e.strides, e.offset, extra)
        full = ind_vec or ctx.is_full(used)
        vec, masks = ind_vec or ctx.is_vec(used), []
        for axis, lo, hi in e.mask:
            ax = ctx.axes[axis] or "0"
            vec |= ctx.axes[axis] is not None and ctx.vec[axis]
            if lo != 0:
                masks.append(f"({ax} >= {self.r.dim(lo)})")
            if not (isinstance(hi, int) and hi >= _static(self.k.domain[axis])):
                masks.append(f"({ax} < {self.r.dim(hi)})")
        if vec and not full:
            off = f"{off} + zero"
        ptr = f"{self.ptr[e.buffer]} + {off}"
        if vec:
            masks = [base_mask, *masks]
        other = self.r.literal(e.other, e.dtype)
        text = f"tl.load({ptr}, mask={' & '.join(masks)}, other={other})" if masks else f"tl.load({ptr})"
        if e.dtype in HALF:
            text += ".to(tl.float32)"
        self.vec[i] = vec
        flag = ""
        if inside:  # the flag's pointer takes the load's shape (0 * offset), its mask the load's lanes
            bad = " & ".join([*masks, f"~({' & '.join(inside)})"])
            flag = f"{indent}tl.store(kz_err_ptr + 0 * ({off}), 1, mask={bad})\n"
        return f"{flag}{indent}v{i} = {text}"

    def compute(self, i: int, e: Compute, ctx: IndexCtx, indent: str = "    ") -> str:
        args = [f"v{s}" for s in e.src]
        if e.op is Op.CONCAT:
            axis = e.arg.axis
            expr = self.r.concat(e, ctx.axes[axis] or "0")
            self.vec[i] = any(self.vec[s] for s in e.src) or (ctx.axes[axis] is not None and ctx.vec[axis])
            return f"{indent}v{i} = {expr}"
        self.vec[i] = any(self.vec[s] for s in e.src)
        return f"{indent}v{i} = {self.r.expr(e, args)}"

    def store(self, s: Store, ctx: IndexCtx, mask: str, indent: str = "    ") -> str:
        off, used = self.offset(ctx, s.strides, s.offset)
        vec = ctx.is_vec(used) or self.vec[s.value]
        if vec and not ctx.is_full(used):
            off = f"{off} + zero"
        value = f"v{s.value}"
        if self._value_dtype(s.value) != s.buffer.dtype:
            value = f"{value}.to({TL[s.buffer.dtype]})"
        ptr = f"{self.ptr[('w', s.buffer)]} + {off}"
        if not vec:
            return f"{indent}tl.store({ptr}, {value})"
        if not self.vec[s.value]:
            value = f"tl.broadcast_to({value}, {ctx.shape})"
        return f"{indent}tl.store({ptr}, {value}, mask={mask})"

    def _value_dtype(self, i: int) -> DType:
        e = self.k.body[i]
        return compute_dtype(e.dtype if isinstance(e, Load) else e.dtype)

    def header(self, tmpl: str, index: list[str], body: list[str], **holes: str) -> str:
        nospec = [self.r.sym(s) for s in self.k.symbols]
        doc = str(self.k).replace('"""', "'''").replace("\n", "\n    ")
        kernel = fill(
            load_template(tmpl),
            NAME=self.k.name,
            ARGS="".join(f"{a}, " for a in self.args),
            NOSPEC=repr(nospec),
            DOC=doc,
            INDEX="\n".join(index),
            BODY="\n".join(body),
            **holes,
        )
        return fill(load_template("triton_prelude.py.tmpl"), KERNEL=self.k.name) + kernel

    # -- kernel shapes ------------------------------------------------------------------------------------
    def pointwise(self) -> str:
        k = self.k
        index, names = index_lines(k.domain, "lin", "i", self.r)
        ctx = IndexCtx(names, [True] * len(names), "[BLOCK]")
        body = self._elementwise(ctx, range(len(k.body)))
        body += [self.store(s, ctx, "mask") for s in k.stores]
        return self.header("triton_pointwise.py.tmpl", index, body, NUMEL=self.r.dim(numel(k.domain)))

    def _elementwise(self, ctx: IndexCtx, entries) -> list[str]:
        lines = []
        for i in entries:
            e = self.k.body[i]
            if isinstance(e, Load):
                lines.append(self.load(i, e, ctx, "mask"))
            elif e.op in REDUCE or e.op in ROW or e.op is Op.MATMUL:
                raise NotImplementedError(f"{self.k.name}: {e.op} in a {self.k.kind} kernel")
            else:
                lines.append(self.compute(i, e, ctx))
        return lines

    def matmul(self) -> str:
        k = self.k
        mm = [i for i, e in enumerate(k.body) if isinstance(e, Compute) and e.op is Op.MATMUL]
        if len(mm) != 1:
            raise NotImplementedError(f"{k.name}: a matmul kernel needs exactly one MATMUL, found {len(mm)}")
        mi = mm[0]
        e = k.body[mi]
        a, b = (k.body[s] for s in e.src)
        if not (isinstance(a, Load) and isinstance(b, Load)) or a.mask or b.mask or a.indirect or b.indirect:
            raise NotImplementedError(f"{k.name}: matmul operands must be plain strided loads")
        if a.dtype not in (DType.F16, DType.BF16, DType.F32):
            raise NotImplementedError(f"{k.name}: Triton matmul of {a.dtype} (use a library kernel)")
        nb = len(k.domain) - 2
        # operand strides run over (*batch, M, N, K): a ignores N, b ignores M
        if {len(a.strides), len(b.strides)} != {nb + 3} or a.strides[nb + 1] != 0 or b.strides[nb] != 0:
            raise NotImplementedError(f"{k.name}: matmul operand strides must be over (*batch, M, N, K)")
        kdim = e.arg
        batch, bnames = index_lines(k.domain[:nb], "bid", "b", self.r) if nb else ([], [])
        ctx = IndexCtx(
            [*bnames, "rm[:, None]", "rn[None, :]"], [False] * nb + [True, True], "[BM, BN]", [{nb}, {nb + 1}]
        )
        a_off, _ = self.offset(IndexCtx(bnames, [False] * nb, ""), a.strides[:nb], a.offset)
        b_off, _ = self.offset(IndexCtx(bnames, [False] * nb, ""), b.strides[:nb], b.offset)
        body = []
        for i, x in enumerate(k.body):
            if i in e.src:
                self.vec[i] = True
            elif i == mi:
                self.vec[i] = True
                body.append(f"    v{i} = acc")
            elif isinstance(x, Load):
                body.append(self.load(i, x, ctx, "mask"))
            else:
                body += self._elementwise(ctx, [i])
        body += [self.store(s, ctx, "mask") for s in k.stores]
        r = self.r.dim
        return self.header(
            "triton_matmul.py.tmpl",
            batch,
            body,
            M=r(k.domain[-2]),
            N=r(k.domain[-1]),
            K=r(kdim),
            A_PTR=self.ptr[a.buffer],
            A_OFF=a_off,
            A_SM=r(a.strides[nb]),
            A_SK=r(a.strides[nb + 2]),
            B_PTR=self.ptr[b.buffer],
            B_OFF=b_off,
            B_SK=r(b.strides[nb + 2]),
            B_SN=r(b.strides[nb + 1]),
            PRECISION=', input_precision="ieee"' if a.dtype is DType.F32 else "",
        )

    def row(self) -> str:
        return RowRenderer(self).render()

    def splitk(self) -> str:
        """A SPLITK kernel (:func:`kernelize.autokernel.matmul.splitk_kernel`): every row in one tile."""
        k, r = self.k, self.r.dim
        _, a, b = k.body
        last = len(k.domain) - 1
        index, names = index_lines(k.domain[:last], "rm", "m", self.r)
        a_row, _ = self.offset(IndexCtx(names, [True] * last, "[BM]"), a.strides[:last], a.offset)
        return self.header(
            "triton_splitk.py.tmpl",
            index,
            [],
            ROWS=r(numel(k.domain[:last])),
            N=r(k.domain[last]),
            K=r(k.body[0].arg),
            A_PTR=self.ptr[a.buffer],
            A_ROW=a_row,
            A_SK=r(a.strides[last + 1]),
            B_PTR=self.ptr[b.buffer],
            B_OFF=r(b.offset),
            B_SK=r(b.strides[last + 1]),
            B_SN=r(b.strides[last]),
            **_dot_operands(a.dtype, b.dtype),
        )


def _static(d: Dim) -> float:
    return d if isinstance(d, int) else float("inf")


def _render_attention(kernel: AttentionKernel) -> str:
    from kernelize.codegen.triton_attention import render_attention

    return render_attention(kernel)


def render_router(kernel: RouterKernel) -> str:
    from kernelize.codegen.router import render_triton

    return render_triton(kernel)


def compile_router(kernel: RouterKernel, interpret: bool) -> CompiledKernel:
    from kernelize.codegen.router import compile_triton

    return compile_triton(kernel, interpret)


def _render_experts(kernel: ExpertsKernel) -> str:
    from kernelize.codegen.triton_experts import render_experts

    return render_experts(kernel)


RENDER: dict[type, Callable[[Kernel], str]] = {
    PointwiseKernel: lambda k: KernelSource(k).pointwise(),
    RowKernel: lambda k: KernelSource(k).row(),
    MatmulKernel: lambda k: KernelSource(k).matmul(),
    SplitKKernel: lambda k: KernelSource(k).splitk(),
    AttentionKernel: _render_attention,
    ExpertsKernel: _render_experts,
    RouterKernel: lambda k: render_router(k),
}


def render(kernel: Kernel) -> str:
    """The full Triton module source for ``kernel`` (prelude helpers + one ``@triton.jit`` function)."""
    return dispatch(RENDER, kernel, "the triton generator")(kernel)


# -- launch ------------------------------------------------------------------------------------------------
# (largest block, num_warps) rules for row kernels, like Liger's calculate_settings
ROW_WARPS = ((2048, 4), (8192, 8), (65536, 16))
POINTWISE_BLOCK, POINTWISE_WARPS = 1024, 4
MATMUL_BLOCKS = (64, 64, 32)


def row_warps(block: int) -> int:
    return next(w for limit, w in ROW_WARPS if block < limit or limit == ROW_WARPS[-1][0])


Config = tuple[tuple[int, ...], dict[str, int]]


def launch_config(kernel: Kernel, sizes: Mapping[str, int]) -> Config:
    """The grid and the ``constexpr`` / ``num_warps`` keyword arguments for one launch."""
    return dispatch(LAUNCH_CONFIG, kernel, "triton launch configs")(kernel, bind(kernel.domain, sizes), sizes)


def pointwise_config(kernel: PointwiseKernel, dom: Sequence[int], sizes: Mapping[str, int]) -> Config:
    n = numel(dom)
    block = min(POINTWISE_BLOCK, max(16, next_power_of_2(n)))
    return ((n + block - 1) // block,), {"BLOCK": block, "num_warps": POINTWISE_WARPS}


def row_config(kernel: RowKernel, dom: Sequence[int], sizes: Mapping[str, int]) -> Config:
    rows, size = numel(dom[: len(dom) - kernel.row_rank]), numel(dom[len(dom) - kernel.row_rank :])
    block = row_block(kernel, size)
    return (rows,), {"BLOCK": block, "num_warps": row_warps(block)}


def matmul_config(kernel: MatmulKernel, dom: Sequence[int], sizes: Mapping[str, int]) -> Config:
    m, n, batch = dom[-2], dom[-1], numel(dom[:-2])
    bm, bn, bk = (min(b, max(16, next_power_of_2(x))) for b, x in zip(MATMUL_BLOCKS, (m, n, 1 << 30)))
    grid = (((m + bm - 1) // bm) * ((n + bn - 1) // bn), batch)
    upcast = interpreting() and any(isinstance(e, Load) and e.dtype is DType.BF16 for e in kernel.body)
    return grid, {"BM": bm, "BN": bn, "BK": bk, "UPCAST": upcast, "num_warps": 4}


SPLITK_BLOCKS = (16, 64, 64)  # rows (tl.dot's least M), columns, K per step
SPLITK_PROGRAMS = 512  # column tiles x K slices to aim at: a few waves over an H100's 132 SMs


def splitk_config(kernel: SplitKKernel, dom: Sequence[int], sizes: Mapping[str, int]) -> Config:
    """Grid (column tiles, K slices) and constexprs of a SPLITK kernel: enough programs to fill the GPU
    even for one row, each slice at least a few BK steps long."""
    bm, bn, bk = SPLITK_BLOCKS
    n, kdim = dom[-1], bind((kernel.body[0].arg,), sizes)[0]
    tiles = max(1, (n + bn - 1) // bn)
    splits = max(1, min((kdim + 4 * bk - 1) // (4 * bk), SPLITK_PROGRAMS // tiles))
    ksplit = ((kdim + splits - 1) // splits + bk - 1) // bk * bk
    splits = max(1, (kdim + ksplit - 1) // ksplit)
    upcast = interpreting() and any(isinstance(e, Load) and e.dtype in HALF for e in kernel.body)
    return (tiles, splits), {"BM": bm, "BN": bn, "BK": bk, "KSPLIT": ksplit, "UPCAST": upcast, "num_warps": 4}


LAUNCH_CONFIG = {
    PointwiseKernel: pointwise_config,
    RowKernel: row_config,
    MatmulKernel: matmul_config,
    SplitKKernel: splitk_config,
}


class TritonBackend(Backend):
    """Backend ``"triton"``: renders, loads and launches Triton kernels (CUDA, or CPU under the interpreter).

    Example:
        >>> ck = TritonBackend().compile(kernel)  # doctest: +SKIP
        >>> print(ck.source)  # doctest: +SKIP
    """

    name = "triton"

    @property
    def plan_settings(self):
        return gpu_plan_settings(interpreting())

    def render(self, kernel: Kernel) -> str:
        return render(kernel)

    def device_ok(self, device: torch.device) -> bool:
        device = torch.device(device)
        if device.type == "cuda":
            return torch.cuda.is_available()
        return device.type == "cpu" and interpreting()

    def compile(self, kernel: Kernel) -> CompiledKernel:
        compile_kind = {
            AttentionKernel: self._compile_attention,
            ExpertsKernel: self._compile_experts,
            RouterKernel: lambda k: compile_router(k, interpreting()),
            MatmulKernel: self._compile_matmul,
            LoopKernel: self._compile,
        }
        return dispatch(compile_kind, kernel, "the triton backend")(kernel)

    def _compile_attention(self, kernel: AttentionKernel) -> CompiledKernel:
        from kernelize.codegen.triton_attention import compile_attention

        return compile_attention(kernel, interpreting())

    def _compile_experts(self, kernel: ExpertsKernel) -> CompiledKernel:
        from kernelize.codegen.triton_experts import compile_experts

        return compile_experts(kernel, interpreting())

    def _compile(self, kernel: Kernel) -> CompiledKernel:
        source = render(kernel)
        interpret = interpreting()
        key = (hashlib.sha256(source.encode()).hexdigest(), "interpret" if interpret else "cuda")
        try:
            module = KERNELS.get_or_build(key, lambda: load_module(source, kernel.name, interpret))
        except Exception as e:  # a syntax or template error in generated code: show the numbered source
            raise KernelCompileError(kernel.name, key[0], f"{type(e).__name__}: {e}", source, "triton") from e
        fn = getattr(module, kernel.name)
        symbols, flagged = kernel.symbols, gathers(kernel)

        def launch(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], sizes: Mapping[str, int]):
            grid, meta = launch_config(kernel, sizes)
            big = max((t.numel() for t in (*reads, *writes)), default=0)
            idx64 = big >= 2**31 - 1 or numel(bind(kernel.domain, sizes)) >= 2**31 - 1 - 65536
            device = (*reads, *writes)[0].device
            err = torch.zeros(1, dtype=torch.int32, device=device) if flagged else None
            flag = () if err is None else (err,)
            fn[grid](*reads, *writes, *(int(sizes[s]) for s in symbols), *flag, IDX64=idx64, **meta)
            if err is not None:
                torch._assert_async(err == 0, gather_error(kernel, "triton"))

        return CompiledKernel(kernel.name, "triton", source, launch, kernel)

    def _compile_matmul(self, kernel: MatmulKernel) -> CompiledKernel:
        from kernelize.codegen.few_rows import compile_few_rows, few_rows_apply

        if not few_rows_apply(kernel):
            return self._compile(kernel)
        return compile_few_rows(kernel, self._compile, self.name)


def _dot_operands(a: DType, b: DType) -> dict[str, str]:
    """``tl.dot`` operands and precision: 16-bit pairs as they are (f32 accumulate), anything with f32 in
    exact f32 (``ieee``, not tf32), mixed 16-bit kinds as f32."""
    if a == b and a in HALF:
        return {"A_CAST": "a", "B_CAST": "b", "PRECISION": ""}
    ieee = ', input_precision="ieee"'
    return {"A_CAST": "a.to(tl.float32)", "B_CAST": "b.to(tl.float32)", "PRECISION": ieee}


__all__ = ["TritonBackend", "TritonRenderer", "launch_config", "render"]
