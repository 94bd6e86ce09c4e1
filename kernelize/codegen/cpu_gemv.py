"""CPU matmul kernels: a generated few-row matmul (decode), the library GEMM with a fused epilogue above.

A ``MATMUL`` kernel (one or several matmuls sharing the left operand ``x``, then an elementwise epilogue)
compiles to two functions, chosen per call by the number of rows ``M`` (the domain without its last axis,
flattened):

* ``M <= FEW_ROWS``: ``templates/cpu_gemv.cpp``. Decode streams every weight once per token, so the
  kernel is built around the weight bytes: ``x`` is packed once into f32 rows, each thread takes a range
  of weight columns (or, when there are too few columns for the threads, a range of the contraction with
  a final combine), reads each weight element once with a vectorised inner product over K (16-bit weights
  widened in registers, f32 accumulation), and runs the epilogue (bias, activation, ``act(gate) * up``,
  residual add...) on the accumulators before the only store. Weights contiguous along K (``nn.Linear``)
  take the inner-product form; contiguous along N an axpy form; other strides a scalar loop.
* more rows: torch runs each matmul (MKL / oneDNN: measured 2-7x faster than a generated row-at-a-time
  kernel at 256+ rows) into a temporary, and a generated pointwise kernel (the same epilogue) reads it.

Example:
    >>> ck = CpuBackend().compile(matmul_kernel)  # doctest: +SKIP
    >>> ck.launch([x, w, bias], [y], {"n2": 1})  # one row: the few-row kernel  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kernelize.autokernel.kernels import Compute, Kernel, KernelKind, Load
from kernelize.codegen.render import closure, contraction
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Node, Op
from kernelize.ir.shapes import Dim, numel

FEW_ROWS = 16  # at most this many rows run the generated kernel; more go to the library GEMM
AXPY_COLUMNS = 64  # columns per block when some weight is not contiguous along K


@dataclass(frozen=True)
class MatmulParts:
    """Where the matmuls of a MATMUL kernel sit in its body: ``(matmul, right operand)`` positions."""

    a: int
    mms: tuple[tuple[int, int], ...]

    @property
    def operands(self) -> set[int]:
        return {self.a, *(b for _, b in self.mms)}


def matmul_parts(k: Kernel) -> MatmulParts:
    """The matmuls of ``k`` (all must share their left operand, a plain strided load)."""
    mms = [(i, e) for i, e in enumerate(k.body) if isinstance(e, Compute) and e.op is Op.MATMUL]
    if not mms:
        raise NotImplementedError(f"cpu matmul kernel {k.name}: no MATMUL in the body")
    a = mms[0][1].src[0]
    for _, e in mms:
        if e.src[0] != a:
            raise NotImplementedError(f"cpu matmul kernel {k.name}: matmuls must share their left operand")
        for s in e.src:
            ld = k.body[s]
            if not isinstance(ld, Load) or ld.mask or ld.indirect:
                raise NotImplementedError(f"cpu matmul kernel {k.name}: operands must be plain strided loads")
    return MatmulParts(a, tuple((i, e.src[1]) for i, e in mms))


def _static(d: Dim) -> bool:
    return isinstance(d, int)


def render_gemv(w: Any) -> str:
    """The few-row C++ source of the MATMUL kernel held by ``w`` (a ``kernelize.codegen.cpu`` writer)."""
    k, r = w.k, w.r
    rank = w.rank
    last = rank - 1
    parts = matmul_parts(k)
    a = k.body[parts.a]
    acc_t = r.ctype(k.body[parts.mms[0][0]].dtype)
    accesses = w.named_accesses()
    slot = {name: s for s, (name, _) in enumerate(accesses)}
    a_name = f"kz_l{parts.a}"
    accesses.insert(0, accesses.pop(slot[a_name]))  # x first: the packing loop reads kz_rb[0]
    slot = {name: s for s, (name, _) in enumerate(accesses)}

    ind = " " * 12
    setup = w.outer_index(last, "kz_o", ind)
    setup += [f"{ind}kz_ri[{d}][kz_r] = i{d};" for d in range(last)]
    for name, acc in accesses:
        terms = [r.dim(acc.offset)] + [
            f"i{d} * {r.dim(acc.strides[d])}" for d in range(last) if acc.strides[d]
        ]
        setup.append(f"{ind}kz_rb[{slot[name]}][kz_r] = {' + '.join(terms)};")

    a_ks = a.strides[rank]
    a_load = f"kz_ld({w.ptr[a.buffer]}, kz_la" + (f" + kz_kk * {r.dim(a_ks)})" if a_ks != 0 else ")")

    forms = []
    for _, ib in parts.mms:
        b = k.body[ib]
        ns, ks = b.strides[last], b.strides[rank]
        forms.append("dot" if ks == 1 and _static(ns) else "axpy" if ns == 1 and _static(ks) else "generic")
    if acc_t != "float":
        forms = ["generic"] * len(forms)
    dot = all(f == "dot" for f in forms)
    if not dot:
        forms = ["generic" if f == "dot" else f for f in forms]
    cb = "KZ_NB" if dot else str(AXPY_COLUMNS)
    cols = []
    ind = " " * 20
    for m, ((_, ib), form) in enumerate(zip(parts.mms, forms)):
        b = k.body[ib]
        shared = all(b.strides[d] == 0 for d in range(last))
        ptr, bslot = w.ptr[b.buffer], slot[f"kz_l{ib}"]
        wt = r.storage(b.dtype)
        ns, ks = r.dim(b.strides[last]), r.dim(b.strides[rank])
        nrows = "1" if shared else "kz_nr"
        sh = "true" if shared else "false"
        if form == "dot":
            cols += [
                f"{ind}{{ const {wt}* kz_w[KZ_MAXR * KZ_NB];",
                f"{ind}  for (int kz_r = 0; kz_r < {nrows}; ++kz_r)",
                f"{ind}    for (int kz_j = 0; kz_j < KZ_NB; ++kz_j)  // short block: last column again",
                f"{ind}      kz_w[kz_r * KZ_NB + kz_j] = {ptr} + kz_rb[{bslot}][kz_r] + "
                f"(kz_c0 + (kz_j < kz_nb ? kz_j : kz_nb - 1)) * {ns};",
                f"{ind}  kz_dot_cols(kz_x, kz_ldx, kz_nr, kz_w, {sh}, kz_k0, kz_k1, kz_blk[{m}]); }}",
            ]
        else:
            call = (
                f"kz_axpy_cols(kz_x, kz_ldx, kz_nr, kz_w, {sh}, {ks}, kz_nb, kz_k0, kz_k1, "
                f"kz_blk[{m}], kz_cb);"
                if form == "axpy"
                else f"kz_generic_cols(kz_x, kz_ldx, kz_nr, kz_w, {sh}, {ks}, {ns}, kz_nb, kz_k0, kz_k1, "
                f"kz_blk[{m}], kz_cb);"
            )
            cols += [
                f"{ind}{{ const {wt}* kz_w[KZ_MAXR];",
                f"{ind}  for (int kz_r = 0; kz_r < {nrows}; ++kz_r)",
                f"{ind}    kz_w[kz_r] = {ptr} + kz_rb[{bslot}][kz_r] + kz_c0 * {ns};",
                f"{ind}  {call} }}",
            ]

    ind = " " * 16
    epi = [f"{ind}const int64_t i{d} = kz_ri[{d}][kz_r];" for d in range(last)]
    epi += [f"{ind}const int64_t {name} = kz_rb[{slot[name]}][kz_r];" for name, _ in accesses]
    skip = [False] * len(k.body)
    for i in parts.operands:
        skip[i] = True
    for m, (mi, _) in enumerate(parts.mms):
        skip[mi] = True
        epi.append(f"{ind}const {acc_t} v{mi} = kz_mv[{m}];")
    epi += [ind + w.value(i, [last], {}) for i in closure(k, [s.value for s in k.stores], skip)]
    epi += [ind + w.store(j, s, [last]) for j, s in enumerate(k.stores)]
    return fill(
        load_template("cpu_gemv.cpp"),
        PRELUDE=load_template("cpu_prelude.h"),
        GEMV_LIB=load_template("cpu_gemv.h"),
        NAME=w.fn_name,
        DOMAIN=str(list(map(str, k.domain))),
        NMM=str(len(parts.mms)),
        PARAMS=w.params,
        ROWS=r.dim(numel(k.domain[:last])),
        N=w.n(last),
        K=r.dim(contraction(k, k.body[parts.mms[0][0]], a, "cpu")),
        NSLOT=str(len(accesses)),
        NOUTER=str(max(last, 1)),
        ROW_SETUP="\n".join(setup),
        A_LOAD=a_load,
        ACC_T=acc_t,
        PARALLEL_MIN="32768",
        CB=cb,
        J=f"i{last}",
        COLS="\n".join(cols),
        EPILOGUE="\n".join(epi),
    )


# ---- above FEW_ROWS: torch's GEMM into temporaries, then the epilogue as a pointwise kernel -------------
def epilogue_kernel(k: Kernel) -> tuple[Kernel, tuple[Node, ...]]:
    """``k`` with each matmul value read from a temporary buffer (``kz_mm<i>``, the domain's shape, row
    major) instead of computed: the kernel the library path runs after torch's matmuls. Returns the
    kernel and the temporaries' nodes in matmul order."""
    parts = matmul_parts(k)
    used = set()
    for e in k.body:
        if isinstance(e, Compute) and e.op is not Op.MATMUL:
            used.update(e.src)
        if isinstance(e, Load):
            used.update(i.value for i in e.indirect)
    used.update(s.value for s in k.stores)
    drop = parts.operands - used
    strides = _row_major(k.domain)
    temps: list[Node] = []
    new: dict[int, int] = {}
    body: list[Load | Compute] = []
    for i, e in enumerate(k.body):
        if i in drop:
            continue
        if isinstance(e, Compute) and e.op is Op.MATMUL:
            t = Node(Op.INPUT, e.dtype, tuple(k.domain), (), f"kz_mm{len(temps)}")
            temps.append(t)
            e = Load(t, strides)
        elif isinstance(e, Compute):
            e = replace(e, src=tuple(new[s] for s in e.src))
        elif e.indirect:
            e = replace(e, indirect=tuple(replace(x, value=new[x.value]) for x in e.indirect))
        new[i] = len(body)
        body.append(e)
    stores = tuple(replace(s, value=new[s.value]) for s in k.stores)
    return replace(k, kind=KernelKind.POINTWISE, body=tuple(body), stores=stores), tuple(temps)


def _row_major(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    out: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        out.append(acc)
        acc = acc * d
    return tuple(reversed(out))


def _operand_view(
    t: torch.Tensor, ld: Load, shape: Sequence[int], axes: Sequence[int], sizes: Mapping[str, int]
) -> torch.Tensor:
    from kernelize.ir.shapes import bind

    strides = bind(tuple(ld.strides[a] for a in axes), sizes)
    return torch.as_strided(t, tuple(shape), tuple(strides), int(bind((ld.offset,), sizes)[0]))


def library_matmuls(k: Kernel, reads: Sequence[torch.Tensor], sizes: Mapping[str, int]) -> list[torch.Tensor]:
    """Each matmul of ``k`` computed by torch on the kernel's operand buffers, row major over the domain."""
    from kernelize.ir.shapes import bind

    parts = matmul_parts(k)
    rank = len(k.domain)
    dom = bind(k.domain, sizes)
    index = {b: i for i, b in enumerate(k.reads)}
    a = k.body[parts.a]
    kk = int(bind((contraction(k, k.body[parts.mms[0][0]], a, "cpu"),), sizes)[0])
    batch = list(range(rank - 2))
    av = _operand_view(reads[index[a.buffer]], a, (*dom[:-1], kk), (*batch, rank - 2, rank), sizes)
    out = []
    for mi, ib in parts.mms:
        b = k.body[ib]
        dtype = k.body[mi].dtype
        bv = _operand_view(
            reads[index[b.buffer]], b, (*dom[:-2], kk, dom[-1]), (*batch, rank, rank - 1), sizes
        )
        if av.dtype == bv.dtype == dtype.torch:
            out.append(torch.matmul(av, bv).contiguous())
        else:  # mixed operands: the reference semantics, math in the accumulator type
            ct = torch.float64 if dtype is DType.F64 else torch.float32
            out.append(torch.matmul(av.to(ct), bv.to(ct)).to(dtype.torch).contiguous())
    return out


def rows_of(k: Kernel, sizes: Mapping[str, int]) -> int:
    """How many rows the matmul kernel ``k`` has under ``sizes``."""
    from kernelize.ir.shapes import bind

    return math.prod(bind(k.domain[:-1], sizes))


__all__ = [
    "FEW_ROWS",
    "MatmulParts",
    "epilogue_kernel",
    "library_matmuls",
    "matmul_parts",
    "render_gemv",
    "rows_of",
]
