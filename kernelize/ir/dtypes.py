"""Element types of graph values, with their torch counterparts."""

from __future__ import annotations

import torch

from kernelize._compat import StrEnum


class DType(StrEnum):
    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    F64 = "f64"
    I8 = "i8"
    I16 = "i16"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"
    BOOL = "bool"

    @property
    def torch(self) -> torch.dtype:
        return _TO_TORCH[self]

    @property
    def itemsize(self) -> int:
        return _TO_TORCH[self].itemsize

    @property
    def is_float(self) -> bool:
        return self in FLOATS

    @property
    def is_int(self) -> bool:
        return self in INTS

    @staticmethod
    def from_torch(dtype: torch.dtype) -> DType:
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            raise TypeError(
                f"torch dtype {dtype} has no kernelize DType; supported: {list(_FROM_TORCH)}"
            ) from None


# floating types, in promotion order
FLOATS = (DType.F16, DType.BF16, DType.F32, DType.F64)
# integer types (bool excluded)
INTS = (DType.U8, DType.I8, DType.I16, DType.I32, DType.I64)
# 16-bit floats that kernels load and store narrow but compute in f32
HALF = frozenset({DType.F16, DType.BF16})

_TO_TORCH = {
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.F32: torch.float32,
    DType.F64: torch.float64,
    DType.I8: torch.int8,
    DType.I16: torch.int16,
    DType.I32: torch.int32,
    DType.I64: torch.int64,
    DType.U8: torch.uint8,
    DType.BOOL: torch.bool,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


def promote(a: DType, b: DType) -> DType:
    """The dtype torch's type promotion gives two tensors of dtypes ``a`` and ``b``."""
    return DType.from_torch(torch.promote_types(a.torch, b.torch))


def compute_dtype(dtype: DType) -> DType:
    """The dtype arithmetic runs in: f32 for 16-bit floats, the dtype itself otherwise."""
    return DType.F32 if dtype in HALF else dtype
