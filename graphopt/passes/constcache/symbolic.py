"""Symbolic shape folding: shape plumbing evaluated over dims (the facts service's ``sym``).

Exporters compute targets at run time (``Shape -> Gather -> Unsqueeze -> Concat ->
Reshape``). With the plumbing's values known as dims:

- a target that reads back dims of the reshaped input becomes a constant: an entry equal
  to the input's dim at the same position is ``0`` (copy it), the one other dynamic entry
  is ``-1``; an Expand entry equal to the input's aligned dim is ``1``;
- a plumbing value whose entries are all static ints becomes a constant;
- a plumbing value whose entries are dims of a graph input (and numbers) is computed
  straight from it (``Shape(input, start, end)``, or ``Gather(Shape(input), indices)``,
  concatenated with the numbers), so every chain that measured an intermediate tensor dies
  and the dims keep their names in the file.

Only values some reader needs as they are (the frontier of the plumbing) are rewritten,
so a chain is replaced once, at its end, and dead code removal takes the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import numpy as np

from graphopt.facts import Facts
from graphopt.ir import DataType, Dim, Graph, Model, Node, TensorType, Value, tensor_shape
from graphopt.ir.constness import is_constant
from graphopt.ir.rewrite import Builder, Namer, replace_value
from graphopt.ir.types import INTEGER_TYPES
from graphopt.passes.constcache.constants import replace_by_constant

__all__ = ["fold_symbolic"]

_PLUMBING_TYPES = INTEGER_TYPES | {DataType.BOOL}


def fold_symbolic(model: Model, facts: Facts, make: MakeBuilder) -> Counter[str]:
    """Run the rewrites of the module docstring on the main graph and its bodies.

    Everything is read from the facts before the first mutation (a mutation drops the facts'
    memo), so the rewrite stays linear in the size of the plumbing.
    """
    done: Counter[str] = Counter()
    graphs = [model.graph, *model.graph.subgraphs()]
    targets = [
        (node, found, _copies_despite_allowzero(node, facts))
        for graph in graphs
        for node in graph.topological()
        if node.in_standard_domain
        and node.op_type in _TARGETS
        and len(node.inputs) > 1
        and not is_constant(node.inputs[1])
        and (found := _TARGETS[node.op_type](node, facts)) is not None
    ]
    static, dynamic = _plumbing(graphs, facts)
    for node, target, copies_despite_allowzero in targets:
        graph = node.graph
        assert graph is not None
        node.set_input(1, make(graph, None).constant(np.asarray(target, dtype=np.int64), "target"))
        if copies_despite_allowzero and 0 in target:
            del node.attributes["allowzero"]
        done[f"{node.op_type.lower()}_targets"] += 1
    for value, values in static.items():
        if _frontier(value, static):
            kind = value.type
            assert isinstance(kind, TensorType) and value.graph is not None
            array = np.asarray(values, dtype=kind.dtype.numpy()).reshape(() if kind.rank == 0 else (-1,))
            replace_by_constant(value, array, make.names)
            done["static_values"] += 1
    roots = _roots(model)
    plumbing = static.keys() | dynamic.keys()
    for value, entries in dynamic.items():
        if _frontier(value, plumbing) and not _is_measure(value, roots):
            measured = _measure(value, entries, roots, model, make)
            if measured is not None:
                replace_value(value, measured, make.names)
                done["dims_from_inputs"] += 1
    return done


class MakeBuilder(Protocol):
    """``make(graph, before)``: a builder that types what it creates (the pass context's)."""

    names: Namer

    def __call__(self, graph: Graph, before: Node | None) -> Builder: ...


# -- targets -----------------------------------------------------------------------------


def reshape_target(node: Node, facts: Facts) -> list[int] | None:
    """Reshape(x: [b, s, 256], (b, s, 4, 64)) -> [0, 0, 4, 64]; None if not provably the same."""
    target = facts.sym(node.inputs[1]) if node.inputs[1] is not None else None
    shape = tensor_shape(node.inputs[0])
    if target is None or shape is None or any(d is None for d in target):
        return None
    allowzero = bool(node.attr("allowzero", 0))
    copies = not allowzero or _copies_despite_allowzero(node, facts)
    found: list[int] = []
    for index, want in enumerate(target):
        if isinstance(want, int):
            found.append(want)
        elif copies and index < len(shape) and shape[index] == want:
            found.append(0)
        elif allowzero and 0 in target:
            return None  # a static 0 stays a zero-sized dim, and a -1 beside it is invalid with allowzero
        else:
            found.append(-1)
    return found if found.count(-1) <= 1 else None


def _copies_despite_allowzero(node: Node, facts: Facts) -> bool:
    """Whether a Reshape with ``allowzero`` (the dynamo exporter writes it on every Reshape) may copy dims with 0
    once the attribute is cleared: where no entry of its target is a static 0, clearing it changes nothing."""
    if node.op_type != "Reshape" or not node.attr("allowzero", 0) or node.inputs[1] is None:
        return False
    if _float32_projection(node.inputs[0]):
        # A 0 would copy a dim of the projection's output: matmul-add-gemm-projection-reshaped makes it a Gemm
        # over rows only where the Reshape reading it copies none (clip_text_dynamo: 12 Gemms, 4 nodes fewer).
        return False
    target = facts.sym(node.inputs[1])
    return target is not None and 0 not in [d for d in target if isinstance(d, int)]


def _float32_projection(value: Value | None) -> bool:
    """``MatMul(x, W) + b`` on float32 with a constant 2-D ``W``: what the late Gemm projection rules rewrite."""
    if value is None or not isinstance(value.type, TensorType) or value.type.dtype != DataType.FLOAT:
        return False
    add = value.producer
    if add is None or add.op_type != "Add":
        return False
    for operand in add.inputs:
        matmul = operand.producer if operand is not None else None
        if matmul is not None and matmul.op_type == "MatMul" and len(matmul.inputs) == 2:
            weight = matmul.inputs[1]
            if weight is not None and is_constant(weight) and len(tensor_shape(weight) or ()) == 2:
                return True
    return False


def expand_target(node: Node, facts: Facts) -> list[int] | None:
    """Expand(x: [b, 1, 256], (b, 4, 256)) -> [1, 4, 1]; None if an entry is a dim x lacks."""
    target = facts.sym(node.inputs[1]) if node.inputs[1] is not None else None
    shape = tensor_shape(node.inputs[0])
    if target is None or shape is None:
        return None
    found: list[int] = []
    offset = len(target) - len(shape)
    for index, want in enumerate(target):
        aligned = shape[index - offset] if index >= offset else None
        if isinstance(want, int):
            found.append(want)
        elif want is not None and aligned == want:
            found.append(1)
        else:
            return None
    return found


_TARGETS = {"Reshape": reshape_target, "Expand": expand_target}


# -- plumbing values ---------------------------------------------------------------------


def _plumbing(
    graphs: Sequence[Graph], facts: Facts
) -> tuple[dict[Value, tuple[int, ...]], dict[Value, tuple[Dim, ...]]]:
    """Node outputs that are small int vectors known entry by entry: all static ints, or not."""
    static: dict[Value, tuple[int, ...]] = {}
    dynamic: dict[Value, tuple[Dim, ...]] = {}
    for graph in graphs:
        for node in graph.topological():
            if node.op_type == "Constant" or not node.in_standard_domain:
                continue
            for value in node.outputs:
                kind = value.type
                if not (isinstance(kind, TensorType) and kind.dtype in _PLUMBING_TYPES and kind.rank in (0, 1)):
                    continue
                entries = facts.sym(value)
                if entries is None or any(d is None for d in entries):
                    continue
                if all(isinstance(d, int) for d in entries):
                    static[value] = tuple(int(d) for d in entries if isinstance(d, int))
                else:
                    dynamic[value] = entries
    return static, dynamic


def _frontier(value: Value, absorbed: Collection[Value]) -> bool:
    """Whether some reader needs ``value`` itself: a graph output, or a reader whose outputs
    are not all rewritten too."""
    if value.is_graph_output:
        return True
    return any(not all(v in absorbed for v in use.node.outputs) for use in value.uses())


def _roots(model: Model) -> list[Value]:
    """Where dims are measured: the main graph's inputs that the caller feeds."""
    return [v for v in model.graph.inputs if v.const is None and isinstance(v.type, TensorType)]


def _is_measure(value: Value, roots: Sequence[Value]) -> bool:
    """Already the canonical form: ``Shape(root)``, ``Gather(Shape(root), constant)``, or a
    Concat of those and constants; or a Squeeze of ``Shape(root)`` (with or without bounds): the
    dynamo exporter reads one dim as ``Squeeze(Shape(root, start=i, end=i + 1))``, its slice
    shared with other readers."""
    node = value.producer
    if node is not None and node.op_type == "Concat":
        return all(v is not None and (is_constant(v) or _is_measure(v, roots)) for v in node.inputs)
    if node is not None and node.op_type == "Gather" and is_constant(node.inputs[1]):
        node = node.inputs[0].producer if node.inputs[0] is not None else None
    elif node is not None and node.op_type == "Squeeze" and node.inputs[0] is not None:
        node = node.inputs[0].producer
    return node is not None and node.op_type == "Shape" and any(node.inputs[0] is r for r in roots)


def _measure(
    value: Value, entries: tuple[Dim, ...], roots: Sequence[Value], model: Model, make: MakeBuilder
) -> Value | None:
    """A value computing ``entries`` (dims of one root, and numbers) from that root's shape,
    inserted before ``value``'s producer: ``(batch, seq, 768)`` is ``Concat(Shape(ids), [768])``."""
    producer = value.producer
    kind = value.type
    if producer is None or producer.graph is None or not isinstance(kind, TensorType) or kind.dtype != DataType.INT64:
        return None
    if producer.op_type == "Shape" and len(_runs(entries)) > 1:
        return None  # one node already; numbers and dims take a Concat and more
    for root in roots:
        shape = tensor_shape(root) or ()
        if not all(isinstance(d, int) or d in shape for d in entries):
            continue
        graph = producer.graph
        b = make(graph, producer)
        if kind.rank == 0:
            found = b.op("Gather", b.op("Shape", root), b.constant(np.asarray(shape.index(entries[0])), "dims"), axis=0)
        else:
            parts = [_measured_run(b, root, run, model.opset_in(graph)) for run in _runs(entries)]
            found = parts[0] if len(parts) == 1 else b.op("Concat", *parts, axis=0)
        found.type = kind
        return found
    return None


def _runs(entries: tuple[Dim, ...]) -> list[tuple[Dim, ...]]:
    """``entries`` cut where they change between numbers and dims: (b, s, 12) -> (b, s), (12,)."""
    runs: list[list[Dim]] = []
    for entry in entries:
        if runs and isinstance(runs[-1][0], int) == isinstance(entry, int):
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return [tuple(run) for run in runs]


def _measured_run(b: Builder, root: Value, run: tuple[Dim, ...], opset: int) -> Value:
    """A 1-D value of ``run``: a constant for numbers, a slice or a Gather of ``Shape(root)`` for dims."""
    if all(isinstance(d, int) for d in run):
        return b.constant(np.asarray(run, dtype=np.int64), "dims")
    shape = tensor_shape(root) or ()
    indices = [shape.index(d) for d in run]
    if indices == list(range(indices[0], indices[0] + len(indices))) and opset >= 15:
        start, end = indices[0], indices[0] + len(indices)
        bounds: dict[str, Any] = {"start": start} if start else {}
        if end < len(shape):
            bounds["end"] = end
        return b.op("Shape", root, **bounds)
    return b.op("Gather", b.op("Shape", root), b.constant(np.asarray(indices, dtype=np.int64), "dims"), axis=0)
