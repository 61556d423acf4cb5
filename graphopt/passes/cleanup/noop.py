"""Remove operations that return their input unchanged.

Each rule below looks at one node and returns the value that can stand for its (first)
output, or None when the node does real work or the IR does not know enough to be sure.
The rules are a table indexed by op type; one driver applies them to every graph in
topological order, so chains such as ``Identity(Identity(x))`` go in one sweep.

What the rules rely on:

- element types and shapes come from the IR's value types, which may be missing (then a
  rule that needs them does not fire); a symbolic dim is never assumed to equal an int;
- constants are initializers or ``Constant`` nodes; an initializer that is also a graph
  input is not a constant, the caller may feed it;
- a node with outputs besides the first (Dropout's mask) is removed only when nothing
  reads those;
- a node inside a function body whose attribute refers to the function's own attributes
  is left alone: its value is known only at the call site.

Removing a node whose output is a graph output keeps that output's name (see
``graphopt.ir.rewrite.replace_value``); when the input cannot take the name over, the
node stays.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from graphopt.ir import AttrKind, DataType, Dim, Model, Node, TensorType, Value, tensor_shape
from graphopt.ir.constness import constant_array
from graphopt.ir.rewrite import Namer, can_take_over, replace_value
from graphopt.passes.base import Pass, PassContext, PassResult, register

__all__ = ["RULES", "NoopElimination", "Rule"]

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Rule:
    """``bypass(node, opset)`` returns the value that replaces the node's output, or None."""

    name: str
    ops: tuple[str, ...]
    bypass: Callable[[Node, int], Value | None]


# -- what the rules know about values ------------------------------------------------------


def _input_ints(node: Node, index: int) -> list[int] | None:
    """The values of constant integer input ``index``."""
    array = constant_array(node.inputs[index] if index < len(node.inputs) else None)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.ravel()]


def _ints(node: Node, attr: str, index: int) -> list[int] | None:
    """An int list given as attribute ``attr`` (older opsets) or constant input ``index``."""
    if attr in node.attributes:
        given = node.attributes[attr]
        return [int(v) for v in given.value] if given.kind == AttrKind.INTS and given.value is not None else None
    return _input_ints(node, index)


def _given(node: Node, attr: str, index: int) -> bool:
    """Whether the optional operand (attribute or input) is present at all."""
    return attr in node.attributes or (index < len(node.inputs) and node.inputs[index] is not None)


def _fits_into(shape: tuple[int, ...], into: tuple[Dim, ...]) -> bool:
    """Whether broadcasting ``shape`` against ``into`` yields ``into`` (right-aligned)."""
    if len(shape) > len(into):
        return False
    return all(n == 1 or n == dim for n, dim in zip(reversed(shape), reversed(into), strict=False))


# -- the rules -----------------------------------------------------------------------------


def identity(node: Node, opset: int) -> Value | None:
    # Identity(x) -> x
    return node.inputs[0]


def dropout_inference(node: Node, opset: int) -> Value | None:
    # Dropout(x, ratio, training_mode=false) -> x
    if opset < 7 and not node.attr("is_test", 0):  # before opset 7, training unless is_test
        return None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        training = constant_array(node.inputs[2])
        if training is None or training.size != 1 or bool(training.ravel()[0]):
            return None
    return node.inputs[0]


def cast_to_same_type(node: Node, opset: int) -> Value | None:
    # Cast(x: float, to=float) -> x
    x = node.inputs[0]
    if x is None or not isinstance(x.type, TensorType) or x.type.dtype == DataType.UNDEFINED:
        return None
    return x if node.attr("to") == x.type.dtype else None


def reshape_to_same_shape(node: Node, opset: int) -> Value | None:
    # Reshape(x: [b, s, 256], [0, -1, 256]) -> x
    x, shape = node.inputs[0], tensor_shape(node.inputs[0])
    target = _ints(node, "shape", 1)
    if shape is None or target is None or len(target) != len(shape) or target.count(-1) > 1:
        return None
    copies_zero = not node.attr("allowzero", 0)
    for dim, want in zip(shape, target, strict=True):
        if want == -1 or (want == 0 and copies_zero):
            continue  # -1 is inferred as this dim since every other dim matches; 0 copies it
        if dim != want:
            return None
    return x


def transpose_identity(node: Node, opset: int) -> Value | None:
    # Transpose(x, perm=[0, 1, ..., n-1]) -> x
    x, given = node.inputs[0], node.attributes.get("perm")
    perm = given.value if given is not None and given.kind == AttrKind.INTS else None
    if given is None:  # the default reverses the dims, which changes nothing only up to rank 1
        shape = tensor_shape(x)
        return x if shape is not None and len(shape) <= 1 else None
    return x if perm is not None and list(perm) == list(range(len(perm))) else None


def pad_nothing(node: Node, opset: int) -> Value | None:
    # Pad(x, pads=[0, ..., 0]) -> x
    pads = _ints(node, "pads", 1)
    return node.inputs[0] if pads is not None and not any(pads) else None


def squeeze_nothing(node: Node, opset: int) -> Value | None:
    # Squeeze(x: [2, 3], axes=[]) -> x   (no axes means every dim of 1, and there is none)
    x, shape = node.inputs[0], tensor_shape(node.inputs[0])
    axes = _ints(node, "axes", 1) if _given(node, "axes", 1) else []
    if axes != [] or shape is None:
        return None
    return x if all(isinstance(d, int) and d != 1 for d in shape) else None


def unsqueeze_nothing(node: Node, opset: int) -> Value | None:
    # Unsqueeze(x, axes=[]) -> x
    return node.inputs[0] if _ints(node, "axes", 1) == [] else None


def slice_everything(node: Node, opset: int) -> Value | None:
    # Slice(x: [4, s], starts=[0, 0], ends=[4, INT64_MAX], steps=[1, 1]) -> x
    x, shape = node.inputs[0], tensor_shape(node.inputs[0])
    starts, ends = _ints(node, "starts", 1), _ints(node, "ends", 2)
    if starts is None or ends is None or any(starts):
        return None
    axes = _ints(node, "axes", 3) if _given(node, "axes", 3) else list(range(len(starts)))
    steps = _ints(node, "steps", 4) if _given(node, "steps", 4) else [1] * len(starts)
    if axes is None or steps is None or len(axes) != len(ends) or any(s != 1 for s in steps):
        return None
    for axis, end in zip(axes, ends, strict=True):
        if end >= INT64_MAX:
            continue
        if shape is None or not -len(shape) <= axis < len(shape):
            return None
        dim = shape[axis]
        if not isinstance(dim, int) or end < dim:
            return None
    return x


def expand_to_own_shape(node: Node, opset: int) -> Value | None:
    # Expand(x: [b, 3], shape=[1, 3]) -> x
    x, shape = node.inputs[0], tensor_shape(node.inputs[0])
    target = _input_ints(node, 1)
    if shape is None or target is None:
        return None
    return x if _fits_into(tuple(target), shape) else None


def tile_once(node: Node, opset: int) -> Value | None:
    # Tile(x, repeats=[1, ..., 1]) -> x
    repeats = _input_ints(node, 1)
    return node.inputs[0] if repeats is not None and all(r == 1 for r in repeats) else None


def single_input(node: Node, opset: int) -> Value | None:
    # Concat(x) -> x,  Sum(x) -> x,  Max(x) -> x, ...
    return node.inputs[0] if len(node.inputs) == 1 else None


def _neutral_operand(node: Node, neutral: int, constant_at: tuple[int, ...]) -> Value | None:
    """The other operand when the one at an index of ``constant_at`` is all ``neutral`` and
    broadcasting it changes neither the other's shape nor its element type."""
    if len(node.inputs) != 2:
        return None
    for index in constant_at:
        x = node.inputs[1 - index]
        constant = constant_array(node.inputs[index])
        shape = tensor_shape(x)
        if constant is None or x is None or shape is None or not isinstance(x.type, TensorType):
            continue
        try:
            same_type = x.type.dtype.numpy() == constant.dtype
        except TypeError:
            same_type = False
        if same_type and _fits_into(constant.shape, shape) and np.all(constant == neutral):
            return x
    return None


def add_zero(node: Node, opset: int) -> Value | None:
    # Add(x, 0) -> x,  Add(0, x) -> x
    return _neutral_operand(node, 0, (1, 0))


def sub_zero(node: Node, opset: int) -> Value | None:
    # Sub(x, 0) -> x
    return _neutral_operand(node, 0, (1,))


def mul_one(node: Node, opset: int) -> Value | None:
    # Mul(x, 1) -> x,  Mul(1, x) -> x
    return _neutral_operand(node, 1, (1, 0))


def div_one(node: Node, opset: int) -> Value | None:
    # Div(x, 1) -> x
    return _neutral_operand(node, 1, (1,))


RULES: tuple[Rule, ...] = (
    Rule("identity", ("Identity",), identity),
    Rule("dropout-inference", ("Dropout",), dropout_inference),
    Rule("cast-to-same-type", ("Cast",), cast_to_same_type),
    Rule("reshape-to-same-shape", ("Reshape",), reshape_to_same_shape),
    Rule("transpose-identity", ("Transpose",), transpose_identity),
    Rule("pad-nothing", ("Pad",), pad_nothing),
    Rule("squeeze-nothing", ("Squeeze",), squeeze_nothing),
    Rule("unsqueeze-nothing", ("Unsqueeze",), unsqueeze_nothing),
    Rule("slice-everything", ("Slice",), slice_everything),
    Rule("expand-to-own-shape", ("Expand",), expand_to_own_shape),
    Rule("tile-once", ("Tile",), tile_once),
    Rule("single-input", ("Concat", "Sum", "Max", "Min", "Mean"), single_input),
    Rule("add-zero", ("Add",), add_zero),
    Rule("sub-zero", ("Sub",), sub_zero),
    Rule("mul-one", ("Mul",), mul_one),
    Rule("div-one", ("Div",), div_one),
)

_BY_OP: dict[str, list[Rule]] = {}
for _rule in RULES:
    for _op in _rule.ops:
        _BY_OP.setdefault(_op, []).append(_rule)


@register
class NoopElimination(Pass, name="noop"):
    """Remove operations that return their input unchanged (Identity, Dropout, Cast to its own type, ...)"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        removed: Counter[str] = Counter()
        names = ctx.names(model)
        for graph in list(model.all_graphs()):
            opset = model.opset_in(graph)
            for node in graph.topological():
                rule = _bypass(node, opset, names)
                if rule is not None:
                    graph.remove(node)
                    removed[rule] += 1
        return PassResult(bool(removed), {"removed": dict(sorted(removed.items()))})


def _bypass(node: Node, opset: int, names: Namer) -> str | None:
    """Rewire the readers of ``node``'s output to its replacement; return the rule's name."""
    if not node.in_standard_domain or node.opaque or not node.outputs or not node.inputs:
        return None
    if any(attr.ref_attr_name for attr in node.attributes.values()):
        return None
    out = node.outputs[0]
    if any(v.is_used() for v in node.outputs[1:]):
        return None
    for rule in _BY_OP.get(node.op_type, ()):
        value = rule.bypass(node, opset)
        # An Identity to keep an output's name would only undo the removal: keep the node then.
        if value is not None and can_take_over(out, value):
            replace_value(out, value, names)
            return rule.name
    return None
