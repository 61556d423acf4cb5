"""Tensor data that is read only when a pass asks for it.

A :class:`Tensor` knows its name, element type and shape at once, but its values come
from a :class:`TensorSource`: an array a pass computed, a memory map of an external-data
file, or whatever io/ left behind when it parsed a file. Loading a model therefore costs
no more than its structure until something calls :meth:`Tensor.numpy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from graphopt.ir.types import DataType

__all__ = ["ArraySource", "ExternalSource", "SparseTensor", "Tensor", "TensorSource"]


class TensorSource(Protocol):
    def read(self) -> np.ndarray:
        """The values, shaped; may be a read-only view."""
        ...


@dataclass
class ArraySource:
    array: np.ndarray

    def read(self) -> np.ndarray:
        return self.array


@dataclass
class ExternalSource:
    """Bytes at ``offset`` in a file, viewed through a memory map (no copy, no read-ahead)."""

    path: Path
    offset: int
    length: int | None
    dtype: DataType
    shape: tuple[int, ...]

    def read(self) -> np.ndarray:
        np_dtype = self.dtype.numpy()
        count = math.prod(self.shape)
        if count == 0:
            return np.zeros(self.shape, dtype=np_dtype)
        return np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=self.shape)

    def raw(self) -> memoryview:
        """The stored bytes, for copying into another file chunk by chunk."""
        size = self.length if self.length is not None else self.path.stat().st_size - self.offset
        if size == 0:
            return memoryview(b"")
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(size,))
        return memoryview(mapped)  # type: ignore[arg-type]


@dataclass(eq=False)
class Tensor:
    """A named constant; ``source`` supplies the values on demand."""

    name: str
    dtype: DataType
    shape: tuple[int, ...]
    source: TensorSource
    doc_string: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_array(cls, array: np.ndarray, name: str = "") -> Tensor:
        array = np.asarray(array)
        return cls(name, DataType.from_numpy(array.dtype), tuple(array.shape), ArraySource(array))

    def numpy(self) -> np.ndarray:
        return self.source.read()

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return (self.size * self.dtype.itemsize_bits + 7) // 8


@dataclass(eq=False)
class SparseTensor:
    """COO sparse constant: ``values`` at ``indices`` of a dense tensor of shape ``dims``."""

    values: Tensor
    indices: Tensor
    dims: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.values.name

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.indices.nbytes
