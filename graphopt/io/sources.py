"""Where input bytes come from: the files graphopt reads (regular files only), tensor data
as ONNX holds it (values still inside a parsed TensorProto), and the raw bytes of any tensor
as a TensorProto's raw_data would hold them (used by both writers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt.errors import InputError
from graphopt.files import not_regular
from graphopt.ir import DataType, ExternalSource, Tensor

__all__ = [
    "MODEL_HEADER",
    "TYPED_FIELDS",
    "ProtoSource",
    "input_file",
    "raw_buffer",
    "raw_layout",
    "tensor_proto_from_array",
]

# The ModelProto's scalar fields, kept on ir.Model under the same names.
MODEL_HEADER = ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string")

# The TensorProto fields that hold values as typed numbers (rather than raw_data).
TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def input_file(path: Path, what: str = "") -> Path:
    """``path`` when it names a regular file (links followed), for every reader of an input
    (models, reports, layout problems, --inputs, configs): InputError "no such file", or "not
    a regular file" for a FIFO or a device, whose reading would block or never end. ``what``
    names the file's role in the message ("config file")."""
    special = not_regular(path)
    if special is not None:
        raise InputError(f"{path}: not a regular file but {special}; graphopt reads inputs from regular files")
    if not path.is_file():
        raise InputError(f"{path}: no such {what or 'file'}")
    return path


@dataclass
class ProtoSource:
    """Values still inside the TensorProto they were parsed from."""

    proto: onnx.TensorProto

    def read(self) -> np.ndarray:
        return numpy_helper.to_array(self.proto)


def raw_buffer(tensor: Tensor) -> memoryview:
    """The tensor's bytes as ONNX raw_data holds them (4-bit types packed), without a copy
    where possible. Not for string tensors, which have no raw form."""
    source = tensor.source
    if isinstance(source, ProtoSource) and source.proto.HasField("raw_data"):
        return memoryview(source.proto.raw_data)
    if isinstance(source, ExternalSource):
        return memoryview(source.raw())
    array = source.read()
    if raw_layout(tensor) and array.dtype != np.dtype(object):
        return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return memoryview(tensor_proto_from_array(tensor, array).raw_data)


def raw_layout(tensor: Tensor) -> bool:
    """Whether raw_data is the array's memory as numpy holds it (not strings, not packed 4-bit)."""
    return tensor.dtype != DataType.STRING and tensor.dtype.itemsize_bits % 8 == 0


def tensor_proto_from_array(tensor: Tensor, array: np.ndarray) -> onnx.TensorProto:
    if not raw_layout(tensor) or array.dtype == np.dtype(object):
        proto = numpy_helper.from_array(array, tensor.name)
        proto.data_type = int(tensor.dtype)
        return proto
    proto = onnx.TensorProto(name=tensor.name, data_type=int(tensor.dtype), dims=list(tensor.shape))
    proto.raw_data = np.ascontiguousarray(array).tobytes()
    return proto
