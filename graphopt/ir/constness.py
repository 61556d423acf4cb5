"""What is a compile-time constant, and its value: the one place that decides.

A value is a compile-time constant when it is an initializer that the caller cannot feed
(an initializer that is also a graph input is a default, not a constant), or the output
of a standard ``Constant`` node whose attribute is a literal (inside a function body an
attribute may refer to the call site's attribute: that is known only there).

Everything that reads constants (rules, cleanup, shape facts, folding) goes through
:func:`constant_tensor` and :func:`constant_array`; nothing else tests ``value.const``
for this purpose.
"""

from __future__ import annotations

import numpy as np

from graphopt.ir.node import Node
from graphopt.ir.tensor import ArraySource, Tensor
from graphopt.ir.types import DataType
from graphopt.ir.value import Value

__all__ = [
    "DEFAULT_READ_LIMIT",
    "RANDOM_OPS",
    "constant_array",
    "constant_node_tensor",
    "constant_tensor",
    "is_constant",
    "is_deterministic",
]

# Standard ops that draw a new sample on every run: never folded, merged or assumed equal.
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)

# Rules that only test a constant (an axis list, a shape, a scalar) read no more than this
# many elements; folding passes ask for more explicitly.
DEFAULT_READ_LIMIT = 1 << 16

# Constant's attribute spellings other than a tensor, and the element type each implies.
_LITERALS = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
    "value_string": np.object_,
    "value_strings": np.object_,
}


def is_constant(value: Value | None) -> bool:
    """Whether ``value`` is a compile-time constant (see the module docstring)."""
    return constant_tensor(value) is not None


def is_deterministic(node: Node, opset: int | None = None) -> bool:
    """Whether ``node`` computes the same outputs from the same inputs on every run: not a
    random op, and not a Dropout that may be in training mode (a training_mode input that
    is not the constant false; below opset 7, is_test not set)."""
    if not node.in_standard_domain:
        return True
    if node.op_type in RANDOM_OPS:
        return False
    if node.op_type == "Dropout" and opset is not None and opset < 7:
        return bool(node.attr("is_test", 0))
    if node.op_type == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is None:
            return True
        flag = constant_array(training)
        return flag is not None and flag.size == 1 and not bool(flag.ravel()[0])
    return True


def constant_tensor(value: Value | None) -> Tensor | None:
    """The tensor behind a compile-time constant, without reading its values."""
    if value is None:
        return None
    if isinstance(value.const, Tensor):
        return None if value.is_graph_input else value.const
    producer = value.producer
    if producer is None or producer.op_type != "Constant" or not producer.in_standard_domain:
        return None
    return constant_node_tensor(producer)


def constant_node_tensor(node: Node) -> Tensor | None:
    """The tensor a ``Constant`` node produces, in whichever attribute spelling it uses."""
    if len(node.attributes) != 1 or len(node.outputs) != 1:  # anything else is no Constant a runtime takes
        return None
    (attr,) = node.attributes.values()
    if attr.ref_attr_name or attr.value is None:
        return None
    if attr.name == "value" and isinstance(attr.value, Tensor):
        return attr.value
    literal = _LITERALS.get(attr.name)
    if literal is None:
        return None  # sparse_value: its dense form is never materialized just to read it
    array = np.asarray(attr.value, dtype=literal)
    if literal is np.object_:
        return Tensor(node.outputs[0].name, DataType.STRING, tuple(array.shape), ArraySource(array))
    return Tensor.from_array(array, node.outputs[0].name)


def constant_array(value: Value | None, limit: int = DEFAULT_READ_LIMIT) -> np.ndarray | None:
    """The values of a compile-time constant (read-only), or None: not a constant, more than
    ``limit`` elements, or an element type numpy cannot hold."""
    tensor = constant_tensor(value)
    if tensor is None or tensor.size > limit:
        return None
    try:
        return tensor.numpy()
    except (TypeError, ValueError):
        return None
