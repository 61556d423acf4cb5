"""The sizes a model's ops accept: the smallest length of each dynamic dim, and the factor a
Reshape target bakes in.

An audio model pads its samples by reflection before framing them (onnxruntime refuses a
reflect pad longer than the axis: "post-pad (64) exceeds maximum allowed (15)"), convolves
them with a kernel of hundreds of samples, or slices fixed frames out of them; a decoder's
exporter may bake a head count or the traced sequence length into a Reshape target, so the
elements must come in multiples of it. The check binds dims at sizes such models refuse
unless it knows; this module reads what they need from the graph, before anything runs.

Each value's shape is followed from the inputs in graph order: an axis is a static size, a
:class:`Length` that follows one input dim ``x`` as ``floor((x + offset) / divisor)`` (a
pad adds to the offset, a strided Conv divides, and floors of floors compose exactly), or
unknown. Integer vectors that hold shapes (Shape, then Gather, Slice, Concat of its parts)
are followed the same way, so a Reshape target built from the input's own dims and constants
is read as well as a stored one. What an op needs of a Length axis becomes a smallest value
of its dim:

- a reflect Pad: more elements than either pad (and two at least); an edge or wrap Pad: one;
- a Conv or pooling op: the padded axis covers the dilated kernel;
- a Slice with constant bounds (the frames an STFT-style front end cuts): up to its end;
- an STFT: one frame.

A Reshape whose target holds a -1 needs the element count to be a multiple of the product
of its other entries; what the static dims and the dims copied on both sides do not supply
the dynamic dims must: a factor on those dims.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx

from graphopt.ir.node import STANDARD_DOMAINS
from graphopt.ir.ops import BROADCASTING, ELEMENTWISE_UNARY
from graphopt.numerics.paths import inline_array

__all__ = ["Length", "SizeRules", "size_rules"]

# A smallest size above this is no front end's but a bound that means "to the end" (a Slice
# to 2**31 - 1) or a model the check would not feed anyway: no rule.
LARGEST_RULE = 2**16


@dataclass(frozen=True)
class Length:
    """An axis whose size follows the input dim ``key`` (its value x) as floor((x + offset) / divisor)."""

    key: str
    offset: int = 0
    divisor: int = 1

    def plus(self, size: int) -> Length:
        return Length(self.key, self.offset + size * self.divisor, self.divisor)

    def over(self, stride: int) -> Length:
        return Length(self.key, self.offset, self.divisor * stride)

    def needs(self, size: int) -> int:
        """The smallest x that makes this axis at least ``size`` long."""
        return size * self.divisor - self.offset

    def plain(self) -> bool:
        return self.offset == 0 and self.divisor == 1


Axis = int | Length | None  # a static size, a size that follows a dynamic dim, unknown


@dataclass
class SizeRules:
    smallest: dict[str, int] = field(default_factory=dict)  # dim key -> the least value the ops accept
    # A factor the product of some dynamic dims needs (a Reshape target's), with those dims' keys.
    factors: list[tuple[tuple[str, ...], int]] = field(default_factory=list)

    def at_least(self, axis: Axis, size: int) -> None:
        if isinstance(axis, Length) and 1 < (needed := axis.needs(size)) <= LARGEST_RULE:
            self.smallest[axis.key] = max(self.smallest.get(axis.key, 1), needed)


# Ops whose output has the shape of their first input.
_SAME_SHAPE = ELEMENTWISE_UNARY | {
    "Identity",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "BatchNormalization",
    "InstanceNormalization",
    "Dropout",
    "Not",
    "Sign",
    "Floor",
    "Ceil",
    "Round",
    "CumSum",
}
_WINDOWED = frozenset({"Conv", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool"})
_WEIGHT_INPUT = {"Conv": 1, "ConvInteger": 1, "QLinearConv": 3}


def size_rules(graph: onnx.GraphProto, inputs: Mapping[str, list[int | str]]) -> SizeRules:
    """What the ops of ``graph`` need of the dims of ``inputs`` (name -> a static size or a dim key per axis)."""
    walk = _Walk(graph)
    for name, axes in inputs.items():
        walk.shapes[name] = [Length(a) if isinstance(a, str) else a for a in axes]
    for node in graph.node:
        if node.domain in STANDARD_DOMAINS and node.output:
            walk.visit(node)
    return walk.rules


def _attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _ints(node: onnx.NodeProto, name: str) -> list[int] | None:
    attribute = _attribute(node, name)
    return list(attribute.ints) if attribute is not None else None


def _int(node: onnx.NodeProto, name: str, default: int) -> int:
    attribute = _attribute(node, name)
    return attribute.i if attribute is not None else default


class _Walk:
    """Shapes and shape vectors in graph order, and the rules the ops on them make."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.rules = SizeRules()
        self.shapes: dict[str, list[Axis]] = {init.name: list(init.dims) for init in graph.initializer}
        # Integer vectors of known entries: stored ones, and the shapes the graph computes.
        self.vectors: dict[str, list[Axis]] = {}
        for init in graph.initializer:
            self._store(init.name, init)

    def _store(self, name: str, tensor: onnx.TensorProto) -> None:
        if tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and len(tensor.dims) <= 1:
            array = inline_array(tensor)
            if array is not None:
                self.vectors[name] = [int(v) for v in array.ravel()]

    def _vector(self, node: onnx.NodeProto, index: int) -> list[Axis] | None:
        return self.vectors.get(node.input[index]) if len(node.input) > index and node.input[index] else None

    def _constants(self, node: onnx.NodeProto, index: int, attribute: str | None = None) -> list[int] | None:
        """An operand given as an input (newer opsets) or an attribute (older ones), if constant."""
        given = len(node.input) > index and node.input[index]
        found = self._vector(node, index) if given else _ints(node, attribute) if attribute else None
        return found if found is not None and all(isinstance(v, int) for v in found) else None  # type: ignore[return-value]

    def visit(self, node: onnx.NodeProto) -> None:
        op = node.op_type
        shape = self.shapes.get(node.input[0]) if node.input and node.input[0] else None
        if op == "Constant":
            self._constant(node)
            return
        self._vector_op(node)
        out: list[Axis] | None = None
        if op in _SAME_SHAPE:
            out = shape
        elif op in BROADCASTING:
            out = _broadcast([self.shapes.get(n) for n in node.input])
        elif shape is None:
            return
        elif op in ("Unsqueeze", "Squeeze"):
            axes = self._constants(node, 1, "axes")
            out = _squeezed(shape, axes, op == "Unsqueeze")
        elif op == "Transpose":
            perm = _ints(node, "perm") or list(range(len(shape)))[::-1]
            out = [shape[i] for i in perm] if sorted(perm) == list(range(len(shape))) else None
        elif op == "Pad":
            out = self._pad(node, shape)
        elif op in _WINDOWED:
            out = self._window(node, shape)
        elif op == "Slice":
            out = self._slice(node, shape)
        elif op == "STFT":
            self._stft(node, shape)
        elif op == "Reshape":
            out = self._reshape(node, shape)
        elif op == "MatMul":
            out = _matmul(shape, self.shapes.get(node.input[1]))
        elif op == "Gather":
            indices = self.shapes.get(node.input[1])
            axis = _int(node, "axis", 0) % max(len(shape), 1)
            out = shape[:axis] + indices + shape[axis + 1 :] if indices is not None and shape else None
        if out is not None:
            self.shapes[node.output[0]] = out

    def _constant(self, node: onnx.NodeProto) -> None:
        value, ints, one = _attribute(node, "value"), _ints(node, "value_ints"), _attribute(node, "value_int")
        name = node.output[0]
        if value is not None:
            self.shapes[name] = list(value.t.dims)
            self._store(name, value.t)
        elif ints is not None:
            self.shapes[name], self.vectors[name] = [len(ints)], list(ints)
        elif one is not None:
            self.shapes[name], self.vectors[name] = [], [one.i]

    def _vector_op(self, node: onnx.NodeProto) -> None:
        """Follow integer vectors that are shapes or parts of them."""
        op, vector = node.op_type, self._vector(node, 0)
        found: list[Axis] | None = None
        if op == "Shape" and node.input[0] in self.shapes:
            end = _attribute(node, "end")
            found = self.shapes[node.input[0]][_int(node, "start", 0) : end.i if end is not None else None]
        elif op in ("Cast", "Identity", "Unsqueeze", "Squeeze") and vector is not None:
            found = vector
        elif op == "Gather" and vector is not None:
            index = self._vector(node, 1)
            at = index[0] if index is not None and len(index) == 1 else None
            if isinstance(at, int) and -len(vector) <= at < len(vector):
                found = [vector[at]]
        elif op == "Concat":
            parts = [self.vectors.get(n) for n in node.input]
            found = [entry for part in parts for entry in part] if all(p is not None for p in parts) else None  # type: ignore[union-attr]
        if found is not None:
            self.vectors[node.output[0]] = found

    def _pad(self, node: onnx.NodeProto, shape: list[Axis]) -> list[Axis] | None:
        pads = self._constants(node, 1, "pads")
        if pads is None or len(pads) % 2:
            return None
        axes = self._constants(node, 3)
        chosen = [a % len(shape) for a in axes] if axes is not None else list(range(len(shape)))
        if len(pads) != 2 * len(chosen):
            return None
        mode = _attribute(node, "mode")
        kind = mode.s.decode() if mode is not None else "constant"
        out = list(shape)
        for i, axis in enumerate(chosen):
            before, after = pads[i], pads[i + len(chosen)]
            if kind == "reflect" and max(before, after) > 0:
                self.rules.at_least(shape[axis], max(before, after, 1) + 1)
            elif kind in ("edge", "wrap") and max(before, after) > 0:
                self.rules.at_least(shape[axis], 1)
            out[axis] = _plus(shape[axis], before + after)
        return out

    def _window(self, node: onnx.NodeProto, shape: list[Axis]) -> list[Axis] | None:
        """A Conv or pooling op over [N, C, spatial...]: the padded axis covers the dilated kernel."""
        spatial = len(shape) - 2
        weight = self.shapes.get(node.input[_WEIGHT_INPUT[node.op_type]]) if node.op_type in _WEIGHT_INPUT else None
        kernel = _ints(node, "kernel_shape") or (weight[2:] if weight is not None else None)
        if spatial < 1 or kernel is None or len(kernel) != spatial or not all(isinstance(k, int) for k in kernel):
            return None
        strides = _ints(node, "strides") or [1] * spatial
        dilations = _ints(node, "dilations") or [1] * spatial
        pads = _ints(node, "pads") or [0] * 2 * spatial
        if len(strides) != spatial or len(dilations) != spatial or len(pads) != 2 * spatial or min(strides) < 1:
            return None  # onnxruntime's to refuse
        auto = _attribute(node, "auto_pad")
        same = auto is not None and auto.s.startswith(b"SAME")
        ceil = _int(node, "ceil_mode", 0)
        out: list[Axis] = [shape[0], weight[0] if weight is not None else shape[1]]
        for i, axis in enumerate(shape[2:]):
            reach = dilations[i] * (int(kernel[i]) - 1) + 1  # type: ignore[arg-type]
            padding = 0 if auto is not None and auto.s == b"VALID" else pads[i] + pads[i + spatial]
            if same:  # ceil(x / stride), and no size too small
                out.append(_divided(_plus(axis, strides[i] - 1), strides[i]))
                continue
            self.rules.at_least(axis, reach - padding)
            extra = strides[i] - 1 if ceil else 0
            out.append(_divided(_plus(axis, padding - reach + strides[i] + extra), strides[i]))
        return out

    def _slice(self, node: onnx.NodeProto, shape: list[Axis]) -> list[Axis] | None:
        starts, ends = self._constants(node, 1, "starts"), self._constants(node, 2, "ends")
        if starts is None or ends is None or len(starts) != len(ends):
            return None
        axes = self._constants(node, 3, "axes") or list(range(len(starts)))
        steps = self._constants(node, 4) or [1] * len(starts)
        out = list(shape)
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=False):
            if not -len(shape) <= axis < len(shape):
                return None
            out[axis] = self._sliced(shape[axis], start, end, step)
        return out

    def _sliced(self, axis: Axis, start: int, end: int, step: int) -> Axis:
        if step == 0:  # onnxruntime's to refuse
            return None
        if isinstance(axis, int):
            return len(range(axis)[start:end:step])
        to_end = end > LARGEST_RULE
        if axis is None or step != 1 or (start >= 0 and end >= 0 and not to_end and end <= start):
            return None
        if start >= 0 and to_end:
            self.rules.at_least(axis, start + 1)
            return axis.plus(-start)
        if start >= 0 and end >= 0:  # a frame: the axis reaches its end
            self.rules.at_least(axis, end)
            return end - start
        if start >= 0:  # up to ``-end`` before the end
            self.rules.at_least(axis, start - end + 1)
            return axis.plus(end - start)
        self.rules.at_least(axis, -start)  # the last ``-start`` elements
        return -start if to_end else (end - start if start < end < 0 else None)

    def _stft(self, node: onnx.NodeProto, shape: list[Axis]) -> None:
        length = self._constants(node, 3)
        window = self.shapes.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        frame = length[0] if length else window[0] if window and len(window) == 1 else None
        if isinstance(frame, int) and len(shape) > 1:
            self.rules.at_least(shape[1], frame)

    def _reshape(self, node: onnx.NodeProto, shape: list[Axis]) -> list[Axis] | None:
        target = self._vector(node, 1)
        if target is None:
            return None
        copied = [
            shape[i] if entry == 0 and not _int(node, "allowzero", 0) and i < len(shape) else entry
            for i, entry in enumerate(target)
        ]
        if None not in shape and all(isinstance(a, int) or a.plain() for a in shape if a is not None):
            self._reshape_factor(shape, copied)
        return [a if isinstance(a, Length) or (isinstance(a, int) and a > 0) else None for a in copied]

    def _reshape_factor(self, shape: list[Axis], target: list[Axis]) -> None:
        """The factor the dynamic dims of ``shape`` must supply for ``target`` (with a -1) to fit."""
        if -1 not in target or any(a is None for a in target):
            return
        keys = [a.key for a in shape if isinstance(a, Length)]
        for entry in target:
            if isinstance(entry, Length):
                if entry.key not in keys or not entry.plain():
                    return
                keys.remove(entry.key)  # the dim is on both sides
        wanted = math.prod(a for a in target if isinstance(a, int) and a > 0)
        have = math.prod(a for a in shape if isinstance(a, int))
        factor = wanted // math.gcd(wanted, have) if have else 1
        if factor > 1 and keys and factor <= LARGEST_RULE:
            self.rules.factors.append((tuple(keys), factor))


def _plus(axis: Axis, size: int) -> Axis:
    if isinstance(axis, Length):
        return axis.plus(size)
    return axis + size if axis is not None else None


def _divided(axis: Axis, stride: int) -> Axis:
    if isinstance(axis, Length):
        return axis.over(stride)
    return axis // stride if axis is not None else None


def _squeezed(shape: list[Axis], axes: list[int] | None, unsqueeze: bool) -> list[Axis] | None:
    if axes is None:
        return None if unsqueeze else [a for a in shape if a != 1]
    out = list(shape)
    if unsqueeze:
        for axis in sorted(a % (len(shape) + len(axes)) for a in axes):
            out.insert(axis, 1)
        return out
    dropped = {a % len(shape) for a in axes} if shape else set()
    return [a for i, a in enumerate(shape) if i not in dropped]


def _broadcast(shapes: list[list[Axis] | None]) -> list[Axis] | None:
    """Numpy broadcasting: each axis the first input's that is not 1 there."""
    if not shapes or any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes if s is not None)
    out: list[Axis] = [1] * rank
    for shape in shapes:
        assert shape is not None
        for i, axis in enumerate(shape):
            slot = rank - len(shape) + i
            if out[slot] == 1 or (out[slot] is None and axis != 1):
                out[slot] = axis
    return out


def _matmul(a: list[Axis], b: list[Axis] | None) -> list[Axis] | None:
    if b is None or len(a) < 2 or len(b) < 2:
        return None
    batch = _broadcast([a[:-2], b[:-2]]) or []
    return [*batch, a[-2], b[-1]]
