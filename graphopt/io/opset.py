"""Converting a model to another default-domain opset with onnx's version converter.

Passes reach this through ``PassContext.convert_opset`` (graphopt.api wires it in), so
they stay free of protobuf. A model the converter cannot take to the requested opset is
bad input; the message names the op that blocks it when onnx's error says which.
"""

from __future__ import annotations

import re

import onnx
from onnx import version_converter

from graphopt.errors import InputError
from graphopt.io.onnx_io import from_proto, to_proto
from graphopt.ir import Model

__all__ = ["convert_opset"]


def convert_opset(model: Model, version: int) -> Model:
    """``model`` converted to default-domain opset ``version`` (a new IR model)."""
    highest = onnx.defs.onnx_opset_version()
    if not 1 <= version <= highest:
        raise InputError(
            f"cannot convert the model to opset {version}: onnx {onnx.__version__} knows opsets 1 to {highest}"
        )
    proto = to_proto(model)
    try:
        converted = version_converter.convert_version(proto, version)
    except Exception as err:  # onnx raises assorted C++ exception types
        raise InputError(f"cannot convert the model to opset {version}: {_blocking_op(err, proto)}") from None
    return from_proto(converted)


def _blocking_op(err: BaseException, proto: onnx.ModelProto) -> str:
    text = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    text = re.sub(r"^.*?(Assertion `[^`]*` failed: )", "", text)
    ops = {node.op_type for node in proto.graph.node}
    named = [op for op in sorted(ops) if re.search(rf"\b{re.escape(op)}\b", text)]
    return f"op {named[0]} blocks it ({text})" if named else text
