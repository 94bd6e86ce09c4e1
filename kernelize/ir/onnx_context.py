"""What an ONNX op converter sees: :class:`NodeContext` (inputs, attributes, the graph) and :class:`SymInts`.

Each ONNX value is one of three things while loading:

* a :class:`~kernelize.ir.graph.Node` of the graph being built (known only at run time),
* a ``torch.Tensor`` known at load time (initializers, ``Constant``, everything computed from constants),
* a :class:`SymInts`: a small int tensor (a shape or a piece of one) whose elements are sizes, some symbolic.

Converters are small functions ``fn(ctx) -> value | tuple[value | None, ...]``. They read operands with
``ctx.x(i)`` (a graph node; a constant is materialised), ``ctx.const(i)`` (the tensor when it is known),
``ctx.ints(i)`` / ``ctx.dims(i)`` (load-time integer lists) and attributes with ``ctx.attr(name, default)``.

Example:
    >>> def relu(ctx: NodeContext) -> Node:
    ...     return ctx.g.clamp(ctx.x(0), 0.0)
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from kernelize.ir.dtypes import DType
from kernelize.ir.errors import FoldLimitError, UnsupportedOpError
from kernelize.ir.graph import Graph, Node
from kernelize.ir.shapes import Dim, Shape

# constants folded at load time are capped: a tiny model (ConstantOfShape([20000, 20000]) -> ReduceSum) must
# not allocate gigabytes while loading; larger values stay run-time computations
FOLD_LIMIT_ENV = "KERNELIZE_FOLD_LIMIT"
DEFAULT_FOLD_LIMIT = 64 * 2**20


def fold_limit(value: int | None = None) -> int:
    """The folding cap in bytes: ``value`` if given, else ``$KERNELIZE_FOLD_LIMIT``, else 64 MiB."""
    source = "fold_limit"
    if value is None:
        raw = os.environ.get(FOLD_LIMIT_ENV, "").strip()
        if not raw:
            return DEFAULT_FOLD_LIMIT
        source = f"{FOLD_LIMIT_ENV}={raw!r}"
        value = int(raw) if raw.isdigit() else -1
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}: the folding cap is a byte count (an int >= 0), got {value!r}")
    return value


def nbytes(shape: Sequence[Dim], dtype: DType) -> int:
    """Bytes of a static shape (``math.prod`` of python ints: no overflow)."""
    return math.prod(int(d) for d in shape) * dtype.itemsize


# ONNX element types the IR has; everything else is unsupported
ONNX_TO_DTYPE = {
    TensorProto.FLOAT: DType.F32,
    TensorProto.DOUBLE: DType.F64,
    TensorProto.FLOAT16: DType.F16,
    TensorProto.BFLOAT16: DType.BF16,
    TensorProto.INT8: DType.I8,
    TensorProto.INT16: DType.I16,
    TensorProto.INT32: DType.I32,
    TensorProto.INT64: DType.I64,
    TensorProto.UINT8: DType.U8,
    TensorProto.BOOL: DType.BOOL,
}


def onnx_type_name(elem_type: int) -> str:
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"<unknown element type {elem_type}>"


def to_dtype(elem_type: int, what: str) -> DType:
    """The IR dtype of an ONNX element type; ``UnsupportedOpError`` naming ``what`` when there is none."""
    try:
        return ONNX_TO_DTYPE[elem_type]
    except KeyError:
        supported = ", ".join(onnx_type_name(t) for t in ONNX_TO_DTYPE)
        raise UnsupportedOpError(
            f"{what} has ONNX element type {onnx_type_name(elem_type)}, which kernelize "
            f"does not support (supported: {supported})"
        ) from None


def tensor_from_numpy(a: np.ndarray) -> torch.Tensor:
    """A torch copy of a numpy array, bfloat16 (``ml_dtypes``) included."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype == np.uint8 or a.dtype.kind in "fbi":
        return torch.from_numpy(np.array(a, copy=True))
    raise UnsupportedOpError(f"numpy dtype {a.dtype} has no kernelize dtype")


def tensor_from_proto(t: TensorProto, what: str) -> torch.Tensor:
    to_dtype(t.data_type, what)
    if t.data_location == TensorProto.EXTERNAL and not t.raw_data:
        raise ValueError(
            f"{what}: tensor {t.name!r} keeps its data in an external file that was not loaded; "
            "load the model from its path (not from bytes) so the data file is found"
        )
    raw = t.raw_data if t.data_type in _RAW_DTYPES and t.data_location != TensorProto.EXTERNAL else b""
    count = math.prod(t.dims)
    if raw and len(raw) == count * _RAW_DTYPES[t.data_type].itemsize:
        # the tensor over the bytes object the proto handed out (no second copy of BERT-base's 440 MB of
        # weights); torch warns that the buffer is read-only, and nothing writes a constant
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(raw, dtype=_RAW_DTYPES[t.data_type]).reshape(tuple(t.dims))
    return tensor_from_numpy(numpy_helper.to_array(t))


# little-endian element types whose raw bytes are the tensor's (ONNX stores raw_data little-endian)
_RAW_DTYPES = (
    {
        TensorProto.FLOAT: torch.float32,
        TensorProto.DOUBLE: torch.float64,
        TensorProto.FLOAT16: torch.float16,
        TensorProto.BFLOAT16: torch.bfloat16,
        TensorProto.INT64: torch.int64,
        TensorProto.INT32: torch.int32,
    }
    if sys.byteorder == "little"
    else {}
)


@dataclass(frozen=True)
class SymInts:
    """A 0-d or 1-d integer tensor whose elements are sizes, at least one of them symbolic.

    ``Shape(x)`` of a value with a ``batch`` dim gives ``SymInts((batch, 64))``; ``Gather``/``Concat``/...
    of it stay symbolic so that ``Reshape`` / ``Expand`` / ``ConstantOfShape`` get a shape at load time.
    """

    dims: tuple[Dim, ...]
    scalar: bool = False
    dtype: DType = DType.I64

    @property
    def shape(self) -> Shape:
        return () if self.scalar else (len(self.dims),)


Value = Node | torch.Tensor | SymInts
Converter = Callable[["NodeContext"], Any]


def sym_or_const(
    dims: Sequence[Dim], scalar: bool = False, dtype: DType = DType.I64
) -> torch.Tensor | SymInts:
    """A constant tensor when every element is static, else a :class:`SymInts`."""
    if all(isinstance(d, int) for d in dims):
        t = torch.tensor([int(d) for d in dims], dtype=dtype.torch)
        return t.reshape(()) if scalar else t
    return SymInts(tuple(dims), scalar, dtype)


class NodeContext:
    """One ONNX node being converted: its operands, attributes, opset and the graph to build into."""

    def __init__(
        self,
        g: Graph,
        node: onnx.NodeProto,
        opset: int,
        values: Sequence[Value | None],
        where: str,
        limit: int = DEFAULT_FOLD_LIMIT,
    ) -> None:
        self.g = g
        self.limit = limit  # folding cap in bytes
        self.node = node
        self.opset = opset
        self.values = list(values)
        self.where = where
        self.attrs = {a.name: a for a in node.attribute}

    # -- identity and errors ------------------------------------------------------------------------------
    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def name(self) -> str:
        return self.node.name or f"{self.node.op_type}->{','.join(self.node.output)}"

    def describe(self) -> str:
        return f"ONNX node {self.name!r} ({self.op_type}, opset {self.opset}) in {self.where}"

    def unsupported(self, reason: str) -> UnsupportedOpError:
        """An error naming op type, node name and opset; ``raise ctx.unsupported("...")``."""
        return UnsupportedOpError(f"{self.describe()}: {reason}")

    def fits(self, shape: Sequence[Dim], dtype: DType) -> bool:
        """Whether a load-time tensor of ``shape`` and ``dtype`` is within the folding cap."""
        return nbytes(shape, dtype) <= self.limit

    def too_large(self, what: str, shape: Sequence[Dim], dtype: DType) -> FoldLimitError:
        """The error for a load-time value over the cap that the IR cannot compute at run time."""
        return FoldLimitError(
            f"{self.describe()}: {what} would be a {dtype}{list(shape)} constant of {nbytes(shape, dtype)} "
            f"bytes, over the folding cap of {self.limit} bytes, and the IR cannot compute it at run time; "
            f"raise the cap with load_onnx(..., fold_limit=bytes) or ${FOLD_LIMIT_ENV} if it is intended"
        )

    # -- outputs ------------------------------------------------------------------------------------------
    @property
    def n_outputs(self) -> int:
        """Number of outputs the model uses (trailing and empty-named optional outputs do not count)."""
        names = list(self.node.output)
        while names and not names[-1]:
            names.pop()
        return len(names)

    def wants_output(self, i: int) -> bool:
        return i < len(self.node.output) and bool(self.node.output[i])

    # -- attributes ---------------------------------------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute's value: ints, floats, strings (decoded), lists of those, or a tensor."""
        a = self.attrs.get(name)
        if a is None:
            return default
        if a.type == onnx.AttributeProto.TENSOR:
            return tensor_from_proto(a.t, f"attribute {name!r} of {self.describe()}")
        kinds = onnx.AttributeProto
        if a.type in (kinds.GRAPH, kinds.GRAPHS, kinds.SPARSE_TENSOR, kinds.TENSORS, kinds.TYPE_PROTO):
            raise self.unsupported(f"attribute {name!r} of kind {kinds.AttributeType.Name(a.type)}")
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, list):
            return [s.decode() if isinstance(s, bytes) else s for s in v]
        return v

    # -- inputs -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.values)

    def has(self, i: int) -> bool:
        """Whether optional input ``i`` is given (present and not the empty name)."""
        return i < len(self.values) and self.values[i] is not None

    def value(self, i: int) -> Value:
        if not self.has(i):
            raise ValueError(f"required input {i} is missing")
        return self.values[i]

    def x(self, i: int) -> Node:
        """Input ``i`` as a graph node (constants are materialised, uniform ones as a broadcast scalar)."""
        v = self.value(i)
        if isinstance(v, Node):
            return v
        if isinstance(v, SymInts):
            sizes = [str(d) for d in v.dims]
            raise self.unsupported(
                f"input {i} is a shape with symbolic sizes {sizes} needed as a run-time "
                "tensor; give those dims static sizes with "
                "load_onnx(..., dynamic_dims={name: size})"
            )
        return materialize(self.g, v)

    def const(self, i: int) -> torch.Tensor | None:
        """Input ``i`` when it is known at load time, else None."""
        v = self.values[i] if i < len(self.values) else None
        return v if isinstance(v, torch.Tensor) else None

    def ints(self, i: int, what: str = "") -> list[int] | None:
        """Load-time ints of input ``i`` (None when absent); UnsupportedOpError when known at run time."""
        if not self.has(i):
            return None
        t = self.const(i)
        if t is None:
            raise self.unsupported(
                f"input {i}{' (' + what + ')' if what else ''} must be known at load time "
                "(a constant or computed from constants and static shapes)"
            )
        return [int(v) for v in t.reshape(-1).tolist()]

    def scalar(self, i: int, default: Any = None, what: str = "") -> Any:
        """Load-time python scalar of input ``i`` (``default`` when absent)."""
        if not self.has(i):
            return default
        t = self.const(i)
        if t is None:
            raise self.unsupported(f"input {i}{' (' + what + ')' if what else ''} must be known at load time")
        if t.numel() != 1:
            raise ValueError(f"{self.describe()}: input {i} must hold one value, got shape {list(t.shape)}")
        return t.reshape(()).item()

    def dims(self, i: int) -> list[Dim]:
        """A shape-like input (1-d ints) as sizes, symbolic ones included."""
        v = self.value(i)
        if isinstance(v, SymInts):
            return list(v.dims)
        return self.ints(i, "a shape")

    def dtype(self, i: int) -> DType:
        v = self.value(i)
        return DType.from_torch(v.dtype) if isinstance(v, torch.Tensor) else v.dtype

    def shape(self, i: int) -> Shape:
        v = self.value(i)
        return tuple(v.shape)

    def rank(self, i: int) -> int:
        return len(self.shape(i))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def materialize(g: Graph, t: torch.Tensor) -> Node:
    """A constant as a graph node; a tensor holding one repeated value becomes a broadcast scalar."""
    if t.numel() > 1 and _uniform(t.reshape(-1)):
        return g.broadcast(g.const(t.reshape(-1)[0]), tuple(t.shape))
    return g.const(t)


def _uniform(flat: torch.Tensor) -> bool:
    """All elements bitwise equal (NaN equals NaN, -0.0 differs from 0.0: the broadcast is exact)."""
    bits = flat if flat.dtype is torch.bool else flat.contiguous().view(_BITS[flat.element_size()])
    n, k = len(bits), min(len(bits), 8)
    # integer probe positions: an f32 linspace rounds n - 1 up past the end once n > 2**24
    probe = bits[torch.arange(k) * (n - 1) // max(k - 1, 1)]
    if bool((probe != bits[0]).any()):  # weights differ early: skip the full pass
        return False
    return bool((bits == bits[0]).all())


__all__ = [
    "DEFAULT_FOLD_LIMIT",
    "FOLD_LIMIT_ENV",
    "ONNX_TO_DTYPE",
    "Converter",
    "NodeContext",
    "SymInts",
    "Value",
    "fold_limit",
    "materialize",
    "nbytes",
    "onnx_type_name",
    "sym_or_const",
    "tensor_from_numpy",
    "tensor_from_proto",
    "to_dtype",
]
