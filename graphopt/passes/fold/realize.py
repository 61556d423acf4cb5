"""Realize planned folds as ONNX: one op per fold, slices only where a reader needs one.

Weights are only concatenated or stacked (numpy on the constants); nothing else about them
is computed. A fold's output tensor stays folded for the folds of the next level that read
it (``direct`` or through one Gather); a member's own output is cut out of it (one Split
per fold, after a Squeeze and a Transpose for the ``rows`` layout) only when a node
outside the chain, or the graph's interface, reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from graphopt.ir import DataType, Graph, Model, Node, Value, tensor_shape
from graphopt.ir.ops import ELEMENTWISE_BINARY
from graphopt.ir.rewrite import Builder, replace_value
from graphopt.passes.base import PassContext
from graphopt.passes.fold.index import Fold, FoldIndex
from graphopt.passes.fold.plan import Layout, Spec, folded_constant

__all__ = ["Realizer", "remove_folded"]

Weight = Callable[[Value | None], np.ndarray | None]

# Folded weights smaller than this are stored as they are (a Cast node would cost more).
_NARROW_FROM_BYTES = 1 << 16


class Realizer:
    """Builds each fold's op before its last member, and the slices its readers need."""

    def __init__(
        self, model: Model, graph: Graph, ctx: PassContext, index: FoldIndex[Spec], weight: Weight, tag: str
    ) -> None:
        order = {id(n): i for i, n in enumerate(graph.topological())}
        last = {fold.id: max(fold.members, key=lambda n: order[id(n)]) for fold in index.folds}
        self.builders = {fold.id: ctx.builder(model, graph, before=last[fold.id], tag=tag) for fold in index.folds}
        self.names = ctx.names(model)
        self.index, self.weight = index, weight
        # From opset 13 Split, Squeeze and Unsqueeze read their int lists as inputs.
        self.lists_as_inputs = model.opset_in(graph) >= 13
        self.tensors: dict[int, Value] = {}

    # -- the folded op ---------------------------------------------------------------------
    def realize(self, fold: Fold[Spec]) -> Value:
        b = self.builders[fold.id]
        x = self._operand(b, fold)
        first = fold.members[0]
        how, op = fold.spec.how, first.op_type
        if how == "elementwise":
            tensor = self._elementwise(b, fold, x)
        elif how == "shared-input":
            tensor = self._shared(b, fold, x)
        elif op == "Conv":
            tensor = b.op("Conv", x, *self._conv_weights(b, fold), **_attributes(first, group=self._groups(fold)))
        else:
            tensor = b.op("Conv", x, *self._rows_weights(b, fold), kernel_shape=[1, 1], group=len(fold.members))
        self.tensors[fold.id] = tensor
        return tensor

    def _operand(self, b: Builder, fold: Fold[Spec]) -> Value:
        operand = fold.spec.operand
        if operand.how == "shared":
            return operand.values[0]
        if operand.source is not None:
            tensor = self.tensors[operand.source]
            if operand.how == "direct":
                return tensor
            layout = self.index.folds[operand.source].spec.layout
            indices = b.constant(np.asarray(layout.channels(operand.slices), dtype=np.int64), "fold_gather")
            return b.op("Gather", tensor, indices, axis=layout.axis)
        if fold.spec.layout.kind == "concat":
            return b.op("Concat", *operand.values, axis=1)
        rows = [self._to_rows(b, value) for value in operand.values]
        packed = b.op("Concat", *rows, axis=1) if len(rows) > 1 else rows[0]
        transposed = b.op("Transpose", packed, perm=[1, 0])
        return b.listed("Unsqueeze", transposed, "axes", [0, 3], as_input=self.lists_as_inputs).outputs[0]

    def _to_rows(self, b: Builder, value: Value) -> Value:
        shape = tensor_shape(value)
        if shape is not None and len(shape) == 2:
            return value
        depth = shape[-1] if shape else -1
        return b.op("Reshape", value, b.constant(np.asarray([-1, depth], dtype=np.int64), "fold_rows"))

    def _shared(self, b: Builder, fold: Fold[Spec], x: Value) -> Value:
        first = fold.members[0]
        weights = [self._array(m.inputs[1]) for m in fold.members]
        if first.op_type == "MatMul":
            return b.op("MatMul", x, self._stored(b, np.concatenate(weights, axis=1)))
        if first.op_type == "Conv":
            return b.op("Conv", x, *self._conv_weights(b, fold), **_attributes(first))
        axis = 0 if first.attr("transB", 0) else 1
        inputs = [x, self._stored(b, np.concatenate(weights, axis=axis))]
        if len(first.inputs) > 2 and first.inputs[2] is not None:
            inputs.append(b.constant(self._row_biases(fold), "fold_bias"))
        return b.op("Gemm", *inputs, **_attributes(first))

    def _row_biases(self, fold: Fold[Spec]) -> np.ndarray:
        """Each member's bias as a row of its output width, side by side."""
        ranges = fold.spec.layout.ranges
        return np.concatenate(
            [
                np.broadcast_to(self._array(m.inputs[2]).reshape(-1), (high - low,))
                for m, (low, high) in zip(fold.members, ranges, strict=True)
            ]
        )

    def _conv_weights(self, b: Builder, fold: Fold[Spec]) -> list[Value]:
        members = fold.members
        weights = [self._stored(b, np.concatenate([self._array(m.inputs[1]) for m in members]))]
        if len(members[0].inputs) > 2 and members[0].inputs[2] is not None:
            weights.append(b.constant(np.concatenate([self._array(m.inputs[2]) for m in members]), "fold_bias"))
        return weights

    def _groups(self, fold: Fold[Spec]) -> int:
        return int(fold.members[0].attr("group", 1)) * len(fold.members)

    def _rows_weights(self, b: Builder, fold: Fold[Spec]) -> list[Value]:
        """MatMul / Gemm weights as the kernels of a grouped 1x1 Conv: [F*width, depth, 1, 1]."""
        kernels = []
        for member in fold.members:
            weight = self._array(member.inputs[1])
            kernels.append(weight if member.op_type == "Gemm" and member.attr("transB", 0) else weight.T)
        found = [self._stored(b, np.concatenate(kernels)[:, :, None, None])]
        first = fold.members[0]
        if first.op_type == "Gemm" and len(first.inputs) > 2 and first.inputs[2] is not None:
            found.append(b.constant(self._row_biases(fold), "fold_bias"))
        return found

    def _elementwise(self, b: Builder, fold: Fold[Spec], x: Value) -> Value:
        first = fold.members[0]
        position = fold.spec.operand.position
        inputs: list[Value | None] = list(first.inputs)
        inputs[position] = x
        if first.op_type in ELEMENTWISE_BINARY:
            constant = folded_constant([self.weight(m.inputs[1 - position]) for m in fold.members], fold.spec.layout)
            if constant is None:
                raise ValueError(f"fold {fold.id}: the constants no longer fold")
            inputs[1 - position] = b.constant(
                constant.astype(self._array(first.inputs[1 - position]).dtype), "fold_const"
            )
        return b.op(first.op_type, *inputs, **_attributes(first))

    def _stored(self, b: Builder, weight: np.ndarray) -> Value:
        """A folded weight, stored as float16 and Cast back when float16 holds it exactly: the
        members' weights were float16 Cast up (bert_fp16_weights), and storing their float32
        concatenation would grow the file (11.0 -> 12.5 MB) past const-cache's size guards."""
        if weight.dtype in (np.float32, np.float64) and weight.nbytes >= _NARROW_FROM_BYTES:
            narrow = weight.astype(np.float16)
            if np.array_equal(narrow.astype(weight.dtype), weight):
                return b.op("Cast", b.constant(narrow, "fold_weight"), to=int(DataType.from_numpy(weight.dtype)))
        return b.constant(weight, "fold_weight")

    def _array(self, value: Value | None) -> np.ndarray:
        array = self.weight(value)
        if array is None:
            raise ValueError(f"the constant {value.name if value else None!r} cannot be read")
        return array

    # -- slices for the readers outside the chain ------------------------------------------
    def materialize(self, fold: Fold[Spec]) -> None:
        """Give every reader of a member's output (outside the chain) its slice of the fold."""
        b = self.builders[fold.id]
        layout = fold.spec.layout
        tensor = self.tensors[fold.id]
        if layout.kind == "rows":
            squeezed = b.listed("Squeeze", tensor, "axes", [0, 3], as_input=self.lists_as_inputs).outputs[0]
            tensor = b.op("Transpose", squeezed, perm=[1, 0])
        pieces = self._split(b, tensor, layout)
        for member, piece, shape in zip(fold.members, pieces, layout.member_shapes, strict=True):
            if layout.kind == "rows" and len(shape) != 2:
                target = [d if isinstance(d, int) else -1 for d in shape]
                piece = b.op("Reshape", piece, b.constant(np.asarray(target, dtype=np.int64), "fold_shape"))
            replace_value(member.outputs[0], piece, self.names)

    def _split(self, b: Builder, tensor: Value, layout: Layout) -> Sequence[Value]:
        axis = layout.axis if layout.kind == "concat" else 1
        sizes = [high - low for low, high in layout.ranges]
        split = b.listed("Split", tensor, "split", sizes, as_input=self.lists_as_inputs, axis=axis, outputs=len(sizes))
        return split.outputs


def _attributes(node: Node, **changed: Any) -> dict[str, Any]:
    """``node``'s attributes (the ops folded here have none named like a builder keyword)."""
    return {**node.attributes, **changed}


def remove_folded(graph: Graph, members: list[Node], constant: Callable[[Value | None], bool]) -> None:
    """Remove the folded nodes, then the constants (and constant producers) only they read."""
    readers = [v for m in members for v in m.inputs if v is not None]
    graph.remove(members)
    pending = list(readers)
    while pending:
        value = pending.pop()
        if value.is_used() or not constant(value):
            continue
        if value.producer is None:
            if value.name in graph.initializers and graph.initializers[value.name] is value:
                graph.remove_initializer(value)
            continue
        producer = value.producer
        if producer.graph is graph and not any(o.is_used() for o in producer.outputs):
            pending.extend(v for v in producer.inputs if v is not None)
            graph.remove(producer)
