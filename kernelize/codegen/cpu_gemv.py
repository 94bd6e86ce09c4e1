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
* more rows, an f32 matmul over a constant weight, on a CPU without AVX-512 (:func:`cpu_gemm`): the
  tiles of the generated dense conv (``cpu_conv.h``) as a GEMM, the weight packed once into their panels,
  with a bias, GELU or residual epilogue applied in registers before the only store
  (:class:`GeneratedGemm`); a fixed C call, so it replays between the other generated kernels. Other
  epilogues: the tiles' product into a temporary, then the epilogue kernel.
* more rows otherwise: a library GEMM (measured 2-7x faster than a generated row-at-a-time kernel at 256+
  rows) into a temporary, and a generated pointwise kernel (the same epilogue) reads it. An f32 matmul over
  a constant weight runs in oneDNN with the weight packed once into its blocked layout where torch runs
  AVX-512 (see :func:`onednn_gemm`); others run ``torch.matmul`` (MKL). When the epilogue is only a bias,
  an exact or tanh GELU, a residual add or a multiply (:func:`direct_gemm`), oneDNN applies it as
  post-ops and its result is the kernel's output: no temporary, no epilogue pass. A weight that is an
  input (a hub layer's parameter, which an optimizer may change between calls) takes that path unpacked
  when it is laid out like ``nn.Linear``'s (N, K). The demo decoder's marked projections, 1024 rows x
  256 -> 768, 2 threads: MKL and the epilogue's copy 2.7-3.1 ms -> 2.5 ms (``nn.Linear`` 2.5-2.9 ms).
  bf16 / f16 operands on a CPU without 16-bit dot-product instructions (x86 without AVX512-BF16 / AMX,
  see :func:`lowp_gemm_in_f32`) are widened to f32 for the GEMM and the product rounded back: torch's
  16-bit GEMM falls back to a slow path there (measured 6.6x slower than widening, AVX2, 2048 x 512 x 1536)
  and the result is the same up to summation order (both accumulate in f32, round once).

Example:
    >>> ck = CpuBackend().compile(matmul_kernel)  # doctest: +SKIP
    >>> ck.launch([x, w, bias], [y], {"n2": 1})  # one row: the few-row kernel  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kernelize.autokernel.kernels import ExpertsKernel, Kernel, Load, MatmulKernel, dispatch
from kernelize.autokernel.matmul import matmul_parts, row_major, row_sides, weights_shared
from kernelize.codegen.render import closure
from kernelize.codegen.template import fill, load_template
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Op
from kernelize.ir.shapes import Dim, bind, numel
from kernelize.runtime.backend import CCall

AXPY_COLUMNS = 2048  # columns per block when some weight is not contiguous along K (see kz_axpy_cols)
PLAIN = (False, "none", "", None)  # the epilogue form of a bare product in the tiles (:func:`_gemm_function`)


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
    accesses.insert(0, accesses.pop(slot[f"kz_l{parts.a}"]))  # x first: the packing loop reads kz_rb[0]
    slot = {name: s for s, (name, _) in enumerate(accesses)}
    a_ks = a.strides[rank]
    a_load = f"kz_ld({w.ptr[a.buffer]}, kz_la" + (f" + kz_kk * {r.dim(a_ks)})" if a_ks != 0 else ")")
    forms = _forms(k, parts, acc_t, last)
    dot = all(f == "dot" for f in forms)
    # bf16 weights read as pairs (x packed to match): only when every matmul reads bf16 in the dot form
    pairs = "true" if dot and all(k.body[ib].dtype is DType.BF16 for _, ib in parts.mms) else "false"
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
        K=r.dim(k.k),
        NSLOT=str(len(accesses)),
        NOUTER=str(max(last, 1)),
        ROW_SETUP="\n".join(_row_setup(w, accesses, slot, last)),
        A_LOAD=a_load,
        ACC_T=acc_t,
        PAIRS=pairs,
        PARALLEL_MIN="32768",
        CB="KZ_NB" if dot else str(AXPY_COLUMNS),
        J=f"i{last}",
        COLS="\n".join(_column_lines(w, parts, forms, slot, pairs)),
        EPILOGUE="\n".join(_epilogue(w, parts, accesses, slot, acc_t)),
    )


def _row_setup(w: Any, accesses: list, slot: dict[str, int], last: int) -> list[str]:
    """Per output row: its outer indices and the base offset of every access."""
    ind = " " * 12
    setup = w.outer_index(last, "kz_o", ind)
    setup += [f"{ind}kz_ri[{d}][kz_r] = i{d};" for d in range(last)]
    for name, acc in accesses:
        terms = [w.r.dim(acc.offset)] + [
            f"i{d} * {w.r.dim(acc.strides[d])}" for d in range(last) if acc.strides[d]
        ]
        setup.append(f"{ind}kz_rb[{slot[name]}][kz_r] = {' + '.join(terms)};")
    return setup


def _forms(k: Kernel, parts: Any, acc_t: str, last: int) -> list[str]:
    """How each matmul reads its weight: ``dot`` (contiguous along K, every matmul so), ``axpy``
    (contiguous along N) or ``generic``."""
    forms = []
    for _, ib in parts.mms:
        b = k.body[ib]
        ns, ks = b.strides[last], b.strides[last + 1]
        forms.append("dot" if ks == 1 and ns != 0 else "axpy" if ns == 1 and ks != 0 else "generic")
    if acc_t != "float":
        return ["generic"] * len(forms)
    if all(f == "dot" for f in forms):
        return forms
    return ["generic" if f == "dot" else f for f in forms]


def _column_lines(w: Any, parts: Any, forms: list[str], slot: dict[str, int], pairs: str) -> list[str]:
    """For each matmul, the call that accumulates a block of columns over the rows."""
    r, cols, ind = w.r, [], " " * 20
    for m, ((_, ib), form) in enumerate(zip(parts.mms, forms)):
        b = w.k.body[ib]
        shared = all(b.strides[d] == 0 for d in range(w.rank - 1))
        ptr, bslot = w.ptr[b.buffer], slot[f"kz_l{ib}"]
        wt = r.storage(b.dtype)
        ns, ks = r.dim(b.strides[w.rank - 1]), r.dim(b.strides[w.rank])
        nrows, sh = ("1", "true") if shared else ("kz_nr", "false")
        if form == "dot":
            cols += [
                f"{ind}{{ const {wt}* kz_w[KZ_MAXR * KZ_NB];",
                f"{ind}  for (int kz_r = 0; kz_r < {nrows}; ++kz_r)",
                f"{ind}    for (int kz_j = 0; kz_j < KZ_NB; ++kz_j)  // short block: last column again",
                f"{ind}      kz_w[kz_r * KZ_NB + kz_j] = {ptr} + kz_rb[{bslot}][kz_r] + "
                f"(kz_c0 + (kz_j < kz_nb ? kz_j : kz_nb - 1)) * {ns};",
                f"{ind}  const char* kz_pf = kz_splitk || kz_b + 1 >= kz_b1 ? 0 : "
                f"(const char*)({ptr} + kz_rb[{bslot}][0] + (kz_c0 + KZ_NB) * {ns});",
                f"{ind}  kz_dot_cols<{pairs}>(kz_x, kz_ldx, kz_nr, kz_w, {sh}, kz_k0, kz_k1, kz_blk[{m}], "
                "kz_pf); }",
            ]
            continue
        strides = f"{ks}, kz_nb" if form == "axpy" else f"{ks}, {ns}, kz_nb"
        cols += [
            f"{ind}{{ const {wt}* kz_w[KZ_MAXR];",
            f"{ind}  for (int kz_r = 0; kz_r < {nrows}; ++kz_r)",
            f"{ind}    kz_w[kz_r] = {ptr} + kz_rb[{bslot}][kz_r] + kz_c0 * {ns};",
            f"{ind}  kz_{form}_cols(kz_x, kz_ldx, kz_nr, kz_w, {sh}, {strides}, kz_k0, kz_k1, kz_blk[{m}], "
            "kz_cb); }",
        ]
    return cols


def _epilogue(w: Any, parts: Any, accesses: list, slot: dict[str, int], acc_t: str) -> list[str]:
    """Per output row: the matmul results, the fused epilogue and the stores."""
    k, ind, last = w.k, " " * 16, w.rank - 1
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
    return epi


def _operand_view(
    t: torch.Tensor, ld: Load, shape: Sequence[int], axes: Sequence[int], sizes: Mapping[str, int]
) -> torch.Tensor:
    strides = bind(tuple(ld.strides[a] for a in axes), sizes)
    # the load's offset counts from the buffer's first element, which need not start its storage (an arena)
    offset = t.storage_offset() + int(bind((ld.offset,), sizes)[0])
    return torch.as_strided(t, tuple(shape), tuple(strides), offset)


def library_matmuls(
    k: Kernel,
    reads: Sequence[torch.Tensor],
    sizes: Mapping[str, int],
    packs: dict | None = None,
    spare: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Each matmul of ``k`` computed by a library GEMM on the kernel's operand buffers, row major over the
    domain. ``packs`` (one dict per compiled kernel) holds oneDNN-packed copies of constant weights;
    ``spare`` an earlier call's outputs, which an MKL GEMM of the same shape writes into (a fresh output per
    call faulted its pages in every time: DeiT-small's 72 GEMM outputs a call, 198 x 384 to 198 x 1536)."""
    parts = matmul_parts(k)
    rank = len(k.domain)
    dom = bind(k.domain, sizes)
    index = {b: i for i, b in enumerate(k.reads)}
    a = k.body[parts.a]
    kk = int(bind((k.k,), sizes)[0])
    batch = list(range(rank - 2))
    av = _operand_view(reads[index[a.buffer]], a, (*dom[:-1], kk), (*batch, rank - 2, rank), sizes)
    shared = weights_shared(k)
    out = []
    for mi, ib in parts.mms:
        b = k.body[ib]
        dtype = k.body[mi].dtype
        bv = _operand_view(
            reads[index[b.buffer]], b, (*dom[:-2], kk, dom[-1]), (*batch, rank, rank - 1), sizes
        )
        constant = packs is not None and b.buffer.op is Op.CONST and (shared or rank == 2)
        if constant and onednn_gemm(av, bv):
            out.append(_packed_matmul(av, bv, dom, packs, mi))
        elif constant and tiles_fit(av, bv):
            a2 = av.reshape(-1, kk)
            into = spare[len(out)] if len(spare) > len(out) else None
            fits = into is not None and into.is_contiguous() and into.shape == tuple(dom)
            y = into.view(a2.shape[0], -1) if fits else None
            out.append(tiles_gemm(a2, bv[(0,) * (bv.dim() - 2)], packs, ("tiles", mi), y=y).view(tuple(dom)))
        elif av.dtype == bv.dtype == dtype.torch and not lowp_gemm_in_f32(dtype):
            into = spare[len(out)] if len(spare) > len(out) else None
            out.append(_matmul(av, bv, shared, dom, into=into))
        else:  # mixed or slow 16-bit operands: the reference semantics, math in the accumulator type
            ct = torch.float64 if dtype is DType.F64 else torch.float32
            out.append(_matmul(av, bv, shared, dom, ct).to(dtype.torch))
    return out


def _matmul(
    av: torch.Tensor,
    bv: torch.Tensor,
    shared: bool,
    dom: Sequence[int],
    ct: torch.dtype | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``av @ bv`` row major over ``dom``, in ``ct`` when given; into ``into`` when it is a contiguous tensor
    of that shape and dtype. With weights shared by every batch index (a linear layer over ``[B, H, W, C]``)
    it is one GEMM over all rows: torch.matmul of the broadcast operands would run a batched GEMM of small
    matrices instead (measured 8x slower on ConvNeXt's MLPs)."""
    flat = shared and av.dim() > 2
    if flat:
        av, bv = av.reshape(-1, av.shape[-1]), bv[(0,) * (bv.dim() - 2)]
    if ct is not None:  # after the slice: a shared weight is widened once, not per batch index
        av, bv = av.to(ct), bv.to(ct)
    if flat or av.dim() == 2:
        fits = into is not None and into.is_contiguous() and into.shape == tuple(dom)
        if fits and into.dtype == av.dtype and into.device == av.device:
            return torch.matmul(av, bv, out=into.view(av.shape[0], bv.shape[-1])).view(tuple(dom))
    out = torch.matmul(av, bv)
    return out.reshape(tuple(dom)) if flat else out.contiguous()


def cpu_gemm(packed: bool = True) -> str:
    """Which library runs an f32 GEMM of more than :data:`FEW_ROWS` rows: ``"generated"`` (the conv tiles
    of ``cpu_conv.h`` as a GEMM, :class:`GeneratedGemm`), ``"onednn"`` or ``"torch"`` (MKL).
    ``KERNELIZE_CPU_GEMM`` decides; by default a compiled graph's GEMMs over constant weights (``packed``)
    take the generated tiles, and the unpacked products of training (:func:`onednn_linear`,
    ``kernelize.hub.train_linear``) oneDNN.

    Measured on AVX-512 (AMD EPYC, 1 thread), the whole ONNX BERT-base against onnxruntime: MKL 1.31x,
    oneDNN packed 0.96x at batch 1; ViT-base 1.19x -> 1.05x. On a Zen 3 EPYC (AVX2, no AVX-512), the GEMMs of
    BERT-base, DeiT-small and the Whisper encoder one by one (hot, GFLOP/s at 1 / 2 threads): MKL 60-90 /
    94-132, oneDNN packed 63-84 / 121-166, onnxruntime (MLAS) 66-91 / 131-185, the generated tiles 90-95 /
    136-154; MKL and oneDNN each lost to the other on some shapes at 2 threads. On a Xeon with AVX-512 (and
    AMX) oneDNN took AVX-512's default until the whole models measured otherwise (kernelize / onnxruntime,
    batch 1, two alternating runs each, 1 / 2 threads): DeiT-small 1.22-1.24 / 1.28 with oneDNN against
    1.00-1.08 / 0.88-1.02 with the tiles, BERT-base 1.11-1.15 / 1.19-1.23 against 1.03-1.05 / 1.14,
    ConvNeXt-tiny 1.09 / 1.10-1.15 against 0.93-0.94 / 0.97-1.03, Swin-tiny 0.89-0.91 / 0.95 against 0.78 /
    0.79-0.80, ViT-base level; one by one the two were level (130-165 GFLOP/s at 198 rows), so the gain is
    the graph's: oneDNN's fixed cost per call, its steps called from Python between replayed ones, and its
    regions on torch's pool."""
    choice = os.environ.get("KERNELIZE_CPU_GEMM", "").strip()
    if choice not in ("", "onednn", "torch", "generated"):
        raise ValueError(f"KERNELIZE_CPU_GEMM={choice!r}: expected `generated`, `onednn` or `torch`")
    if choice:
        return choice
    return "generated" if packed else "onednn"


def onednn_gemm(av: torch.Tensor, bv: torch.Tensor, packed: bool = True) -> bool:
    """Whether an f32 GEMM runs in oneDNN (:func:`cpu_gemm`), over a constant weight (``packed``) packed
    once into oneDNN's blocked layout, instead of the generated tiles or ``torch.matmul`` (MKL)."""
    return (
        cpu_gemm(packed) == "onednn"
        and av.dtype == bv.dtype == torch.float32
        and av.device.type == "cpu"
        and _onednn_linear_ok()
    )


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` as one oneDNN matmul on the weight as it is (no packing: for weights that
    change every step), or None where :func:`onednn_gemm` says no. An LM head's chunk, 256 rows x 512 x
    32000 f32, 2 threads: ``h @ W.T`` 158 -> 209 GFLOP/s, ``dz @ W`` (``weight=W.t()``) 180 -> 208 against
    ``torch.mm`` (MKL); its weight-gradient product ``dz.T @ h`` is faster in MKL (181 against 125)."""
    if x.dim() != 2 or not onednn_gemm(x, weight, packed=False):
        return None
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def _onednn_linear_ok() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


def _packed_matmul(
    av: torch.Tensor, bv: torch.Tensor, dom: Sequence[int], packs: dict, mi: int
) -> torch.Tensor:
    """``av @ bv`` with ``bv`` (a constant weight, the same for every batch index) packed into oneDNN's
    blocked layout on first use."""
    a2 = av.reshape(-1, av.shape[-1])
    if not a2.is_contiguous():
        a2 = a2.contiguous()
    return torch.ops.mkldnn._linear_pointwise(a2, _packed(bv, packs, mi), None, "none", [], "").view(
        tuple(dom)
    )


def _packed(bv: torch.Tensor, packs: dict, mi: int) -> torch.Tensor:
    """The weight ``bv`` (the same for every batch index) in oneDNN's blocked layout, packed on first use.
    The entry keeps the weight view it was packed from, so its memory cannot be reused by another tensor
    while its address is the key."""
    w = bv[(0,) * (bv.dim() - 2)]
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    entry = packs.get(mi)
    if entry is None or entry[0] != key:
        # packed for no particular row count: one copy serves every batch size and sequence length
        entry = (key, w, torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous()))
        packs[mi] = entry
    return entry[2]


@functools.cache
def onednn_gelu() -> bool:
    """Whether a GELU after the GEMM is a oneDNN post-op (else the epilogue kernel's, over the GEMM's
    output). Only where torch's kernels run AVX-512: on an AVX2 CPU (Zen 3) oneDNN's GELU post-op added
    1.8 ms to the 2.9 ms GEMM of a 198 x 1536 output (DeiT-small's MLP, 1 thread), and the GEMM followed by
    the epilogue kernel took that step 4.8 -> 3.7 ms."""
    return _avx512()


@functools.cache
def _avx512() -> bool:
    """Whether torch's CPU kernels (and so oneDNN's) run AVX-512 here: asked once, not per GEMM."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class DirectGemm(NamedTuple):
    """A MATMUL kernel that one oneDNN call computes whole, writing its output: ``act(x @ W + bias)`` or
    ``(x @ W + bias) op residual`` with ``op`` (``binary``) an add or a multiply (the residual add; a gated
    MLP's ``act(gate) * up``); ``bias`` / ``residual``: body positions of their loads, or None."""

    bias: int | None
    residual: int | None
    attr: str  # oneDNN eltwise post-op: "none" or "gelu"
    algorithm: str  # gelu's "none" (erf) or "tanh"
    nhwc: bool = False  # the output is an NCHW buffer laid out NHWC over a domain (N, H, W, C)
    packed: bool = True  # the weight is a constant, packed once; else an input (a layer's parameter) as it is
    binary: str = "add"  # oneDNN binary post-op with the residual: "add" or "mul"


def direct_gemm(k: Kernel, gelu: bool | None = None) -> DirectGemm | None:
    """How ``k`` runs as one oneDNN call over an f32 weight of static shape, or None when it needs the
    epilogue kernel. Skipping the epilogue saves a pass over the output (for a bare matmul, a copy). A
    constant weight is packed once; a weight that is an input (a hub layer's parameter, which may change
    between calls) is read as it is when it is laid out like ``nn.Linear``'s (see :func:`run_direct`).
    ``gelu``: whether a GELU may be in the plan (default: where oneDNN's GELU post-op is fast,
    :func:`onednn_gelu`; the generated GEMM applies it in its epilogue)."""
    parts = matmul_parts(k)
    if len(parts.mms) != 1 or len(k.stores) != 1:
        return None
    (mi, ib), store, rank = parts.mms[0], k.stores[0], len(k.domain)
    weight = k.body[ib].buffer
    if k.body[mi].dtype is not DType.F32 or not all(map(_static, weight.shape)):
        return None
    shape, dom = tuple(store.buffer.shape), tuple(k.domain)
    nhwc = rank == 4 and shape != dom and (shape[0], *shape[2:], shape[1]) == dom
    if store.offset != 0 or not _row_major(store.strides, dom) or (shape != dom and not nhwc):
        return None
    if not (weights_shared(k) or rank == 2):
        return None
    bias = residual = None
    attr, algorithm, binary, cur = "none", "", "add", mi
    for i, e in enumerate(k.body):
        if i in parts.operands or i == mi or isinstance(e, Load):
            continue
        if cur not in e.src or attr != "none" or residual is not None:
            return None
        if e.op is Op.GELU and e.arg in ("none", "tanh") and (onednn_gelu() if gelu is None else gelu):
            attr, algorithm = "gelu", e.arg
        elif e.op in (Op.ADD, Op.MUL) and len(e.src) == 2:
            other = k.body[e.src[0] if e.src[1] == cur else e.src[1]]
            if not isinstance(other, Load) or other.mask or other.indirect or other.offset != 0:
                return None
            at = k.body.index(other)
            if _row_major(other.strides, k.domain) and other.buffer.dtype is DType.F32:
                residual, binary = at, "add" if e.op is Op.ADD else "mul"
            elif e.op is Op.ADD and bias is None and _is_bias(other, k.domain):
                bias = at
            else:
                return None
        else:
            return None
        cur = i
    loads = {i for i, e in enumerate(k.body) if isinstance(e, Load)}
    if store.value != cur or loads - parts.operands - {bias, residual}:
        return None
    return DirectGemm(bias, residual, attr, algorithm, nhwc, weight.op is Op.CONST, binary)


def _row_major(strides: Sequence[Dim], domain: Sequence[Dim]) -> bool:
    """Whether ``strides`` walk ``domain`` row major. An axis of size 1 may have any stride (loads and
    stores give it 0): BERT's and ViT's batch-1 GEMMs missed the direct path over their leading 1."""
    return all(s == r for s, r, d in zip(strides, row_major(domain), domain, strict=True) if d != 1)


def _is_bias(ld: Load, domain: Sequence[Dim]) -> bool:
    """An f32 vector over the output columns, the same for every row."""
    b = ld.buffer
    return (
        b.dtype is DType.F32
        and all(s == 0 for s in ld.strides[:-1])
        and ld.strides[-1] == 1
        and _static(domain[-1])
        and numel(b.shape) == domain[-1]
    )


def _single_operands(
    k: Kernel, reads: Sequence[torch.Tensor], sizes: Mapping[str, int]
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]:
    """The operand views of a one-matmul kernel, row major over the domain: ``x`` ``[..., M, K]`` and the
    weight ``[..., K, N]``, with the bound domain and K."""
    parts = matmul_parts(k)
    rank, dom = len(k.domain), tuple(bind(k.domain, sizes))
    index = {b: i for i, b in enumerate(k.reads)}
    a, b = k.body[parts.a], k.body[parts.mms[0][1]]
    kk = int(bind((k.k,), sizes)[0])
    batch = list(range(rank - 2))
    av = _operand_view(reads[index[a.buffer]], a, (*dom[:-1], kk), (*batch, rank - 2, rank), sizes)
    bv = _operand_view(reads[index[b.buffer]], b, (*dom[:-2], kk, dom[-1]), (*batch, rank, rank - 1), sizes)
    return av, bv, dom, kk


def run_direct(
    k: Kernel, plan: DirectGemm, reads: Sequence[torch.Tensor], sizes: Mapping[str, int], packs: dict
) -> list[torch.Tensor] | None:
    """The output of ``k`` computed by one packed oneDNN call (see :func:`direct_gemm`), or None when this
    call's operands do not qualify (another dtype, ``KERNELIZE_CPU_GEMM=torch``)."""
    av, bv, dom, kk = _single_operands(k, reads, sizes)
    rank, index, mi = len(dom), {b: i for i, b in enumerate(k.reads)}, matmul_parts(k).mms[0][0]
    if not onednn_gemm(av, bv):
        return None
    if plan.packed:
        pw = _packed(bv, packs, mi)
    else:  # oneDNN reads an (N, K) row-major weight as it is; other layouts take the library GEMM
        pw = bv[(0,) * (bv.dim() - 2)].t()
        if not pw.is_contiguous():
            return None
    a2 = av.reshape(-1, kk)
    bias = None if plan.bias is None else reads[index[k.body[plan.bias].buffer]].reshape(-1)
    if plan.residual is None:
        y = torch.ops.mkldnn._linear_pointwise(a2.contiguous(), pw, bias, plan.attr, [], plan.algorithm)
    else:
        r = k.body[plan.residual]
        rv = _operand_view(reads[index[r.buffer]], r, dom, range(rank), sizes).reshape(a2.shape[0], dom[-1])
        y = torch.ops.mkldnn._linear_pointwise.binary(a2.contiguous(), rv.contiguous(), pw, bias, plan.binary)
    y = y.view(tuple(dom))
    return [y.permute(0, 3, 1, 2) if plan.nhwc else y]


class GeneratedGemm:
    """A MATMUL kernel of one f32 matmul over a constant weight and a :class:`DirectGemm` epilogue as one
    generated call (:func:`tiles_gemm`) that applies the epilogue (bias in the accumulators' start, GELU, a
    residual add or multiply) before the only store, into the kernel's own output: no temporary and no
    epilogue pass."""

    def __init__(self, kernel: Kernel, plan: DirectGemm) -> None:
        self.kernel, self.plan = kernel, plan
        self.form = self.form_of(plan)
        self._packs: dict = {}

    @staticmethod
    def form_of(plan: DirectGemm) -> tuple:
        """The epilogue form (:func:`_gemm_function`) of ``plan``."""
        binary = None if plan.residual is None else plan.binary
        return (plan.bias is not None, plan.attr, plan.algorithm, binary)

    def run(
        self, reads: Sequence[torch.Tensor], sizes: Mapping[str, int], out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The kernel's output, into ``out`` (its output buffer) where that is laid out as the store is,
        else a new tensor; None when this call's operands do not qualify (:func:`tiles_fit`)."""
        k, plan = self.kernel, self.plan
        av, bv, dom, kk = _single_operands(k, reads, sizes)
        rank, index, mi = len(dom), {b: i for i, b in enumerate(k.reads)}, matmul_parts(k).mms[0][0]
        m, n = math.prod(dom[:-1]), int(dom[-1])
        if not tiles_fit(av, bv):
            return None
        bias = None if plan.bias is None else reads[index[k.body[plan.bias].buffer]].reshape(-1)
        r = None
        if plan.residual is not None:
            rl = k.body[plan.residual]
            r = _operand_view(reads[index[rl.buffer]], rl, dom, range(rank), sizes).reshape(m, n)
        layout = torch.channels_last if plan.nhwc else torch.contiguous_format
        if out is not None and (out.numel() != m * n or not out.is_contiguous(memory_format=layout)):
            out = None
        y = tiles_gemm(av.reshape(m, kk), bv[(0,) * (bv.dim() - 2)], self._packs, mi, self.form, bias, r, out)
        if y is out:
            return out
        y = y.view(tuple(dom))
        return y.permute(0, 3, 1, 2) if plan.nhwc else y

    def c_call(
        self,
        reads: Sequence[torch.Tensor | None],
        writes: Sequence[torch.Tensor | None],
        sizes: Mapping[str, int],
    ) -> CCall | None:
        """The call :meth:`run` makes, for ``kz_replay`` (a None tensor: a buffer whose pointer is patched per
        run); None where it is not one fixed call: the weight not fixed, a changing buffer read through an
        offset or a non-dense view, a buffer read twice, operands :func:`tiles_fit` refuses."""
        from kernelize.codegen.cpu_conv import gemm_dims

        k, plan = self.kernel, self.plan
        parts = matmul_parts(k)
        rank, dom = len(k.domain), bind(k.domain, sizes)
        (mi, ib), a = parts.mms[0], k.body[parts.a]
        b = k.body[ib]
        kk, m, n = int(bind((k.k,), sizes)[0]), math.prod(dom[:-1]), int(dom[-1])
        index = {buf: i for i, buf in enumerate(k.reads)}
        w = reads[index[b.buffer]]
        f32 = a.buffer.dtype is DType.F32 and w is not None and w.dtype == torch.float32
        if not tiles_take(f32, kk):
            return None
        batch = list(range(rank - 2))
        bv = _operand_view(w, b, (*dom[:-2], kk, dom[-1]), (*batch, rank, rank - 1), sizes)
        w2 = bv[(0,) * (bv.dim() - 2)]
        operands = [(a, (*dom[:-1], kk), (*batch, rank - 2, rank), torch.contiguous_format)]
        operands.append(None if plan.bias is None else (k.body[plan.bias], (n,), (rank - 1,), None))
        if plan.residual is None:
            operands.append(None)
        else:
            operands.append((k.body[plan.residual], dom, range(rank), torch.contiguous_format))
        args, slots = [], [None] * (len(reads) + len(writes))
        for arg, o in zip((0, 2, 3), operands):
            if o is None:
                args.append(0)
                continue
            ld, shape, axes, layout = o
            t, i = reads[index[ld.buffer]], index[ld.buffer]
            if slots[i] is not None or ld.offset != 0:
                return None
            strides = bind(tuple(ld.strides[x] for x in axes), sizes)
            dense = all(st == r for st, r, d in zip(strides, row_major(shape), shape, strict=True) if d != 1)
            if not dense or (t is not None and t.dtype != torch.float32):
                return None
            args.append(0 if t is None else t.data_ptr())
            slots[i] = arg
        y = writes[0]
        layout = torch.channels_last if plan.nhwc else torch.contiguous_format
        if y is None and plan.nhwc or y is not None and not y.is_contiguous(memory_format=layout):
            return None
        slots[len(reads)] = 4
        packed = tiles_packed(w2, self._packs, mi)
        d = gemm_dims(m, kk, n)
        args[1:1] = [packed.data_ptr()]
        args += [0 if y is None else y.data_ptr(), ctypes.addressof(d)]
        fn = ctypes.cast(_gemm_function(*self.form), ctypes.c_void_p).value
        error = f"cpu GEMM of kernel {k.name} rejected its sizes {tuple(d)}"
        return CCall(fn, tuple(args), error, tuple(slots), keep=(d, packed))


def runs_in_tiles(k: Kernel) -> bool:
    """Whether every matmul of the MATMUL kernel ``k`` runs in the generated tiles past its few rows
    (:func:`tiles_take` for its static operands): then no GEMM of it is on torch's OpenMP pool."""
    parts = matmul_parts(k)
    operands = [k.body[parts.a].buffer, *(k.body[ib].buffer for _, ib in parts.mms)]
    constant = all(b.op is Op.CONST for b in operands[1:]) and (weights_shared(k) or len(k.domain) == 2)
    f32 = all(b.dtype is DType.F32 for b in operands)
    return constant and isinstance(k.k, int) and tiles_take(f32, k.k)


def tiles_fit(av: torch.Tensor, bv: torch.Tensor) -> bool:
    """:func:`tiles_take` for the operands of ``av @ bv`` (CPU tensors)."""
    f32 = av.dtype == bv.dtype == torch.float32 and av.device.type == "cpu"
    return tiles_take(f32, av.shape[-1])


def tiles_take(f32: bool, k: int) -> bool:
    """Whether a GEMM runs in the generated tiles (:func:`tiles_gemm`): f32 operands, at most
    ``KZ_ZERO_ROW`` products per output, and that library chosen (:func:`cpu_gemm`: the default unless
    ``KERNELIZE_CPU_GEMM`` names a library). Also the grouped-expert kernel's transposed products
    (``cpu_experts.call_path``): an expert's product over its weight as stored meets MKL / oneDNN at 64 rows
    or fewer, where they are weakest (one Qwen3-MoE layer's experts, 2 threads, Xeon with AVX-512: 128
    tokens 21.6 ms against 39.7 for ``grouped_mm``, 512 tokens 48 against 60)."""
    from kernelize.codegen.cpu_conv import MAX_GROUP_CHANNELS

    return f32 and k <= MAX_GROUP_CHANNELS and cpu_gemm() == "generated"


def tiles_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    packs: dict,
    key: Any,
    form: tuple = PLAIN,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """``epilogue(a @ w)`` (``a``: ``[M, K]``, ``w``: a constant ``[K, N]``) by the dense conv driver of
    ``cpu_conv.h``, which sees the rows as M pixels of K channels of a 1x1 conv: ``w`` packed into its
    panels once (kept in ``packs[key]``), the epilogue ``form`` (:func:`_gemm_function`) applied in
    registers before the only store, into ``y`` (a dense ``[M, N]`` buffer) or a new tensor. Sizes are
    run-time arguments: one compiled function per epilogue form serves every GEMM of a process."""
    from kernelize.codegen import cpu_build
    from kernelize.codegen.cpu_conv import gemm_dims

    m, kk = a.shape
    a = a if a.is_contiguous() else a.contiguous()
    r = None if residual is None else residual.contiguous()
    y = torch.empty(m, w.shape[1], dtype=a.dtype) if y is None else y
    d = gemm_dims(m, kk, w.shape[1])
    ptrs = [0 if t is None else t.data_ptr() for t in (a, tiles_packed(w, packs, key), bias, r, y)]
    if _gemm_function(*form)(*ptrs, d, cpu_build.threads()):
        raise RuntimeError(f"cpu GEMM rejected its sizes {tuple(d)}")
    return y


def tiles_packed(w: torch.Tensor, packs: dict, key: Any) -> torch.Tensor:
    """The constant ``[K, N]`` weight ``w`` in the dense conv driver's panels, packed on first use and kept
    in ``packs[key]`` with the view it was packed from (so its memory is not reused while it is the key)."""
    from kernelize.codegen.cpu_conv import pack_gemm

    shape = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    entry = packs.get(key)
    if entry is None or entry[0] != shape:
        entry = packs[key] = (shape, w, pack_gemm(w))
    return entry[2]


_GEMMS: list[Future] = []  # the library of every epilogue form (templates/cpu_gemm.cpp), built in background
_GEMMS_LOCK = threading.Lock()
_BUILDS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kz-gemm-build")


def gemm_forms(kernels: Sequence[Kernel]) -> set[tuple]:
    """The epilogue forms the generated tiles will run the GEMMs of ``kernels`` with (those MATMUL kernels
    that :func:`runs_in_tiles`): what to build before their first call (:func:`prebuild`)."""
    return {form for k in kernels for form in dispatch(_FORMS_OF, k, "the GEMM tiles")(k)}


def _matmul_forms(k: Kernel) -> set[tuple]:
    if not runs_in_tiles(k) or not row_sides(k)[1]:  # static few rows: never
        return set()
    plan = direct_gemm(k, gelu=True)
    return {GeneratedGemm.form_of(plan) if plan is not None and plan.packed else PLAIN}


def _experts_forms(k: Kernel) -> set[tuple]:  # the many-pair path (cpu_experts.call_path)
    return {PLAIN} if tiles_take(True, 0) and k.node.src[0].dtype is not DType.F64 else set()


_FORMS_OF = {MatmulKernel: _matmul_forms, ExpertsKernel: _experts_forms, Kernel: lambda k: set()}


def prebuild(forms: set[tuple], idle: bool = False) -> None:
    """Start building the GEMM library (:func:`_gemm_function`) in the background where ``forms`` is not
    empty: a backend calls it before it compiles a graph's kernels, so it builds beside them. ``idle``:
    ahead of need, at the lowest CPU priority (``cpu_build.build_shared_object``)."""
    if forms:
        _gemm_library(idle)


def _gemm_library(idle: bool = False) -> Future:
    with _GEMMS_LOCK:
        if not _GEMMS:
            _GEMMS.append(_BUILDS.submit(_build_gemms, idle))
        return _GEMMS[0]


def _gemm_function(bias: bool, attr: str, algorithm: str, binary: str | None):
    """The compiled GEMM of :class:`GeneratedGemm` for one epilogue form: the channel bias (the accumulators
    start at it where the call passes one), then an exact or tanh GELU (``attr``, ``algorithm``), or a
    residual ``binary`` ("add" / "mul", the residual row major like the output)."""
    if attr == "gelu":
        name = "kz_gemm_gelu_tanh" if algorithm == "tanh" else "kz_gemm_gelu"
    else:
        name = f"kz_gemm_{binary or 'plain'}"
    return getattr(_gemm_library().result(), name)


def gemm_address() -> int:
    """The address of the GEMM library's plain entry ``kz_gemm_plain`` (for a generated kernel that calls
    the library itself: the experts' many-pair path), built on first use."""
    return ctypes.cast(_gemm_function(False, "", "", None), ctypes.c_void_p).value


def gemm_source() -> str:
    """The C++ source of the GEMM library (``templates/cpu_gemm.cpp``)."""
    return fill(
        load_template("cpu_gemm.cpp"),
        PRELUDE=load_template("cpu_prelude.h"),
        CONV_LIB=load_template("cpu_conv.h"),
    )


def _build_gemms(idle: bool = False) -> ctypes.CDLL:
    """The library of ``templates/cpu_gemm.cpp``: one driver, every epilogue form an entry point (the form is
    a run-time argument, so every model shares one build)."""
    from kernelize.codegen import cpu_build
    from kernelize.codegen.cpu_conv import ARGTYPES

    lib = cpu_build.load(cpu_build.build_shared_object(gemm_source(), "kz_gemm", idle))
    for name in ("plain", "gelu", "gelu_tanh", "add", "mul"):
        fn = getattr(lib, f"kz_gemm_{name}")
        fn.argtypes, fn.restype = ARGTYPES, ctypes.c_int
    return lib


# CPU flags (Linux /proc/cpuinfo) of instructions that make torch's 16-bit GEMM fast
_NATIVE_LOWP = {
    DType.BF16: ("avx512_bf16", "amx_bf16", "bf16"),
    DType.F16: ("avx512_fp16", "amx_fp16", "fphp"),
}


def lowp_gemm_in_f32(dtype: DType) -> bool:
    """Whether a bf16 / f16 GEMM of more than a few rows runs in f32 on this CPU: when the CPU flags lack the
    16-bit dot-product instructions (AVX512-BF16 / AMX on x86, BF16 / FP16 arithmetic on Arm).
    ``KERNELIZE_CPU_LOWP_GEMM=f32`` or ``=native`` decides instead; without readable CPU flags, native.

    Example:
        >>> lowp_gemm_in_f32(DType.F32)
        False
    """
    if dtype not in _NATIVE_LOWP:
        return False
    choice = os.environ.get("KERNELIZE_CPU_LOWP_GEMM", "").strip()
    if choice in ("f32", "native"):
        return choice == "f32"
    if choice:
        raise ValueError(f"KERNELIZE_CPU_LOWP_GEMM={choice!r}: expected `f32` or `native`")
    flags = _cpu_flags()
    return flags is not None and not any(f in flags for f in _NATIVE_LOWP[dtype])


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


__all__ = [
    "DirectGemm",
    "GeneratedGemm",
    "cpu_gemm",
    "direct_gemm",
    "gemm_forms",
    "gemm_source",
    "library_matmuls",
    "lowp_gemm_in_f32",
    "onednn_gemm",
    "prebuild",
    "render_gemv",
    "runs_in_tiles",
    "tiles_fit",
    "tiles_gemm",
    "run_direct",
]
