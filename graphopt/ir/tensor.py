"""Tensor data that is read only when a pass asks for it.

A :class:`Tensor` knows its name, element type and shape at once, but its values come
from a :class:`TensorSource`: an array a pass computed, a memory map of an external-data
file, or whatever io/ left behind when it parsed a file. Loading a model therefore costs
no more than its structure until something calls :meth:`Tensor.numpy`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from graphopt.ir.types import DataType

__all__ = ["ArraySource", "ExternalSource", "SparseTensor", "Tensor", "TensorSource"]

T = TypeVar("T")


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
    """Bytes at ``offset`` of a file: an external-data file, or (``inline``) the model file
    itself. Values are viewed through a memory map; copies stream through a small buffer,
    so writing a model does not make its weights resident."""

    path: Path
    offset: int
    length: int | None
    dtype: DataType
    shape: tuple[int, ...]
    inline: bool = False

    def read(self) -> np.ndarray:
        np_dtype = self.dtype.numpy()
        count = math.prod(self.shape)
        if count == 0:
            return np.zeros(self.shape, dtype=np_dtype)
        return np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=self.shape)

    @property
    def size(self) -> int:
        return self.length if self.length is not None else self.path.stat().st_size - self.offset

    def raw(self) -> bytes:
        return b"".join(self.chunks())

    def chunks(self, chunk_size: int = 16 * 2**20) -> Iterator[bytes]:
        """The stored bytes, in order, read with plain file reads."""
        remaining = self.size
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            while remaining > 0:
                chunk = handle.read(min(chunk_size, remaining))
                if not chunk:
                    raise OSError(f"{self.path}: ends before the tensor data does")
                remaining -= len(chunk)
                yield chunk


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
        """A tensor over ``array``, which the tensor takes over: do not write to it afterwards."""
        array = np.asarray(array)
        return cls(name, DataType.from_numpy(array.dtype), tuple(array.shape), ArraySource(array))

    def digest(self, *, probe: bool = False) -> bytes | None:
        """A digest of the type, shape and values; None if the values cannot be read.

        With ``probe``, only three slices of a large tensor's bytes are hashed: enough to
        tell most same-shaped weights apart without reading them whole. Both digests are
        :meth:`remembered`.
        """
        return self.remembered(("digest", probe), lambda: _digest(self, probe))

    def remembered(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, a fact of this tensor's values, kept under ``key`` while the tensor keeps
        its source, type and shape: passes that run again and again (cse, const-cache in a
        fixpoint group, a fuse rule's test of a weight at every round) read a weight once."""
        memo: dict[Hashable, tuple[TensorSource, DataType, tuple[int, ...], Any]]
        memo = self.__dict__.setdefault("_remembered", {})
        found = memo.get(key)
        if found is not None and found[0] is self.source and found[1:3] == (self.dtype, self.shape):
            return cast("T", found[3])
        value = compute()
        memo[key] = (self.source, self.dtype, self.shape, value)
        return value

    def numpy(self) -> np.ndarray:
        """The values, read-only: rollback snapshots share tensors, so a write would corrupt them."""
        array = self.source.read()
        if array.flags.writeable:
            array = array.view()
            array.flags.writeable = False
        return array

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return (self.size * self.dtype.itemsize_bits + 7) // 8


# How many bytes each of the three slices of a probe digest reads.
_PROBE_BYTES = 4096


def _digest(tensor: Tensor, probe: bool) -> bytes | None:
    try:
        array = tensor.numpy()
    except (TypeError, ValueError):
        return None
    digest = hashlib.blake2b(digest_size=32)
    digest.update(repr((int(tensor.dtype), tensor.shape)).encode())
    if array.dtype == object:  # strings: length-prefixed, so ["ab", "c"] != ["a", "bc"]
        for item in array.ravel():
            data = item if isinstance(item, bytes) else str(item).encode()
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
        return digest.digest()
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    parts = [flat]
    if probe and flat.size > 3 * _PROBE_BYTES:
        middle = flat.size // 2
        parts = [flat[:_PROBE_BYTES], flat[middle : middle + _PROBE_BYTES], flat[-_PROBE_BYTES:]]
    for part in parts:
        digest.update(part.data)
    return digest.digest()


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
