"""Few-row matmul forms of a MATMUL kernel, shared by the backends (the plan stays one MATMUL kernel).

Decode multiplies a handful of rows by large weights. Backends keep the planner's MATMUL kernel (matmuls
sharing their left operand, then an elementwise epilogue) and choose per call by the number of rows
(:func:`rows_of`): up to :data:`FEW_ROWS` rows a kernel built around reading each weight byte once, above
that a GEMM. The pieces here rewrite a MATMUL kernel for those paths:

* :func:`epilogue_kernel`: the epilogue alone, as a POINTWISE kernel reading each matmul's result from a
  temporary (the path after a library GEMM, or after split-K partial products);
* :func:`splitk_kernel`: one matmul as a ``SPLITK`` kernel that adds its partial products over a slice
  of K into an f32 temporary (GPU: columns x K slices fill the machine even for one row).

Example:
    >>> epi, temps = epilogue_kernel(matmul_kernel)  # doctest: +SKIP
    >>> parts = [splitk_kernel(matmul_kernel, j, t) for j, t in enumerate(temps)]  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kernelize.autokernel.kernels import (
    Compute,
    Kernel,
    Load,
    MatmulKernel,
    PointwiseKernel,
    SplitKKernel,
    Store,
)
from kernelize.ir.dtypes import DType
from kernelize.ir.graph import Node, Op
from kernelize.ir.shapes import Dim, bind

FEW_ROWS = 16  # at most this many rows take the few-row path; more go to a GEMM


@dataclass(frozen=True)
class MatmulParts:
    """Where the matmuls of a MATMUL kernel sit in its body: ``(matmul, right operand)`` positions."""

    a: int
    mms: tuple[tuple[int, int], ...]

    @property
    def operands(self) -> set[int]:
        return {self.a, *(b for _, b in self.mms)}


def matmul_parts(k: MatmulKernel) -> MatmulParts:
    """The body positions of ``k``'s matmuls (checked when the kernel was made: they share their left
    operand, and every operand is a plain strided load)."""
    return MatmulParts(k.a_index, tuple((m.value, k.body[m.value].src[1]) for m in k.matmuls))


def weights_shared(k: Kernel) -> bool:
    """True when every matmul's right operand is the same for all rows (weights, not a batched matmul)."""
    last = len(k.domain) - 1
    return all(all(k.body[ib].strides[d] == 0 for d in range(last)) for _, ib in matmul_parts(k).mms)


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
    strides = row_major(k.domain)
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
    return PointwiseKernel(k.name, k.domain, tuple(body), stores, computes=k.computes), tuple(temps)


def row_major(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    out: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        out.append(acc)
        acc = acc * d
    return tuple(reversed(out))


def splitk_kernel(k: Kernel, j: int, temp: Node) -> Kernel:
    """Matmul ``j`` of ``k`` as a ``SPLITK`` kernel over ``k.domain``: ``temp`` (f32, row major over the
    domain, zeroed by the caller) += x @ W over each program's slice of K. ``body`` is
    ``(matmul(v1, v2), load x, load W)`` as in a MATMUL kernel; the one store names ``temp``."""
    assert temp.dtype is DType.F32, "split-K partial sums accumulate in an f32 buffer"
    parts = matmul_parts(k)
    mi, ib = parts.mms[j]
    mm = k.body[mi]
    body = (Compute(Op.MATMUL, DType.F32, (1, 2), mm.arg), k.body[parts.a], k.body[ib])
    store = Store(0, temp, row_major(k.domain))
    return SplitKKernel(f"{k.name}_splitk{j}", k.domain, body, (store,))


def rows_of(k: Kernel, sizes: Mapping[str, int]) -> int:
    """How many rows the matmul kernel ``k`` has under ``sizes``."""
    return math.prod(bind(k.domain[:-1], sizes))


def row_sides(k: Kernel) -> tuple[bool, bool]:
    """Whether the matmul kernel ``k`` can have up to ``FEW_ROWS`` rows (a call of none computes nothing), and
    whether it can have more: from its static row dims (a dynamic dim is at least 1)."""
    dims = k.domain[:-1]
    least = math.prod(d for d in dims if isinstance(d, int))
    if least > FEW_ROWS:
        return False, True
    return True, not all(isinstance(d, int) for d in dims)


__all__ = [
    "FEW_ROWS",
    "MatmulParts",
    "epilogue_kernel",
    "matmul_parts",
    "row_major",
    "row_sides",
    "rows_of",
    "splitk_kernel",
    "weights_shared",
]
