"""The per-op render table shared by the code generators.

:class:`Renderer` turns one elementwise :class:`~kernelize.autokernel.kernels.Compute` into an expression
string from its operands' expressions. The base table is C++ (used as is by the CPU and CUDA backends,
whose template preludes define the ``kz_*`` helpers with the same semantics); the Triton renderer
overrides entries. Reductions and row ops are rendered by each backend's kernel templates, not here.
The helpers below the class (entry-point names, body closures, the matmul contraction size) are the
kernel-spec questions every backend asks the same way.

Example:
    >>> r = Renderer()
    >>> r.expr(Compute(Op.ADD, DType.F32, (0, 1)), ["v0", "v1"])
    '(v0 + v1)'
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from kernelize.autokernel.kernels import Compute, Kernel, Load
from kernelize.ir.dtypes import DType, compute_dtype
from kernelize.ir.graph import Op
from kernelize.ir.shapes import Dim, Sym

if TYPE_CHECKING:
    from kernelize.ir.score_mod import ScoreMod

RenderFn = Callable[["Renderer", Compute, Sequence[str]], str]


def call(name: str) -> RenderFn:
    return lambda r, e, a: f"{name}({', '.join(a)})"


def float_call(name: str) -> RenderFn:
    """``name(x)`` on floats; integers pass through (floor, ceil and round of an integer are itself)."""
    return lambda r, e, a: f"{name}({a[0]})" if e.dtype.is_float else a[0]


def _infix(sym: str) -> RenderFn:
    return lambda r, e, a: f"({a[0]} {sym} {a[1]})"


class Renderer:
    """Render table for C-family backends; subclasses override ``OP_RENDER`` entries and type names."""

    # C type used for arithmetic on a value of each IR dtype (16-bit floats compute in f32)
    CTYPE: ClassVar[dict[DType, str]] = {
        DType.F32: "float",
        DType.F64: "double",
        DType.I8: "int8_t",
        DType.I16: "int16_t",
        DType.I32: "int32_t",
        DType.I64: "int64_t",
        DType.U8: "uint8_t",
        DType.BOOL: "bool",
    }

    OP_RENDER: ClassVar[dict[Op, RenderFn]] = {
        Op.ABS: call("kz_abs"),
        Op.NEG: lambda r, e, a: f"(-{a[0]})",
        Op.EXP: call("kz_exp"),
        Op.LOG: call("kz_log"),
        Op.SQRT: call("kz_sqrt"),
        Op.RSQRT: call("kz_rsqrt"),
        Op.RECIPROCAL: lambda r, e, a: f"({r.literal(1, e.dtype)} / {a[0]})",
        Op.SIN: call("kz_sin"),
        Op.COS: call("kz_cos"),
        Op.TANH: call("kz_tanh"),
        Op.SIGMOID: call("kz_sigmoid"),
        Op.ERF: call("kz_erf"),
        Op.SOFTPLUS: call("kz_softplus"),
        Op.FLOOR: float_call("kz_floor"),
        Op.CEIL: float_call("kz_ceil"),
        Op.ROUND: float_call("kz_round"),
        Op.SIGN: call("kz_sign"),
        Op.NOT: lambda r, e, a: f"(!{a[0]})",
        Op.CAST: lambda r, e, a: r.cast(a[0], e.dtype),
        Op.CLAMP: lambda r, e, a: (
            f"kz_clamp({a[0]}, {r.literal(e.arg.lo, e.dtype)}, {r.literal(e.arg.hi, e.dtype)})"
        ),
        Op.GELU: lambda r, e, a: f"kz_gelu_tanh({a[0]})" if e.arg == "tanh" else f"kz_gelu({a[0]})",
        Op.ADD: _infix("+"),
        Op.SUB: _infix("-"),
        Op.MUL: _infix("*"),
        Op.DIV: lambda r, e, a: f"({a[0]} / {a[1]})" if e.dtype.is_float else f"kz_idiv({a[0]}, {a[1]})",
        Op.MIN: call("kz_min"),
        Op.MAX: call("kz_max"),
        Op.POW: call("kz_pow"),
        Op.MOD: lambda r, e, a: (
            f"kz_fmod({a[0]}, {a[1]})" if e.dtype.is_float else f"kz_imod({a[0]}, {a[1]})"
        ),
        Op.EQ: _infix("=="),
        Op.NE: _infix("!="),
        Op.LT: _infix("<"),
        Op.LE: _infix("<="),
        Op.GT: _infix(">"),
        Op.GE: _infix(">="),
        Op.AND: _infix("&&"),
        Op.OR: _infix("||"),
        Op.WHERE: lambda r, e, a: f"({a[0]} ? {a[1]} : {a[2]})",
    }

    # C type of a buffer element of each IR dtype; backends with 16-bit floats add their storage types
    STORAGE: ClassVar[dict[DType, str]] = CTYPE

    def expr(self, e: Compute, args: Sequence[str]) -> str:
        """The expression computing ``e`` from its operands' expressions."""
        try:
            fn = self.OP_RENDER[e.op]
        except KeyError:
            raise NotImplementedError(
                f"{type(self).__name__} has no elementwise rendering for {e.op}"
            ) from None
        return fn(self, e, args)

    def ctype(self, dtype: DType) -> str:
        """The type arithmetic on ``dtype`` values uses."""
        return self.CTYPE[compute_dtype(dtype)]

    def storage(self, dtype: DType) -> str:
        """The C type of a buffer element of ``dtype``."""
        return self.STORAGE[dtype]

    def concat(self, e: Compute, index: str) -> str:
        """The value of a concat ``e`` at position ``index`` of its axis: nested selects over its operands."""
        ends = e.arg.ends
        where = self.OP_RENDER[Op.WHERE]
        expr = f"v{e.src[-1]}"
        for s, end in zip(reversed(e.src[:-1]), reversed(ends[: len(e.src) - 1])):
            expr = where(self, e, [f"{index} < {self.dim(end)}", f"v{s}", expr])
        return expr

    def cast(self, value: str, dtype: DType) -> str:
        if dtype is DType.BOOL:
            return f"({value} != 0)"
        return f"(({self.ctype(dtype)})({value}))"

    def literal(self, value: float | int | bool, dtype: DType) -> str:
        """A constant of ``dtype``'s compute type."""
        dtype = compute_dtype(dtype)
        if dtype is DType.BOOL:
            return "true" if value else "false"
        if not dtype.is_float:
            return f"(({self.ctype(dtype)}){int(value)}LL)" if dtype is DType.I64 else str(int(value))
        if math.isnan(value):
            return "NAN" if dtype is DType.F32 else "((double)NAN)"
        if math.isinf(value):
            return ("" if value > 0 else "-") + ("INFINITY" if dtype is DType.F32 else "((double)INFINITY)")
        text = repr(float(value))
        return text + "f" if dtype is DType.F32 else text

    def sym(self, name: str) -> str:
        """The runtime argument holding symbolic dimension ``name``."""
        return f"s_{name}"

    def dim(self, d: Dim) -> str:
        """An index expression for a size, stride or offset (symbolic parts read runtime arguments)."""
        if isinstance(d, Sym):
            parts = ([str(d.coef)] if d.coef != 1 else []) + [self.sym(n) for n in d.names]
            return "(" + " * ".join(parts) + ")"
        return str(d)


def score_mod_lines(
    r: Renderer, mod: ScoreMod | None, inputs: Sequence[str], typed: bool = True
) -> tuple[list[str], str]:
    """Statements computing an attention score modification from its four inputs' expressions (score,
    query position, key position, head), and the name of the result. ``typed``: C declarations
    (``float sm4 = ...;``), else Python assignments (Triton). No modification: no lines, the score."""
    names = list(inputs)
    lines: list[str] = []
    for st in mod.steps if mod is not None else ():
        name = f"sm{len(names)}"
        if st.op is Op.CONST:
            expr = r.literal(st.arg, st.dtype)
        else:
            expr = r.expr(Compute(st.op, st.dtype, st.src, st.arg), [names[i] for i in st.src])
        lines.append(f"const {r.ctype(st.dtype)} {name} = {expr};" if typed else f"{name} = {expr}")
        names.append(name)
    return lines, names[-1] if len(names) > len(inputs) else names[0]


def c_name(kernel_name: str) -> str:
    """The C identifier of a kernel's entry point (``kz_`` + the name, other characters as ``_``)."""
    return "kz_" + re.sub(r"\W", "_", kernel_name)


def gather_error(kernel: Kernel, backend: str) -> str:
    """What a gather kernel reports for an index out of range (the CPU kernels' nonzero return, the GPU
    kernels' error flag), with the sizes the indices must respect."""
    body = getattr(kernel, "body", ())  # node kernels (a router) have no gathers and never fail
    sizes = sorted({str(ind.size) for e in body if isinstance(e, Load) for ind in e.indirect})
    n = " or ".join(sizes) or "n"
    return (
        f"{backend} kernel {kernel.name}: a gather index is out of range: the gathered axis has {n} entries, "
        f"so an index must be in [-{n}, {n}) (negative ones count from the end); check the indices fed to "
        "the gather (e.g. token ids against the vocabulary size)"
    )


def gathers(kernel: Kernel) -> bool:
    """Whether ``kernel`` has an indirect (gather) load: its GPU spellings then take an error flag
    (``kz_err``, one int32 the kernel sets for an index out of range) and the launcher asserts it is 0
    afterwards (``torch._assert_async``: asynchronous on a GPU, as torch's own index checks)."""
    return any(isinstance(e, Load) and e.indirect for e in kernel.body)


def deps(e: Load | Compute) -> Sequence[int]:
    """The body entries ``e`` reads: a compute's operands, a load's gather indices."""
    return [ind.value for ind in e.indirect] if isinstance(e, Load) else e.src


def closure(kernel: Kernel, roots: Sequence[int], skip: Sequence[bool]) -> list[int]:
    """Body entries needed to compute ``roots`` (operands and gather indices), in body order, without
    those marked ``skip`` (values already in scope, e.g. per-row scalars)."""
    need: set[int] = set()
    stack = [r for r in roots if not skip[r]]
    while stack:
        i = stack.pop()
        if i in need:
            continue
        need.add(i)
        stack += [d for d in deps(kernel.body[i]) if not skip[d]]
    return sorted(need)
