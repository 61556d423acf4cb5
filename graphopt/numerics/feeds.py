"""Arrays to and from onnxruntime for the element types its Python binding has no numpy type for.

bfloat16, the float8 family, float4e2m1 and the 2- and 4-bit integers are numpy dtypes only
through ml_dtypes (which onnx ships with); onnxruntime neither takes such arrays as feeds
nor returns them. They go in as OrtValues over their ONNX bytes (the 4- and 2-bit types
packed, as ONNX stores them), and come out read from the OrtValue's buffer, widened to
float32 or int8: every value of these types is exact there, and the tolerance follows the
path's precision, not the output's dtype (see compare.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

__all__ = ["Feed", "exotic", "relaid", "run"]

# What an input is fed, or an output gives: an array, or for a sequence its arrays (a list, as
# onnxruntime takes and returns them; its tensors may differ in shape, which one array cannot hold).
Feed = np.ndarray | list[np.ndarray]

# ONNX element types by the ml_dtypes name numpy gives them.
_ELEMENT_TYPES: dict[str, int] = {
    name: getattr(onnx.TensorProto, type_name)
    for name, type_name in {
        "bfloat16": "BFLOAT16",
        "float8_e4m3fn": "FLOAT8E4M3FN",
        "float8_e4m3fnuz": "FLOAT8E4M3FNUZ",
        "float8_e5m2": "FLOAT8E5M2",
        "float8_e5m2fnuz": "FLOAT8E5M2FNUZ",
        "float8_e8m0fnu": "FLOAT8E8M0",
        "float4_e2m1fn": "FLOAT4E2M1",
        "int4": "INT4",
        "uint4": "UINT4",
        "int2": "INT2",
        "uint2": "UINT2",
    }.items()
    if hasattr(onnx.TensorProto, type_name)
}
_TYPE_TEXTS = frozenset(f"tensor({onnx.TensorProto.DataType.Name(e).lower()})" for e in _ELEMENT_TYPES.values())
_NUMPY_TYPES = {element: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(element)) for element in _ELEMENT_TYPES.values()}


def exotic(dtype: np.dtype) -> bool:
    """Whether onnxruntime's Python binding has no numpy type for ``dtype``."""
    return dtype.name in _ELEMENT_TYPES


def run(session: ort.InferenceSession, feeds: Mapping[str, Feed], options: ort.RunOptions) -> list[Any]:
    """``session.run`` over every output, for arrays of any element type in or out."""
    exotic_out = any(output.type in _TYPE_TEXTS for output in session.get_outputs())
    # OrtValues in and out hold tensors only: a sequence goes through session.run as a list.
    if not exotic_out or any(isinstance(feed, list) for feed in feeds.values()):
        return list(session.run(None, _to_ort(feeds), options))
    values = {
        name: _ort_value(a) if exotic(a.dtype) else ort.OrtValue.ortvalue_from_numpy(a)
        for name, a in feeds.items()
        if isinstance(a, np.ndarray)
    }
    return [_from_ort(value) for value in session.run_with_ort_values(None, values, options)]


def _to_ort(feeds: Mapping[str, Feed]) -> dict[str, Any]:
    """``feeds`` with every array of an exotic dtype as an OrtValue onnxruntime accepts."""
    return {
        name: _ort_value(feed) if isinstance(feed, np.ndarray) and exotic(feed.dtype) else feed
        for name, feed in feeds.items()
    }


def _ort_value(array: np.ndarray) -> ort.OrtValue:
    packed = np.frombuffer(numpy_helper.from_array(np.ascontiguousarray(array)).raw_data, dtype=np.uint8)
    # onnxruntime reads the tensor's bytes from the buffer and its shape from the array, so the
    # packed bytes ride at the start of a carrier of the logical shape and item size.
    carrier = np.zeros(array.size * array.dtype.itemsize, dtype=np.uint8)
    carrier[: packed.size] = packed
    view = carrier.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8).reshape(array.shape)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(view, _ELEMENT_TYPES[array.dtype.name])


def _from_ort(value: ort.OrtValue) -> Any:
    """An output as numpy: an exotic tensor widened to float32 or int8, anything else as onnxruntime gives it."""
    dtype = _NUMPY_TYPES.get(value.element_type()) if value.is_tensor() else None
    if dtype is None:
        return value.numpy()
    size = value.tensor_size_in_bytes()
    raw = bytes((ctypes.c_uint8 * size).from_address(value.data_ptr())) if size else b""
    tensor = onnx.helper.make_tensor("output", value.element_type(), value.shape(), raw, raw=True)
    array = numpy_helper.to_array(tensor)
    return array.astype(np.int8 if array.dtype.name.startswith(("int", "uint")) else np.float32)


def relaid(feed: Mapping[str, Feed], layouts: Mapping[str, tuple[int, ...]]) -> dict[str, Feed]:
    """``feed`` with each input of ``layouts`` (tensors: the unwind pass re-lays out no sequence)
    transposed into its layout."""
    return {
        name: np.ascontiguousarray(array.transpose(layouts[name]))
        if name in layouts and isinstance(array, np.ndarray)
        else array
        for name, array in feed.items()
    }
