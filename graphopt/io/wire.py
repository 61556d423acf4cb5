"""Protobuf wire-format surgery on ONNX files, so big weights never pass through memory.

Parsing a 100 MB model with protobuf costs the file's bytes twice (the file read and the
parsed message); serializing it back costs them twice more. Instead:

- :func:`split_inline_weights` scans a model file's top-level fields and its graph's
  initializers without decoding them, and returns the model with every large
  ``raw_data`` replaced by a reference to its byte range in the file itself. io/ maps
  such ranges lazily, exactly like external data.
- :func:`write_pieces` writes a message as a tree of pieces (plain bytes, framed
  sub-messages, fields copied from chunks), computing the lengths protobuf's framing needs
  up front, so weights are copied from wherever they live without being held whole.

Only ModelProto.graph (7), GraphProto.node (1) and .initializer (5), NodeProto.attribute
(5), AttributeProto.t (5) and TensorProto.raw_data (9) are looked into; every other byte
is copied through verbatim.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "INLINE_KEY",
    "Chunked",
    "Frame",
    "Piece",
    "is_model_file",
    "length_field",
    "split_inline_weights",
    "tensor_piece",
    "write_pieces",
]

MODEL_GRAPH = 7
GRAPH_NODE = 1
GRAPH_INITIALIZER = 5
NODE_ATTRIBUTE = 5
ATTRIBUTE_TENSOR = 5
TENSOR_RAW_DATA = 9
TENSOR_EXTERNAL_DATA = 13
TENSOR_DATA_LOCATION = 14
LENGTH_DELIMITED = 2

# The external_data key that marks a byte range inside the model file itself.
INLINE_KEY = "graphopt.inline"
# Smaller weights are cheaper to parse than to map.
SPLIT_THRESHOLD = 4096


def _varint(buffer: bytes | mmap.mmap, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buffer[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return encode_varint(field << 3 | wire_type)


@dataclass(frozen=True)
class _Field:
    number: int
    wire_type: int
    start: int  # first byte of the field's key
    value_start: int  # first byte of the payload (after the length for LEN fields)
    end: int


def _fields(buffer: bytes | mmap.mmap, start: int, end: int) -> Iterator[_Field]:
    pos = start
    while pos < end:
        key, value_pos = _varint(buffer, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, next_pos = _varint(buffer, value_pos)
        elif wire_type == 1:
            next_pos = value_pos + 8
        elif wire_type == LENGTH_DELIMITED:
            length, value_pos = _varint(buffer, value_pos)
            next_pos = value_pos + length
        elif wire_type == 5:
            next_pos = value_pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if next_pos > end:
            raise ValueError("truncated message")
        yield _Field(number, wire_type, pos, value_pos, next_pos)
        pos = next_pos


def length_field(number: int, payload: bytes) -> bytes:
    return _key(number, LENGTH_DELIMITED) + encode_varint(len(payload)) + payload


def _inline_reference(location: str, offset: int, length: int) -> bytes:
    """TensorProto fields saying: the raw bytes are at ``offset`` of the model file."""
    entries = b""
    for key, value in ((INLINE_KEY, "1"), ("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = length_field(1, key.encode()) + length_field(2, value.encode())
        entries += length_field(TENSOR_EXTERNAL_DATA, entry)
    return entries + _key(TENSOR_DATA_LOCATION, 0) + encode_varint(1)


def is_model_file(path: Path) -> bool:
    """Whether the file's top-level fields are a ModelProto's: an ir_version and a graph,
    and nothing that does not parse (only field headers are read)."""
    try:
        size = path.stat().st_size
        if size == 0:
            return False
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            kinds = {(field.number, field.wire_type) for field in _fields(data, 0, size)}
    except (OSError, ValueError, IndexError):
        return False
    return (1, 0) in kinds and (MODEL_GRAPH, LENGTH_DELIMITED) in kinds


def split_inline_weights(path: Path) -> bytes | None:
    """The model's bytes with the large ``raw_data`` of the main graph's initializers and node
    attributes (Constant weights) replaced by in-file references.

    Returns None when nothing is worth splitting (the caller then parses the file as is).
    Raises ValueError on a malformed file. Only field headers are read; the pieces that
    are kept are views of the mapped file until the one final copy.
    """
    size = path.stat().st_size
    if size == 0:
        return None
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        view = memoryview(data)
        try:
            parts: list[bytes | memoryview] = []
            split_any = False
            for field in _fields(data, 0, size):
                if field.number != MODEL_GRAPH or field.wire_type != LENGTH_DELIMITED:
                    parts.append(view[field.start : field.end])
                    continue
                graph_parts: list[bytes | memoryview] = []
                for inner in _fields(data, field.value_start, field.end):
                    split = None
                    if inner.wire_type == LENGTH_DELIMITED and inner.end - inner.value_start >= SPLIT_THRESHOLD:
                        if inner.number == GRAPH_INITIALIZER:
                            split = _split_tensor(data, inner, path.name)
                        elif inner.number == GRAPH_NODE:
                            split = _split_node(data, inner, path.name)
                    if split is None:
                        graph_parts.append(view[inner.start : inner.end])
                    else:
                        split_any = True
                        graph_parts.append(length_field(inner.number, split))
                graph_size = sum(len(part) for part in graph_parts)
                parts.append(_key(MODEL_GRAPH, LENGTH_DELIMITED) + encode_varint(graph_size))
                parts.extend(graph_parts)
            return b"".join(parts) if split_any else None
        finally:
            parts = graph_parts = []  # drop the views so the map can close
            view.release()


def _split_node(data: mmap.mmap, field: _Field, location: str) -> bytes | None:
    """A NodeProto whose large attribute tensors became in-file references, or None."""
    return _split_nested(data, field, NODE_ATTRIBUTE, lambda inner: _split_attribute(data, inner, location))


def _split_attribute(data: mmap.mmap, field: _Field, location: str) -> bytes | None:
    return _split_nested(data, field, ATTRIBUTE_TENSOR, lambda inner: _split_tensor(data, inner, location))


def _split_nested(data: mmap.mmap, field: _Field, number: int, split: Callable[[_Field], bytes | None]) -> bytes | None:
    parts: list[bytes] = []
    changed = False
    for inner in _fields(data, field.value_start, field.end):
        replaced = None
        large = inner.end - inner.value_start >= SPLIT_THRESHOLD
        if inner.number == number and inner.wire_type == LENGTH_DELIMITED and large:
            replaced = split(inner)
        if replaced is None:
            parts.append(data[inner.start : inner.end])
        else:
            changed = True
            parts.append(length_field(number, replaced))
    return b"".join(parts) if changed else None


def _split_tensor(data: mmap.mmap, field: _Field, location: str) -> bytes | None:
    kept: list[bytes] = []
    raw: _Field | None = None
    for inner in _fields(data, field.value_start, field.end):
        if inner.number == TENSOR_RAW_DATA and inner.wire_type == LENGTH_DELIMITED:
            raw = inner
        elif inner.number == TENSOR_DATA_LOCATION and _varint(data, inner.value_start)[0] == 0:
            continue  # an explicit DEFAULT location; the reference below sets its own
        elif inner.number in (TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION):
            return None  # already external: leave it to the normal path
        else:
            kept.append(data[inner.start : inner.end])
    if raw is None or raw.end - raw.value_start < SPLIT_THRESHOLD:
        return None
    return b"".join(kept) + _inline_reference(location, raw.value_start, raw.end - raw.value_start)


@dataclass
class Chunked:
    """A length-delimited field whose payload is copied from ``chunks`` (``size`` bytes)."""

    number: int
    size: int
    chunks: Iterable[bytes | memoryview]


@dataclass
class Frame:
    """A length-delimited field whose payload is a sequence of pieces, framed as written."""

    number: int
    pieces: list[Piece]


Piece = bytes | Frame | Chunked


def _payload_size(piece: Frame | Chunked) -> int:
    return piece.size if isinstance(piece, Chunked) else sum(_size(p) for p in piece.pieces)


def _size(piece: Piece) -> int:
    if isinstance(piece, bytes):
        return len(piece)
    payload = _payload_size(piece)
    return len(_key(piece.number, LENGTH_DELIMITED)) + len(encode_varint(payload)) + payload


def tensor_piece(number: int, header: bytes, size: int, chunks: Iterable[bytes | memoryview]) -> Piece:
    """A TensorProto field: its data-less ``header`` fields, then ``size`` bytes of raw_data."""
    if not size:
        return length_field(number, header)
    return Frame(number, [header, Chunked(TENSOR_RAW_DATA, size, chunks)])


def write_pieces(out: BinaryIO, pieces: Iterable[Piece]) -> None:
    """Serialize pieces in order; lengths are computed up front, data is never held whole."""
    for piece in pieces:
        if isinstance(piece, bytes):
            out.write(piece)
            continue
        out.write(_key(piece.number, LENGTH_DELIMITED) + encode_varint(_payload_size(piece)))
        if isinstance(piece, Frame):
            write_pieces(out, piece.pieces)
            continue
        written = 0
        for chunk in piece.chunks:
            out.write(chunk)
            written += len(chunk)
        if written != piece.size:
            raise ValueError(f"tensor data is {written} bytes, expected {piece.size}")
