"""The tools that make a model's reduced-precision variants, as the tests and the benchmarks call them: onnxruntime's
static quantizer (one calibration reader, one set of options per format, a model quantized through the files the
quantizer reads and writes) and the bfloat16 form of a float16 model, which no tool of onnxruntime's writes. Each
is spelled here once (benchmarks/precision_variants.py builds the exports' variants with them)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.ir.types import float_info

__all__ = ["STATIC_KINDS", "Calibration", "bfloat16_of_float16", "quantized_through_files", "static_options"]

# quantize_static's formats, by the name precision_variants gives their variants.
STATIC_KINDS = ("qdq", "qdq16", "qdqpc", "qop", "qdqu8")


class Calibration:
    """quantize_static's calibration reader (onnxruntime's CalibrationDataReader protocol) over ``feeds``."""

    def __init__(self, feeds: Iterable[Mapping[str, np.ndarray]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> Mapping[str, np.ndarray] | None:
        return next(self._feeds, None)


def static_options(kind: str) -> dict[str, Any]:
    """quantize_static's options for ``kind`` (int8 weights in each): "qdq" (the QDQ format, int8 activations,
    the quantizer's default), "qdq16" (int16 activations in onnxruntime's own QuantizeLinear and DequantizeLinear,
    com.microsoft, as it writes them for QNN below opset 21), "qdqpc" (per-channel weights), "qop" (the QOperator
    format: QLinearMatMul, QLinearConv, QLinearAdd, ...), "qdqu8" (uint8 activations, the quantizer's default before
    onnxruntime 1.17 and what many deployed QDQ models hold)."""
    from onnxruntime.quantization import QuantFormat, QuantType

    formats: dict[str, dict[str, Any]] = {
        "qdq": {},
        "qdq16": {"activation_type": QuantType.QInt16, "extra_options": {"UseQDQContribOps": True}},
        "qdqpc": {"per_channel": True},
        "qop": {"quant_format": QuantFormat.QOperator},
        "qdqu8": {"activation_type": QuantType.QUInt8},
    }
    return {"quant_format": QuantFormat.QDQ, "weight_type": QuantType.QInt8, **formats[kind]}


def quantized_through_files(model: onnx.ModelProto, quantize: Callable[[str, str], None]) -> onnx.ModelProto:
    """``model`` quantized by ``quantize(source, target)``, a tool that reads and writes files."""
    logging.getLogger().setLevel(logging.ERROR)  # quantize_static advises pre-processing on the root logger
    with tempfile.TemporaryDirectory() as folder:
        source, target = Path(folder) / "float.onnx", Path(folder) / "quantized.onnx"
        onnx.save(model, source)
        quantize(str(source), str(target))
        return onnx.load(target)


def bfloat16_of_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (a float16 one) with every float16 tensor, value type and Cast target bfloat16."""
    _to_bfloat16(model.graph)
    return model


def _to_bfloat16(graph: onnx.GraphProto) -> None:
    for tensor in graph.initializer:
        _retyped(tensor)
    for described in [*graph.input, *graph.output, *graph.value_info]:
        if described.type.tensor_type.elem_type == TensorProto.FLOAT16:
            described.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for node in graph.node:
        for attr in node.attribute:
            if attr.name in ("to", "dtype") and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.BFLOAT16
            if attr.type == onnx.AttributeProto.TENSOR:
                _retyped(attr.t)
            if attr.type == onnx.AttributeProto.GRAPH:
                _to_bfloat16(attr.g)


def _retyped(tensor: onnx.TensorProto) -> None:
    """A float16 tensor made bfloat16; float16's extremes, where the float16 converter clamps float32's (a mask's
    fill of -3.4e38), become bfloat16's, as a bfloat16 export holds them (torch.finfo(torch.bfloat16).min)."""
    if tensor.data_type == TensorProto.FLOAT16:
        values = numpy_helper.to_array(tensor).astype(np.float32)
        bfloat16 = helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)
        extreme = np.abs(values) == np.finfo(np.float16).max
        values[extreme] = np.sign(values[extreme]) * float(float_info(bfloat16).max)
        tensor.CopyFrom(numpy_helper.from_array(values.astype(bfloat16), tensor.name))
