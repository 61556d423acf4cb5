"""Common subexpression elimination: compute each distinct thing once.

Two nodes compute the same values when they apply the same operator (domain, op type,
overload) with equal attributes to the very same input values (in either order for a
binary commutative operator) and ask for the same outputs. Visiting a graph in
topological order and keying each node by exactly that merges whole duplicate chains
in one pass: once the first pair is merged, their consumers read identical inputs and
match in turn.

Equal attributes means equal by value: floats compare by their bits (so ``-0.0`` and
``0.0`` differ and a NaN matches itself), tensors by element type, shape and a digest of
their bytes. Nodes that own a subgraph are never merged (bodies are not compared), nor
are non-deterministic operators (two RandomNormal draws are two different samples) or
calls to local functions that use one.

Constants are merged the same way across their two spellings: initializers and
``Constant`` nodes with equal element type, shape and bytes become one value. Tensors
are grouped by type and shape first, then by a digest of three small slices, so a large
tensor is hashed whole only when another one agrees with it on all of that. An
initializer that is also a graph input can be fed by the caller and is never merged;
when both duplicates are graph outputs both stay.
"""

from __future__ import annotations

import struct
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable
from typing import Any

from graphopt.ir import Attr, AttrKind, Graph, Model, Node, SparseTensor, Tensor, Value
from graphopt.ir.constness import RANDOM_OPS, constant_node_tensor, constant_tensor
from graphopt.ir.rewrite import Namer, can_take_over, replace_value
from graphopt.passes.base import Pass, PassContext, PassResult, register

__all__ = ["CommonSubexpressionElimination", "attribute_key"]

# Two Dropouts in training mode draw two masks; merging them is never worth proving it safe.
NONDETERMINISTIC_OPS = RANDOM_OPS | {"Dropout"}

# Binary operators whose operands may swap: the results are bit for bit the same (IEEE
# addition and multiplication commute). Max and Min are left out: implementations differ
# in which operand wins when one is NaN. Variadic Sum and Mean commute only with two
# operands; with more, a different order rounds differently.
COMMUTATIVE_OPS = frozenset(
    {"Add", "Mul", "Sum", "Mean", "And", "Or", "Xor", "Equal", "BitwiseAnd", "BitwiseOr", "BitwiseXor"}
)

FunctionKey = tuple[str, str, str]


@register
class CommonSubexpressionElimination(Pass, name="cse"):
    """Merge nodes and constants that compute the same values"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        random_functions = _nondeterministic_functions(model)
        names = ctx.names(model)
        nodes: Counter[str] = Counter()
        constants = 0
        for graph in list(model.all_graphs()):
            constants += _merge_constants(graph, nodes, names)
            _merge_nodes(graph, random_functions, nodes, names)
        details = {"nodes": dict(sorted(nodes.items())), "constants": constants}
        return PassResult(bool(nodes or constants), details)


# -- constants ----------------------------------------------------------------------------


def _merge_constants(graph: Graph, merged_nodes: Counter[str], names: Namer) -> int:
    """Merge equal initializers and Constant tensors of ``graph``; return how many went."""
    candidates: dict[tuple[Any, ...], list[tuple[Value, Tensor]]] = defaultdict(list)
    for value in graph.initializers.values():
        tensor = constant_tensor(value)
        if tensor is not None:
            candidates[(tensor.dtype, tensor.shape)].append((value, tensor))
    for node in graph.topological():
        tensor = constant_node_tensor(node) if node.op_type == "Constant" and node.in_standard_domain else None
        if tensor is not None:
            candidates[(tensor.dtype, tensor.shape)].append((node.outputs[0], tensor))
    merged = 0
    for group in candidates.values():
        # A probe of a few slices tells most same-shaped weights apart without reading them
        # whole; only tensors the probe cannot separate are hashed in full.
        for probed in _split(group, lambda tensor: tensor.digest(probe=True)):
            for (kept, _), *duplicates in _split(probed, Tensor.digest):
                for value, _ in duplicates:
                    if not can_take_over(value, kept):
                        continue
                    replace_value(value, kept, names)
                    producer = value.producer
                    if producer is None:
                        graph.remove_initializer(value)
                    else:
                        graph.remove(producer)
                        merged_nodes[producer.op_type] += 1
                    merged += 1
    return merged


def _split(
    group: list[tuple[Value, Tensor]], key: Callable[[Tensor], bytes | None]
) -> list[list[tuple[Value, Tensor]]]:
    """The sublists (two or more long, first-seen order kept) of tensors with equal keys."""
    buckets: dict[bytes, list[tuple[Value, Tensor]]] = defaultdict(list)
    if len(group) > 1:
        for item in group:
            found = key(item[1])
            if found is not None:
                buckets[found].append(item)
    return [bucket for bucket in buckets.values() if len(bucket) > 1]


# -- nodes --------------------------------------------------------------------------------


def _merge_nodes(graph: Graph, random_functions: set[FunctionKey], merged: Counter[str], names: Namer) -> None:
    seen: dict[Hashable, Node] = {}
    for node in graph.topological():
        key = _node_key(node, random_functions)
        if key is None:
            continue
        kept = seen.setdefault(key, node)
        if kept is node:
            continue
        pairs = list(zip(node.outputs, kept.outputs, strict=True))
        if not all(can_take_over(old, new) for old, new in pairs):
            continue
        for old, new in pairs:
            replace_value(old, new, names)
        graph.remove(node)
        merged[node.op_type] += 1


def _node_key(node: Node, random_functions: set[FunctionKey]) -> Hashable | None:
    """What makes two nodes compute the same values, or None if ``node`` must stay apart."""
    if not node.outputs or _is_nondeterministic(node, random_functions):
        return None
    attributes = []
    for name in sorted(node.attributes):
        attr = node.attributes[name]
        value = ("ref", attr.ref_attr_name) if attr.ref_attr_name else attribute_key(attr)
        if value is None:
            return None
        attributes.append((name, int(attr.kind), value))
    inputs = node.inputs
    if node.in_standard_domain and node.op_type in COMMUTATIVE_OPS and len(inputs) == 2:
        inputs = tuple(sorted(inputs, key=id))
    # Which outputs are asked for (an empty name leaves one out), not only how many.
    produced = tuple(bool(v.name) for v in node.outputs)
    return (node.domain, node.op_type, node.overload, inputs, produced, tuple(attributes))


def attribute_key(attr: Attr) -> Hashable | None:
    """What makes two attribute values equal (None for a body, which this does not compare)."""
    kind, value = attr.kind, attr.value
    if kind == AttrKind.FLOAT:
        return _float_bits(value)
    if kind == AttrKind.FLOATS:
        return tuple(_float_bits(v) for v in value)
    if kind in (AttrKind.INT, AttrKind.STRING):
        return value
    if kind in (AttrKind.INTS, AttrKind.STRINGS, AttrKind.TYPE_PROTOS):
        return tuple(value)
    if kind == AttrKind.TYPE_PROTO:
        return value
    if kind == AttrKind.TENSOR:
        return value.digest()
    if kind == AttrKind.TENSORS:
        return _all_or_none([t.digest() for t in value])
    if kind == AttrKind.SPARSE_TENSOR:
        return _sparse_key(value)
    if kind == AttrKind.SPARSE_TENSORS:
        return _all_or_none([_sparse_key(t) for t in value])
    return None  # bodies are never compared, so a node that owns one is never merged


def _float_bits(value: float) -> bytes:
    return struct.pack("<d", value)


def _sparse_key(tensor: SparseTensor) -> Hashable | None:
    values, indices = tensor.values.digest(), tensor.indices.digest()
    return None if values is None or indices is None else (values, indices, tensor.dims)


def _all_or_none(keys: list[Hashable | None]) -> tuple[Hashable, ...] | None:
    return None if any(k is None for k in keys) else tuple(keys)


def _is_nondeterministic(node: Node, random_functions: set[FunctionKey]) -> bool:
    if node.in_standard_domain and node.op_type in NONDETERMINISTIC_OPS:
        return True
    return (node.domain, node.op_type, node.overload) in random_functions


def _nondeterministic_functions(model: Model) -> set[FunctionKey]:
    """Local functions that draw random numbers, directly or through other functions."""
    found: set[FunctionKey] = set()
    grew = True
    while grew:
        grew = False
        for function in model.functions:
            if function.key not in found and any(_is_nondeterministic(n, found) for n in function.body.all_nodes()):
                found.add(function.key)
                grew = True
    return found
