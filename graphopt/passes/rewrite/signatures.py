"""Whether a node a rule built takes its element types at the model's opset, by onnx's schemas.

A rule that fires on float, float16 and bfloat16 alike builds ops whose type constraints
differ by opset: LayerNormalization takes bfloat16 from opset 17, HardSwish, Softplus, Sin
and Conv only from opset 22. onnxruntime refuses to load a model whose node breaks its
schema's constraint ("Type 'tensor(bfloat16)' of input parameter ... is invalid"), so the
engine refuses such a rewrite, and the near miss names the type and the opset.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import onnx.defs

from graphopt.ir import DataType, Node, tensor_dtype
from graphopt.ir.node import STANDARD_DOMAINS

__all__ = ["untaken", "untaken_type"]


@cache
def _constraints(op_type: str, opset: int) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, frozenset[str]]] | None:
    """The formal inputs' and outputs' type strings and each constraint's allowed types; None
    where onnx has no schema for the op at ``opset``."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    return (
        tuple(p.type_str for p in schema.inputs),
        tuple(p.type_str for p in schema.outputs),
        allowed,
    )


def untaken_type(node: Node, opset: int | None) -> str | None:
    """Why a standard-domain ``node`` is invalid at ``opset`` for an element type it reads or
    makes (None: every known type is allowed, the opset is unknown, or onnx knows no schema for
    the op there)."""
    if node.domain not in STANDARD_DOMAINS or opset is None:
        return None
    types = [tensor_dtype(v) for v in node.inputs], [tensor_dtype(v) for v in node.outputs]
    return untaken(node.op_type, opset, *types)


def untaken(
    op_type: str, opset: int, inputs: Sequence[DataType | None], outputs: Sequence[DataType | None]
) -> str | None:
    """Why a standard-domain ``op_type`` at ``opset`` takes no such element types of its inputs and
    outputs (None where each is allowed or unknown)."""
    found = _constraints(op_type, opset)
    if found is None:
        return None
    formal_inputs, formal_outputs, allowed = found
    for types, formal in ((inputs, formal_inputs), (outputs, formal_outputs)):
        for index, dtype in enumerate(types):
            if not formal:
                break
            type_str = formal[min(index, len(formal) - 1)]  # a variadic last parameter
            refused = _refused(dtype, allowed.get(type_str, frozenset({type_str})))
            if refused:
                return f"{op_type} takes no {refused} at opset {opset}"
    return None


def _refused(dtype: DataType | None, allowed: frozenset[str]) -> str | None:
    if dtype in (None, DataType.UNDEFINED) or not any(t.startswith("tensor(") for t in allowed):
        return None
    assert dtype is not None
    name = dtype.name.lower()
    return None if f"tensor({name})" in allowed else name
