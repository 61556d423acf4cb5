"""Noop family: single-node rules for operations that return their input unchanged.

The ``noop`` pass (graphopt/passes/cleanup/noop.py) sweeps these over every graph; the shape
family of the fuse pass runs two of them too (a Transpose by the identity perm, a Cast to
its input's own type). Each plan looks at one node and gives the value that stands for its
(first) output, or the reason the node stays: it does real work, or the IR does not know
enough to be sure.

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

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from graphopt.ir import AttrKind, DataType, Dim, Node, TensorType, Value, tensor_shape
from graphopt.ir.constness import constant_array
from graphopt.ir.rewrite import Builder, can_take_over
from graphopt.passes.rewrite.engine import Match, Plan, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import OpPattern, op, optional, var

__all__ = ["CAST_TO_SAME_TYPE", "FAMILY", "RULES", "TRANSPOSE_IDENTITY"]

FAMILY = "noop"
INT64_MAX = 2**63 - 1

Bypass = Callable[[Node, int], "Value | None"]


def _removable(refusal: str) -> Callable[[Bypass], Plan[Value]]:
    """A rule's plan from ``bypass(node, opset)``, which gives the value that replaces the
    node's output or None (then ``refusal`` is the reason the node stays)."""

    def plan_of(bypass: Bypass) -> Plan[Value]:
        def plan(m: Match, site: Site) -> Value | Refuse:
            value = bypass(m.root, site.opset)
            if value is None:
                return Refuse(refusal)
            # An Identity to keep an output's name would only undo the removal: keep the node then.
            if not can_take_over(m.root.outputs[0], value):
                return Refuse("its output's name cannot go to the value that stands for it")
            return value

        return plan

    return plan_of


def _bypassable(node: Node) -> bool:
    """Whether the node may go at all: a known op, no attribute bound at a function's call
    site, and no output but the first read."""
    if node.opaque or any(attr.ref_attr_name for attr in node.attributes.values()):
        return False
    return not any(v.is_used() for v in node.outputs[1:])


def _single(op_types: Sequence[str], arity: int) -> OpPattern:
    """One node of ``op_types`` with input 0 ``x`` and up to ``arity`` inputs in all."""
    rest = (optional(var(f"_{i}")) for i in range(1, arity))
    return op.any_of(op_types, var("x"), *rest, where=_bypassable, commute=False)


def _bypassed(b: Builder, m: Match, value: Value) -> Value:
    return value


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


@_removable("never refused")
def identity(node: Node, opset: int) -> Value | None:
    # Identity(x) -> x
    return node.inputs[0]


@_removable("it may be training")
def dropout_inference(node: Node, opset: int) -> Value | None:
    # Dropout(x, ratio, training_mode=false) -> x
    if opset < 7 and not node.attr("is_test", 0):  # before opset 7, training unless is_test
        return None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        training = constant_array(node.inputs[2])
        if training is None or training.size != 1 or bool(training.ravel()[0]):
            return None
    return node.inputs[0]


@_removable("a real conversion")
def cast_to_same_type(node: Node, opset: int) -> Value | None:
    # Cast(x: float, to=float) -> x
    x = node.inputs[0]
    if x is None or not isinstance(x.type, TensorType) or x.type.dtype == DataType.UNDEFINED:
        return None
    return x if node.attr("to") == x.type.dtype else None


@_removable("the shape may change")
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


@_removable("not the identity")
def transpose_identity(node: Node, opset: int) -> Value | None:
    # Transpose(x, perm=[0, 1, ..., n-1]) -> x
    x, given = node.inputs[0], node.attributes.get("perm")
    perm = given.value if given is not None and given.kind == AttrKind.INTS else None
    if given is None:  # the default reverses the dims, which changes nothing only up to rank 1
        shape = tensor_shape(x)
        return x if shape is not None and len(shape) <= 1 else None
    return x if perm is not None and list(perm) == list(range(len(perm))) else None


@_removable("it pads")
def pad_nothing(node: Node, opset: int) -> Value | None:
    # Pad(x, pads=[0, ..., 0]) -> x
    pads = _ints(node, "pads", 1)
    return node.inputs[0] if pads is not None and not any(pads) else None


@_removable("it may squeeze")
def squeeze_nothing(node: Node, opset: int) -> Value | None:
    # Squeeze(x: [2, 3], axes=[]) -> x   (no axes means every dim of 1, and there is none)
    x, shape = node.inputs[0], tensor_shape(node.inputs[0])
    axes = _ints(node, "axes", 1) if _given(node, "axes", 1) else []
    if axes != [] or shape is None:
        return None
    return x if all(isinstance(d, int) and d != 1 for d in shape) else None


@_removable("it unsqueezes")
def unsqueeze_nothing(node: Node, opset: int) -> Value | None:
    # Unsqueeze(x, axes=[]) -> x
    return node.inputs[0] if _ints(node, "axes", 1) == [] else None


@_removable("it may cut")
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


@_removable("it may expand")
def expand_to_own_shape(node: Node, opset: int) -> Value | None:
    # Expand(x: [b, 3], shape=[1, 3]) -> x
    x, shape = node.inputs[0], tensor_shape(node.inputs[0])
    target = _input_ints(node, 1)
    if shape is None or target is None:
        return None
    return x if _fits_into(tuple(target), shape) else None


@_removable("it may repeat")
def tile_once(node: Node, opset: int) -> Value | None:
    # Tile(x, repeats=[1, ..., 1]) -> x
    repeats = _input_ints(node, 1)
    return node.inputs[0] if repeats is not None and all(r == 1 for r in repeats) else None


def _text(node: Node, attr: str, default: str) -> str:
    found = node.attr(attr, default)
    return found.decode() if isinstance(found, bytes) else str(found)


# The coordinate transformations that map every output index to itself when the size stays: by the spec's
# formulas tf_half_pixel_for_nn reads half a pixel further, tf_crop_and_resize reads its roi.
_RESIZE_IDENTICAL_AT_SCALE_ONE = frozenset(
    {"half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric"}
)


@_removable("it may resample")
def resize_to_own_size(node: Node, opset: int) -> Value | None:
    # Resize(x: [1, 4, 27, 27], sizes=[1, 4, 27, 27]) -> x   (every output index reads its own input index)
    x, shape = node.inputs[0], tensor_shape(node.inputs[0])
    if x is None or shape is None:
        return None
    if (
        opset >= 11
        and _text(node, "coordinate_transformation_mode", "half_pixel") not in _RESIZE_IDENTICAL_AT_SCALE_ONE
    ):
        return None
    if _text(node, "mode", "nearest") != "nearest":
        # a linear or cubic sample at an input index still weighs its neighbours by 0: onnx's reference evaluator
        # turns an infinite value into the type's largest there (onnxruntime copies the input at scale 1)
        data = constant_array(x)
        if data is None or data.dtype.kind != "f" or not np.all(np.isfinite(data)):
            return None
    axes = [int(axis) % len(shape) for axis in node.attr("axes") or range(len(shape))]
    scales_at, sizes_at = (1, len(node.inputs)) if opset < 11 else (2, 3)  # opset 10: (x, scales)
    scales = constant_array(node.inputs[scales_at]) if scales_at < len(node.inputs) else None
    if scales is not None and scales.size:
        return x if scales.size == len(axes) and np.all(scales == 1) else None
    sizes = _input_ints(node, sizes_at) if sizes_at < len(node.inputs) else None
    if sizes is None or len(sizes) != len(axes):
        return None
    return x if all(shape[axis] == size for axis, size in zip(axes, sizes, strict=True)) else None


@_removable("more than one input")
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


def _neutral(neutral: int, positions: tuple[int, ...]) -> Plan[Value]:
    """The plan bypassing a binary op whose operand at one of ``positions`` is ``neutral`` everywhere."""
    return _removable("no neutral operand")(lambda node, opset: _neutral_operand(node, neutral, positions))


add_zero = _neutral(0, (1, 0))  # Add(x, 0) -> x,  Add(0, x) -> x
sub_zero = _neutral(0, (1,))  # Sub(x, 0) -> x
mul_one = _neutral(1, (1, 0))  # Mul(x, 1) -> x,  Mul(1, x) -> x
div_one = _neutral(1, (1,))  # Div(x, 1) -> x
and_true = _neutral(True, (1, 0))  # And(x, True) -> x: the exporters' all-true start of a mask
or_false = _neutral(False, (1, 0))  # Or(x, False) -> x


def _noop(name: str, op_types: Sequence[str], arity: int, plan: Plan[Value], doc: str) -> Rule[Value]:
    """The rule that bypasses one node of ``op_types`` (``arity`` inputs at the most) where ``plan`` agrees."""
    return Rule(
        name=name,
        family=FAMILY,
        pattern=_single(op_types, arity),
        plan=plan,
        build=_bypassed,
        label=" / ".join(op_types),
        doc=doc,
    )


# The two the fuse pass's shape family runs as well.
CAST_TO_SAME_TYPE = _noop("cast-to-same-type", ("Cast",), 1, cast_to_same_type, "Cast(x: float, to=float) -> x")

TRANSPOSE_IDENTITY = _noop(
    "transpose-identity", ("Transpose",), 1, transpose_identity, "Transpose(x, perm=[0, 1, ..., n-1]) -> x"
)


RULES: tuple[Rule[Any], ...] = (
    _noop("identity", ("Identity",), 1, identity, "Identity(x) -> x"),
    _noop("dropout-inference", ("Dropout",), 3, dropout_inference, "Dropout(x, ratio, training_mode=false) -> x"),
    CAST_TO_SAME_TYPE,
    _noop(
        "reshape-to-same-shape", ("Reshape",), 2, reshape_to_same_shape, "Reshape(x: [b, s, 256], [0, -1, 256]) -> x"
    ),
    TRANSPOSE_IDENTITY,
    _noop("pad-nothing", ("Pad",), 4, pad_nothing, "Pad(x, pads=[0, ..., 0]) -> x"),
    _noop(
        "squeeze-nothing",
        ("Squeeze",),
        2,
        squeeze_nothing,
        "Squeeze(x: [2, 3], axes=[]) -> x   (no axes means every dim of 1, and there is none)",
    ),
    _noop("unsqueeze-nothing", ("Unsqueeze",), 2, unsqueeze_nothing, "Unsqueeze(x, axes=[]) -> x"),
    _noop(
        "slice-everything",
        ("Slice",),
        5,
        slice_everything,
        "Slice(x: [4, s], starts=[0, 0], ends=[4, INT64_MAX], steps=[1, 1]) -> x",
    ),
    _noop("expand-to-own-shape", ("Expand",), 2, expand_to_own_shape, "Expand(x: [b, 3], shape=[1, 3]) -> x"),
    _noop("tile-once", ("Tile",), 2, tile_once, "Tile(x, repeats=[1, ..., 1]) -> x"),
    _noop(
        "resize-to-own-size",
        ("Resize",),
        4,
        resize_to_own_size,
        "Resize(x: [1, 4, 27, 27], sizes=[1, 4, 27, 27]) -> x   (a linear or cubic one of a finite constant only)",
    ),
    _noop(
        "single-input",
        ("Concat", "Sum", "Max", "Min", "Mean"),
        1,
        single_input,
        "Concat(x) -> x,  Sum(x) -> x,  Max(x) -> x, ...",
    ),
    _noop("add-zero", ("Add",), 2, add_zero, "Add(x, 0) -> x,  Add(0, x) -> x"),
    _noop("sub-zero", ("Sub",), 2, sub_zero, "Sub(x, 0) -> x"),
    _noop("mul-one", ("Mul",), 2, mul_one, "Mul(x, 1) -> x,  Mul(1, x) -> x"),
    _noop("div-one", ("Div",), 2, div_one, "Div(x, 1) -> x"),
    _noop("and-true", ("And",), 2, and_true, "And(x, True) -> x,  And(True, x) -> x"),
    _noop("or-false", ("Or",), 2, or_false, "Or(x, False) -> x,  Or(False, x) -> x"),
)
