"""Element types and value types (tensor, sequence, map, optional, sparse tensor, opaque)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from graphopt.ir.dims import Dim, format_dim

__all__ = [
    "FLOAT_ARRAYS",
    "FLOAT_TYPES",
    "float_info",
    "is_number_array",
    "INTEGER_TYPES",
    "DataType",
    "MapType",
    "OpaqueType",
    "OptionalType",
    "SequenceType",
    "SparseTensorType",
    "TensorType",
    "Type",
]


class DataType(IntEnum):
    """Element types, numbered as in the ONNX standard so files map one to one."""

    UNDEFINED = 0
    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26
    FLOAT6E2M3 = 27
    FLOAT6E3M2 = 28

    @property
    def itemsize_bits(self) -> int:
        return _BITS.get(self, 8 * _NUMPY.get(self, np.dtype(np.uint8)).itemsize)

    @property
    def epsilon(self) -> float | None:
        """The spacing of this float type's values just above 1 (None: not a float type): a stored
        constant is within half of it, relatively, of the number it stands for."""
        return _EPSILON.get(self)

    def numpy(self) -> np.dtype:
        """The numpy dtype graphopt computes with (float8, float4 and the sub-byte integers have none:
        they are stored as raw bytes)."""
        try:
            return _NUMPY[self]
        except KeyError:
            raise TypeError(f"no numpy dtype for {self.name}") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype) -> DataType:
        for data_type, np_dtype in _NUMPY.items():
            if np_dtype == dtype:
                return data_type
        raise TypeError(f"no ONNX element type for numpy dtype {dtype}")


_NUMPY: dict[DataType, np.dtype] = {
    DataType.FLOAT: np.dtype(np.float32),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.INT8: np.dtype(np.int8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.STRING: np.dtype(object),
    DataType.BOOL: np.dtype(np.bool_),
    DataType.FLOAT16: np.dtype(np.float16),
    # ml_dtypes' bfloat16, onnx's own numpy type for it: each numpy operation on it rounds its
    # result to bfloat16.
    DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DataType.DOUBLE: np.dtype(np.float64),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.COMPLEX64: np.dtype(np.complex64),
    DataType.COMPLEX128: np.dtype(np.complex128),
}

_EPSILON: dict[DataType, float] = {
    DataType.DOUBLE: 2.0**-52,
    DataType.FLOAT: 2.0**-23,
    DataType.FLOAT16: 2.0**-10,
    DataType.BFLOAT16: 2.0**-7,
    DataType.FLOAT8E4M3FN: 2.0**-3,
    DataType.FLOAT8E4M3FNUZ: 2.0**-3,
    DataType.FLOAT8E5M2: 2.0**-2,
    DataType.FLOAT8E5M2FNUZ: 2.0**-2,
    DataType.FLOAT4E2M1: 2.0**-1,
}

_BITS: dict[DataType, int] = {
    DataType.BFLOAT16: 16,
    DataType.FLOAT8E4M3FN: 8,
    DataType.FLOAT8E4M3FNUZ: 8,
    DataType.FLOAT8E5M2: 8,
    DataType.FLOAT8E5M2FNUZ: 8,
    DataType.FLOAT8E8M0: 8,
    DataType.UINT4: 4,
    DataType.INT4: 4,
    DataType.FLOAT4E2M1: 4,
    DataType.UINT2: 2,
    DataType.INT2: 2,
    DataType.FLOAT6E2M3: 6,
    DataType.FLOAT6E3M2: 6,
    DataType.STRING: 0,
}


@dataclass(frozen=True)
class TensorType:
    """A dense tensor; ``shape`` is ``None`` when even the rank is unknown."""

    dtype: DataType
    shape: tuple[Dim, ...] | None = None
    denotation: str = ""

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def __str__(self) -> str:
        if self.shape is None:
            return f"{self.dtype.name.lower()}[*]"
        return f"{self.dtype.name.lower()}[{', '.join(format_dim(d) for d in self.shape)}]"


@dataclass(frozen=True)
class SparseTensorType:
    dtype: DataType
    shape: tuple[Dim, ...] | None = None
    denotation: str = ""

    def __str__(self) -> str:
        return f"sparse {TensorType(self.dtype, self.shape)}"


@dataclass(frozen=True)
class _OneElementType:
    """A type around one element type; its subclasses differ only in the word they print."""

    element: Type | None
    denotation: str = ""
    keyword: ClassVar[str]

    def __str__(self) -> str:
        return f"{self.keyword}({self.element})"


@dataclass(frozen=True)
class SequenceType(_OneElementType):
    keyword: ClassVar[str] = "seq"


@dataclass(frozen=True)
class OptionalType(_OneElementType):
    keyword: ClassVar[str] = "optional"


@dataclass(frozen=True)
class MapType:
    key: DataType
    value: Type | None
    denotation: str = ""

    def __str__(self) -> str:
        return f"map({self.key.name.lower()}, {self.value})"


@dataclass(frozen=True)
class OpaqueType:
    domain: str = ""
    name: str = ""
    denotation: str = ""

    def __str__(self) -> str:
        return f"opaque({self.domain}.{self.name})"


# Element types of whole numbers (the dtypes of shapes, indices and axes among them).
INTEGER_TYPES = frozenset(
    {
        DataType.INT8,
        DataType.INT16,
        DataType.INT32,
        DataType.INT64,
        DataType.UINT8,
        DataType.UINT16,
        DataType.UINT32,
        DataType.UINT64,
    }
)

Type = TensorType | SparseTensorType | SequenceType | MapType | OptionalType | OpaqueType


# The float element types graphopt computes with, and their numpy dtypes: bfloat16's (ml_dtypes) is
# a "V" kind to numpy, so a test of ``dtype.kind == "f"`` would miss it.
FLOAT_TYPES = frozenset({DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE})
# The 16-bit float types, which onnxruntime's CPU provider computes in float32 behind Casts it inserts.
HALF_FLOAT_TYPES = frozenset({DataType.FLOAT16, DataType.BFLOAT16})
FLOAT_ARRAYS = frozenset(_NUMPY[t] for t in FLOAT_TYPES)


def is_number_array(array: np.ndarray) -> bool:
    """Whether ``array`` holds integers or floats graphopt computes with (not bools, strings, raw bytes)."""
    return array.dtype.kind in "iu" or array.dtype in FLOAT_ARRAYS


def float_info(dtype: np.dtype) -> Any:
    """numpy's finfo for ``dtype``, bfloat16 included (ml_dtypes'; numpy's own knows no bfloat16)."""
    return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
