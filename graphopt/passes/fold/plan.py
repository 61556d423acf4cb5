"""What may fold, and how: fold keys, layouts and the grouping function of one level.

Three kinds of folds, each a spec the realization turns into ONNX:

- ``shared-input``: MatMul / Gemm / Conv siblings that read the same activation with
  different constant weights; the weights are concatenated along the output dim (widths
  may differ) and the members' outputs sit side by side along that dim (a ``concat``
  layout).
- ``stacked``: MatMul / Gemm / Conv siblings on different activations of one shape, with
  weights of one shape. A Conv stacks its inputs along the channels and becomes a grouped
  Conv (``concat`` layout). A MatMul or Gemm becomes a grouped 1x1 Conv over a ``rows``
  layout, [1, F*width, rows, 1]: onnxruntime runs a batched MatMul with constant weights
  slower than the separate MatMuls (it pre-packs only 2-D weights), a grouped Conv faster.
- ``elementwise``: element-wise siblings (bias Adds, activations) whose activation input
  is a slice of an earlier fold: they run once on the folded tensor, so a chain of folded
  levels stays folded.

A fold reads its activation as an :class:`Operand`: the shared value, the earlier fold's
tensor as it is (``direct``, when the members read its slices in order), a Gather of its
slices (``gather``, when they do not), or the members' own activations packed (``pack``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from graphopt.ir import DataType, Dim, Node, TensorType, Value, tensor_dtype, tensor_shape
from graphopt.ir.constness import is_deterministic
from graphopt.ir.ops import ELEMENTWISE_BINARY
from graphopt.passes.fold.index import Fold, FoldIndex, Group, group_by_key

__all__ = [
    "SEED_OPS",
    "folded_constant",
    "Layout",
    "Operand",
    "Planner",
    "Spec",
]

SEED_OPS = frozenset({"MatMul", "Gemm", "Conv"})
# Element-wise ops (graphopt.ir.ops) run on a folded tensor unchanged: one activation,
# attributes and any other inputs equal across the group; the binary ones with one constant
# per member, folded along the layout.

Shape = tuple[Dim, ...]
How = Literal["shared-input", "stacked", "elementwise"]


@dataclass(frozen=True)
class Layout:
    """Where each member's output sits in a fold's tensor.

    ``concat``: member ``i`` is the tensor's slice ``ranges[i]`` along ``axis``.
    ``rows``: the tensor is [1, width, rows, 1]; member ``i`` is its channels ``ranges[i]``,
    transposed to [rows, width_i] and reshaped to the member's shape.
    """

    kind: Literal["concat", "rows"]
    axis: int
    ranges: tuple[tuple[int, int], ...]
    member_shapes: tuple[Shape, ...]

    @property
    def width(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0

    def gathered(self, slices: Sequence[int], member_shapes: Sequence[Shape]) -> Layout:
        """The layout of the tensor holding ``slices`` of this one, in that order."""
        ranges: list[tuple[int, int]] = []
        start = 0
        for index in slices:
            low, high = self.ranges[index]
            ranges.append((start, start + high - low))
            start += high - low
        return Layout(self.kind, self.axis, tuple(ranges), tuple(member_shapes))

    def channels(self, slices: Sequence[int]) -> list[int]:
        """The indices along ``axis`` of ``slices``, in order (what a Gather reads)."""
        return [c for index in slices for c in range(*self.ranges[index])]

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "axis": self.axis}


@dataclass
class Operand:
    """How the folded op reads the members' activation (input ``position``)."""

    how: Literal["shared", "direct", "gather", "pack"]
    position: int
    values: list[Value]  # the members' activations, in member order
    source: int | None = None  # the fold read through (direct, gather)
    slices: list[int] = field(default_factory=list)  # the source slices read (gather)


@dataclass
class Spec:
    how: How
    operand: Operand
    layout: Layout  # of the fold's output


def _attrs_key(node: Node) -> Hashable:
    return tuple(sorted((a.name, int(a.kind), repr(a.value)) for a in node.attributes.values()))


def _input_key(value: Value | None, constant: Callable[[Value | None], bool]) -> Hashable:
    """Per input: constant or not, dtype and shape (symbolic dims compare by identity)."""
    if value is None:
        return None
    return (constant(value), tensor_dtype(value), tensor_shape(value))


@dataclass
class Planner:
    """The grouping function of ``build_folded_graph`` for ONNX graphs.

    ``constant(v)`` says whether ``v`` is computed from constants only (an initializer, a
    Constant, a Transpose of a weight); ``weight(v)`` reads its array, or None.
    """

    constant: Callable[[Value | None], bool]
    weight: Callable[[Value | None], np.ndarray | None]
    ops: frozenset[str]
    min_group: int

    def __call__(self, level: Sequence[Node], index: FoldIndex[Spec]) -> Iterator[Group[Spec]]:
        candidates = [n for n in level if self._candidate(n)]
        taken: set[int] = set()
        for members in group_by_key(candidates, self._shared_key):
            spec = self._shared(members) if len(members) >= self.min_group else None
            if spec is not None:
                taken.update(id(m) for m in members)
                yield members, spec
        rest = [n for n in candidates if id(n) not in taken]
        for members in group_by_key(rest, lambda n: self._key(n, index)):
            if len(members) < self.min_group:
                continue
            members = _in_source_order(members, index, self._activation_position(members[0]))
            spec = (
                self._stacked(members, index) if members[0].op_type in SEED_OPS else self._elementwise(members, index)
            )
            if spec is not None:
                yield members, spec

    # -- candidates and keys ---------------------------------------------------------------
    def _candidate(self, node: Node) -> bool:
        return (
            node.in_standard_domain
            and node.op_type in self.ops
            and len(node.outputs) == 1
            and not any(True for _ in node.subgraphs())
            and is_deterministic(node)
            and isinstance(node.outputs[0].type, TensorType)
            and tensor_shape(node.outputs[0]) is not None
            and all(v is None or tensor_shape(v) is not None for v in node.inputs)
        )

    def _activation_position(self, node: Node) -> int | None:
        """The one input that is not a constant (the seed ops: input 0, weights constant)."""
        if node.op_type in SEED_OPS:
            activation, *weights = node.inputs
            if activation is None or self.constant(activation) or not all(self.constant(w) for w in weights):
                return None
            return 0
        positions = [i for i, v in enumerate(node.inputs) if v is not None and not self.constant(v)]
        return positions[0] if len(positions) == 1 else None

    def _shared_key(self, node: Node) -> Hashable | None:
        """Seed ops reading one activation: weights may differ in their output dim only."""
        if node.op_type not in SEED_OPS or self._activation_position(node) is None:
            return None
        out_axis = _weight_out_axis(node)
        weight_shapes: list[Hashable] = []
        for value in node.inputs[1:]:
            shape = tensor_shape(value)
            if value is None or shape is None:
                weight_shapes.append(None)
                continue
            axis = out_axis if value is node.inputs[1] else len(shape) - 1
            weight_shapes.append((tensor_dtype(value), len(shape), tuple(d for i, d in enumerate(shape) if i != axis)))
        return ("shared", node.op_type, _attrs_key(node), id(node.inputs[0]), tuple(weight_shapes))

    def _key(self, node: Node, index: FoldIndex[Spec]) -> Hashable | None:
        """The seed's fold settings: op, attributes, per input constness, dtype and shape;
        an element-wise op folds only as a continuation, so its key names the fold it reads."""
        if len(node.outputs) != 1 or not node.outputs[0].name:
            return None  # a folded op stands for exactly one named output per member
        position = self._activation_position(node)
        if position is None:
            return None
        inputs: list[Hashable] = [_input_key(v, self.constant) for v in node.inputs]
        source = index.slot(node.inputs[position])
        if node.op_type in SEED_OPS:
            return ("stacked", node.op_type, _attrs_key(node), tuple(inputs), source.fold if source else None)
        if source is None:
            return None
        # Slices of one fold may differ in width along its axis: the key leaves that dim out.
        activation = node.inputs[position]
        axis = index.folds[source.fold].spec.layout.axis
        shape = tensor_shape(activation) or ()
        inputs[position] = (False, tensor_dtype(activation), tuple(d for i, d in enumerate(shape) if i != axis))
        if node.op_type in ELEMENTWISE_BINARY:
            # Constants may differ in shape along the fold's axis; their rank and dtype may not.
            other = node.inputs[1 - position]
            inputs[1 - position] = ("constant", tensor_dtype(other), len(tensor_shape(other) or ()))
        elif any(v is not None and i != position and self.weight(v) is None for i, v in enumerate(node.inputs)):
            return None
        else:  # Clip's bounds, ...: must be the same constants in every member
            inputs = [inputs[i] if i == position else _array_key(self.weight(v)) for i, v in enumerate(node.inputs)]
        return ("elementwise", node.op_type, _attrs_key(node), position, tuple(inputs), source.fold)

    # -- specs -----------------------------------------------------------------------------
    def _shared(self, members: list[Node]) -> Spec | None:
        first = members[0]
        out_axis = _weight_out_axis(first)
        widths = [tensor_shape(m.inputs[1])[out_axis] for m in members]  # type: ignore[index]
        output_shapes = [tensor_shape(m.outputs[0]) for m in members]
        if not all(isinstance(w, int) for w in widths) or any(s is None for s in output_shapes):
            return None
        rank = len(output_shapes[0])  # type: ignore[arg-type]
        if first.op_type == "MatMul" and (rank < 2 or len(tensor_shape(first.inputs[1]) or ()) != 2):
            return None
        if first.op_type == "Conv" and first.attr("group", 1) != 1:
            return None
        if first.op_type == "Gemm" and not self._gemm_biases_fold(members):
            return None
        axis = rank - 1 if first.op_type == "MatMul" else 1
        layout = Layout("concat", axis, _ranges(widths), tuple(output_shapes))  # type: ignore[arg-type]
        operand = Operand("shared", 0, [m.inputs[0] for m in members])  # type: ignore[misc]
        return Spec("shared-input", operand, layout)

    def _gemm_biases_fold(self, members: list[Node]) -> bool:
        """Gemm biases concatenate when each is absent, a scalar or a row of the output's width."""
        present = {len(m.inputs) > 2 and m.inputs[2] is not None for m in members}
        if len(present) != 1:
            return False
        return not present.pop() or all(
            len(tensor_shape(m.inputs[2]) or ()) < 2 or (tensor_shape(m.inputs[2]) or (0,))[0] == 1 for m in members
        )

    def _stacked(self, members: list[Node], index: FoldIndex[Spec]) -> Spec | None:
        first = members[0]
        x_shape = tensor_shape(first.inputs[0])
        out_shape = tensor_shape(first.outputs[0])
        if x_shape is None or out_shape is None or not _float(first.outputs[0]):
            return None
        count = len(members)
        if first.op_type == "Conv":
            channels, width = x_shape[1] if len(x_shape) > 2 else None, out_shape[1]
            if (
                not isinstance(channels, int)
                or not isinstance(width, int)
                or first.attr("auto_pad", b"NOTSET")
                not in (
                    b"NOTSET",
                    "NOTSET",
                )
            ):
                return None
            layout = Layout("concat", 1, _ranges([width] * count), tuple([out_shape] * count))
            wanted = Layout("concat", 1, _ranges([channels] * count), tuple([x_shape] * count))
        else:
            if first.op_type == "Gemm" and (
                first.attr("transA", 0) or first.attr("alpha", 1.0) != 1.0 or first.attr("beta", 1.0) != 1.0
            ):
                return None
            if first.op_type == "Gemm" and not self._gemm_biases_fold(members):
                return None
            if first.op_type == "MatMul" and (len(x_shape) < 2 or len(tensor_shape(first.inputs[1]) or ()) != 2):
                return None
            depth, width = x_shape[-1], out_shape[-1]
            # The rows are the leading dims flattened: at most one of them unknown (a -1 in the Reshape).
            if (
                not isinstance(depth, int)
                or not isinstance(width, int)
                or sum(not isinstance(d, int) for d in x_shape[:-1]) > 1
            ):
                return None
            layout = Layout("rows", 1, _ranges([width] * count), tuple([out_shape] * count))
            wanted = Layout("rows", 1, _ranges([depth] * count), tuple([x_shape] * count))
        operand = self._operand(members, 0, index, wanted)
        return Spec("stacked", operand, layout)

    def _elementwise(self, members: list[Node], index: FoldIndex[Spec]) -> Spec | None:
        position = self._activation_position(members[0])
        if position is None:
            return None
        values = [m.inputs[position] for m in members]
        slots = [index.slot(v) for v in values]
        if any(s is None for s in slots):
            return None
        source = index.folds[slots[0].fold]  # type: ignore[union-attr]
        if any(tensor_shape(m.outputs[0]) != tensor_shape(v) for m, v in zip(members, values, strict=True)):
            return None  # a constant that broadcasts the output bigger does not fold
        slices = [s.slice for s in slots]  # type: ignore[union-attr]
        layout = source.spec.layout.gathered(slices, [tensor_shape(m.outputs[0]) for m in members])  # type: ignore[misc]
        if (
            members[0].op_type in ELEMENTWISE_BINARY
            and folded_constant([self.weight(m.inputs[1 - position]) for m in members], layout) is None
        ):
            return None
        operand = _through(source, values, position, slices)  # type: ignore[arg-type]
        return Spec("elementwise", operand, layout)

    def _operand(self, members: list[Node], position: int, index: FoldIndex[Spec], wanted: Layout) -> Operand:
        """Read an earlier fold whose layout is the one wanted; else pack the activations."""
        values = [m.inputs[position] for m in members]
        slots = [index.slot(v) for v in values]
        if all(s is not None for s in slots) and len({s.fold for s in slots}) == 1:  # type: ignore[union-attr]
            source = index.folds[slots[0].fold]  # type: ignore[union-attr]
            slices = [s.slice for s in slots]  # type: ignore[union-attr]
            layout = source.spec.layout.gathered(slices, wanted.member_shapes)
            if (layout.kind, layout.axis, layout.ranges) == (wanted.kind, wanted.axis, wanted.ranges):
                return _through(source, values, position, slices)  # type: ignore[arg-type]
        return Operand("pack", position, values)  # type: ignore[arg-type]


def _through(source: Fold[Spec], values: list[Value], position: int, slices: list[int]) -> Operand:
    identity = slices == list(range(len(source.members)))
    return Operand("direct" if identity else "gather", position, values, source.id, [] if identity else slices)


def _in_source_order(members: list[Node], index: FoldIndex[Spec], position: int | None) -> list[Node]:
    """Members that read slices of one fold, ordered by slice, so the fold reads it as it is."""
    if position is None:
        return members
    slots = [index.slot(m.inputs[position]) for m in members]
    if any(s is None for s in slots):
        return members
    order = sorted(range(len(members)), key=lambda i: (slots[i].slice, i))  # type: ignore[union-attr]
    return [members[i] for i in order]


def _weight_out_axis(node: Node) -> int:
    """The axis of input 1 that is the output's width."""
    if node.op_type == "Gemm":
        return 0 if node.attr("transB", 0) else 1
    if node.op_type == "Conv":
        return 0
    return 1  # MatMul with a 2-D weight


def _ranges(widths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    bounds = np.concatenate([[0], np.cumsum(widths)]).astype(int).tolist()
    return tuple(itertools.pairwise(bounds))


def _float(value: Value) -> bool:
    return tensor_dtype(value) in (DataType.FLOAT, DataType.DOUBLE, DataType.FLOAT16)


def _array_key(array: np.ndarray | None) -> Hashable | None:
    return None if array is None else (array.dtype.str, array.shape, array.tobytes())


def folded_constant(arrays: Sequence[np.ndarray | None], layout: Layout) -> np.ndarray | None:
    """The members' constants side by side along the layout's axis, shaped to broadcast
    against the folded tensor as each did against its member; None where they cannot."""
    if any(a is None for a in arrays):
        return None
    rank = len(layout.member_shapes[0])
    pieces = []
    for array, (low, high) in zip(arrays, layout.ranges, strict=True):
        if array.ndim > rank:  # type: ignore[union-attr]
            return None
        aligned = array.reshape((1,) * (rank - array.ndim) + array.shape)  # type: ignore[union-attr]
        if layout.kind == "rows":
            if any(d != 1 for d in aligned.shape[:-1]) or aligned.shape[-1] not in (1, high - low):
                return None
            pieces.append(np.broadcast_to(aligned.reshape(-1), (high - low,)))
            continue
        if aligned.shape[layout.axis] not in (1, high - low):
            return None
        target = list(aligned.shape)
        target[layout.axis] = high - low
        pieces.append(np.broadcast_to(aligned, target))
    if layout.kind == "rows":
        return np.concatenate(pieces).reshape(1, -1, 1, 1)
    if len({tuple(d for i, d in enumerate(p.shape) if i != layout.axis) for p in pieces}) != 1:
        return None
    return np.concatenate(pieces, axis=layout.axis)
