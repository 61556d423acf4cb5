"""What the check needs to know about each output's path through the original model.

For every graph output: the lowest float precision computed on the way to it (the
tolerance follows it, see compare.py) and the ops on the way that may draw random numbers
(their outputs are not checked: RANDOM_OPS, and a Dropout whose training_mode is not a
constant false).

A value's float type is its declared type (graph inputs and outputs, value_info), else
what its producer implies: Cast's ``to``, CastLike's second input, a Constant's tensor,
nothing for ops whose outputs are never float (Shape, comparisons, ArgMax, ...), and
otherwise the lowest precision among the producer's float inputs, which is what almost
every ONNX op computes in. The path's precision is the lowest over the values computed on
it and the graph inputs it reads; constants count only through the ops that read them (a
float16 weight Cast to float32 is exact, a float16 MatMul is not). A body of an If, Loop
or Scan counts with the lowest float type declared or cast to anywhere inside it.

The walk follows the stored node order (ONNX requires a topological one); an input read
before it is produced counts as unknown, never as an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt.ir.constness import RANDOM_OPS
from graphopt.ir.node import QDQ_DOMAINS, STANDARD_DOMAINS
from graphopt.ir.types import DataType

__all__ = [
    "EPSILON",
    "OutputPath",
    "bodies",
    "has_opaque_ops",
    "inline_array",
    "is_qdq",
    "lowest",
    "output_paths",
    "precision_name",
]

# Machine epsilon (the gap between 1 and the next larger number) of each float type, by its numpy-style name
# (the IR's table, DataType.epsilon).
_NAMES = {DataType.DOUBLE: "float64", DataType.FLOAT: "float32"}
EPSILON: dict[str, float] = {_NAMES.get(t, t.name.lower()): t.epsilon for t in DataType if t.epsilon is not None}
_ALIASES = {"float": "float32", "double": "float64", "complex64": "float32", "complex128": "float64"}
_NEVER_FLOAT = frozenset(
    {
        "Shape",
        "Size",
        "ArgMax",
        "ArgMin",
        "NonZero",
        "Equal",
        "Less",
        "LessOrEqual",
        "Greater",
        "GreaterOrEqual",
        "IsNaN",
        "IsInf",
        "And",
        "Or",
        "Xor",
        "Not",
        "StringNormalizer",
    }
)


@dataclass(frozen=True)
class OutputPath:
    precision: str | None  # a key of EPSILON, or None: nothing float on the way
    random_ops: tuple[str, ...]


def precision_name(elem_type: int) -> str | None:
    """The EPSILON key of an ONNX element type, or None for a type that is not float."""
    try:
        name = onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return None
    name = _ALIASES.get(name, name)
    return name if name in EPSILON else None


def lowest(precisions: Iterable[str | None]) -> str | None:
    """The least precise of ``precisions`` (None entries ignored)."""
    known = [p for p in precisions if p is not None]
    return max(known, key=EPSILON.__getitem__) if known else None


def output_paths(graph: onnx.GraphProto) -> dict[str, OutputPath]:
    """Each graph output's path, by output name."""
    types: dict[str, str | None] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.WhichOneof("value") == "tensor_type" and info.type.tensor_type.elem_type:
            types[info.name] = precision_name(info.type.tensor_type.elem_type)
    constants = {init.name: precision_name(init.data_type) for init in graph.initializer}
    producers: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        implied = _implied(node, lambda name: types.get(name, constants.get(name)))
        for name in node.output:
            if name:
                producers[name] = node
                types.setdefault(name, None if node.op_type == "Constant" else implied)
                if node.op_type == "Constant":
                    constants[name] = implied
    off = _false_constants(graph)
    return {output.name: _walk(output.name, producers, types, constants, off) for output in graph.output}


def _false_constants(graph: onnx.GraphProto) -> set[str]:
    """The stored and Constant values that are a false scalar: a Dropout with such a training_mode is the identity."""
    tensors = [(init.name, init) for init in graph.initializer]
    tensors += [
        (node.output[0], a.t)
        for node in graph.node
        if node.op_type == "Constant" and node.output
        for a in node.attribute
        if a.name == "value"
    ]
    scalars = {name: inline_array(tensor) for name, tensor in tensors if math.prod(tensor.dims) == 1}
    return {name for name, array in scalars.items() if array is not None and not array.any()}


def is_qdq(node: onnx.NodeProto, op_type: str) -> bool:
    """Whether ``node`` is a QuantizeLinear or DequantizeLinear (``op_type``) of the standard's contract, in either
    of its domains (``Node.is_qdq`` for the IR)."""
    return node.op_type == op_type and node.domain in QDQ_DOMAINS


def inline_array(tensor: onnx.TensorProto) -> np.ndarray | None:
    """The values of a tensor stored in the file itself, or None: external, or not readable
    (a malformed tensor is onnxruntime's to refuse, with a message, not the check's to crash on)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    try:
        return numpy_helper.to_array(tensor)
    except (ValueError, TypeError):
        return None


def _implied(node: onnx.NodeProto, lookup: Callable[[str], str | None]) -> str | None:
    attributes = {a.name: a for a in node.attribute}
    if node.domain in STANDARD_DOMAINS:
        if node.op_type in _NEVER_FLOAT:
            return None
        if node.op_type == "Cast" and "to" in attributes:
            return precision_name(attributes["to"].i)
        if node.op_type == "CastLike" and len(node.input) > 1:
            return lookup(node.input[1])
        if node.op_type == "Constant":
            tensor = attributes.get("value")
            return precision_name(tensor.t.data_type) if tensor is not None and tensor.t.data_type else None
    inside = [_declared(body) for a in node.attribute for body in bodies(a)]
    return lowest([*(lookup(name) for name in node.input if name), *inside])


def bodies(attribute: onnx.AttributeProto) -> list[onnx.GraphProto]:
    """The subgraphs an attribute holds: an If's branch, a Loop's or Scan's body."""
    if attribute.type == onnx.AttributeProto.GRAPH:
        return [attribute.g]
    return list(attribute.graphs) if attribute.type == onnx.AttributeProto.GRAPHS else []


def _declared(graph: onnx.GraphProto) -> str | None:
    """The lowest float type declared, initialized or cast to anywhere in ``graph``."""
    found: list[str | None] = []
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.WhichOneof("value") == "tensor_type":
            found.append(precision_name(info.type.tensor_type.elem_type))
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to":
                found.append(precision_name(attribute.i))
            found.extend(_declared(body) for body in bodies(attribute))
    return lowest(found)


def _walk(
    output: str,
    producers: dict[str, onnx.NodeProto],
    types: dict[str, str | None],
    constants: dict[str, str | None],
    off: set[str],
) -> OutputPath:
    seen: set[str] = set()
    precisions: list[str | None] = []
    random_ops: dict[str, None] = {}
    frontier = [output]
    while frontier:
        name = frontier.pop()
        if name in seen or (name in constants and name not in producers):
            continue
        seen.add(name)
        node = producers.get(name)
        if node is None or node.op_type != "Constant":
            precisions.append(types.get(name))
        if node is None:
            continue
        random_ops.update(dict.fromkeys(_random_ops(node, off)))
        frontier.extend(n for n in node.input if n)
    return OutputPath(lowest(precisions), tuple(sorted(random_ops)))


def has_opaque_ops(graph: onnx.GraphProto) -> bool:
    """Whether ``graph`` calls an op outside the ONNX domains (a custom op, a model-local function):
    whether it draws numbers is not in the graph, so only two runs of the original can tell."""
    return any(
        node.domain not in (*STANDARD_DOMAINS, "ai.onnx.ml")
        or any(has_opaque_ops(body) for attribute in node.attribute for body in bodies(attribute))
        for node in graph.node
    )


def _random_ops(node: onnx.NodeProto, off: set[str]) -> Iterator[str]:
    """The ops in ``node`` that draw numbers: RANDOM_OPS, and a Dropout whose training_mode is no constant false."""
    if node.domain in STANDARD_DOMAINS:
        if node.op_type in RANDOM_OPS:
            yield node.op_type
        elif node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] and node.input[2] not in off:
            yield "Dropout"
    for attribute in node.attribute:
        for body in bodies(attribute):
            for inner in body.node:
                yield from _random_ops(inner, off)
