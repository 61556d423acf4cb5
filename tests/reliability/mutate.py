"""Mutations of valid ONNX models that a loader may still accept, for fuzzing the passes.

Each mutation edits a ModelProto in place and returns a short description of what it did,
or None when the model offers nothing to mutate that way. The edits are the mistakes
exporters and hand-edited files make: inputs dropped, swapped or rewired, attributes
dropped, retyped or out of range, declared types that disagree with the graph, symbolic
and unknown dims, wrong arity, empty tensors, Constants spelled every way, opsets moved,
nodes moved into If and Loop bodies. Whatever the loader accepts, every pass must
handle: skip the node it cannot reason about, never raise.

``mutants(model, seed, count)`` yields (description, mutant) pairs, each mutant one to
three mutations away from ``model``; the same seed gives the same mutants.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

__all__ = ["MUTATIONS", "mutants"]

Mutation = Callable[[onnx.ModelProto, random.Random], str | None]
NodeMutation = Callable[[ModelProto, GraphProto, NodeProto, random.Random], str | None]

_DTYPES = [TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.INT32,
           TensorProto.STRING, TensorProto.DOUBLE, TensorProto.UINT8]  # fmt: skip
_ODD_INTS = [-100, -3, -1, 0, 1, 2, 7, 100, 2**40]
_AXIS_ATTRS = ("axis", "axes", "perm", "split", "kernel_shape", "pads", "strides", "starts", "ends", "shape")


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for body in attr.graphs:
                yield from _graphs(body)


def _nodes(model: onnx.ModelProto) -> list[tuple[onnx.GraphProto, onnx.NodeProto]]:
    return [(g, n) for g in _graphs(model.graph) for n in g.node]


def _pick_node(
    model: onnx.ModelProto, rng: random.Random, want: Callable[[onnx.NodeProto], bool] = lambda n: True
) -> tuple[onnx.GraphProto, onnx.NodeProto] | None:
    found = [(g, n) for g, n in _nodes(model) if want(n)]
    return rng.choice(found) if found else None


def _at_a_node(want: Callable[[NodeProto], bool] = lambda n: True) -> Callable[[NodeMutation], Mutation]:
    """A mutation of one node, picked at random among those ``want`` accepts (none: no mutant)."""

    def wrap(mutate: NodeMutation) -> Mutation:
        @functools.wraps(mutate)
        def mutation(model: onnx.ModelProto, rng: random.Random) -> str | None:
            picked = _pick_node(model, rng, want)
            return None if picked is None else mutate(model, *picked, rng)

        return mutation

    return wrap


def _visible(model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto) -> list[str]:
    """Names ``node`` may read without a cycle: the outer graphs' inputs and initializers,
    its own graph's, and outputs of the nodes before it."""
    names = [v.name for g in _graphs(model.graph) if g is model.graph or g is graph for v in g.input]
    names += [t.name for t in model.graph.initializer] + [t.name for t in graph.initializer]
    for other in graph.node:
        if other is node:
            break
        names += [o for o in other.output if o]
    return names


def _fresh(model: onnx.ModelProto, stem: str) -> str:
    taken = {n for _, node in _nodes(model) for n in [*node.output, *node.input]}
    taken |= {v.name for g in _graphs(model.graph) for v in [*g.input, *g.output, *g.initializer]}
    index = 0
    while f"{stem}{index}" in taken:
        index += 1
    return f"{stem}{index}"


# -- node inputs and outputs -----------------------------------------------------------


@_at_a_node(lambda n: len(n.input) > 0)
def drop_input(model: ModelProto, graph: GraphProto, node: NodeProto, rng: random.Random) -> str | None:
    index = rng.randrange(len(node.input))
    del node.input[index]
    return f"drop input {index} of {node.op_type} {node.name!r}"


@_at_a_node(lambda n: len(n.input) > 0)
def blank_input(model: ModelProto, graph: GraphProto, node: NodeProto, rng: random.Random) -> str | None:
    index = rng.randrange(len(node.input))
    node.input[index] = ""
    return f"blank input {index} of {node.op_type} {node.name!r}"


@_at_a_node(lambda n: len(n.input) > 1)
def swap_inputs(model: ModelProto, graph: GraphProto, node: NodeProto, rng: random.Random) -> str | None:
    i, j = rng.sample(range(len(node.input)), 2)
    node.input[i], node.input[j] = node.input[j], node.input[i]
    return f"swap inputs {i},{j} of {node.op_type} {node.name!r}"


@_at_a_node(lambda n: len(n.input) > 0)
def rewire_input(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    choices = _visible(model, graph, node)
    if not choices:
        return None
    index = rng.randrange(len(node.input))
    node.input[index] = rng.choice(choices)
    return f"rewire input {index} of {node.op_type} {node.name!r} to {node.input[index]!r}"


@_at_a_node()
def extra_input(model: ModelProto, graph: GraphProto, node: NodeProto, rng: random.Random) -> str | None:
    choices = _visible(model, graph, node)
    if not choices:
        return None
    for _ in range(rng.choice([1, 1, 3])):
        node.input.append(rng.choice(choices))
    return f"extra inputs on {node.op_type} {node.name!r}"


@_at_a_node()
def extra_output(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    node.output.append(_fresh(model, "extra_out"))
    return f"extra output on {node.op_type} {node.name!r}"


@_at_a_node(lambda n: len(n.output) > 0)
def drop_output(model: ModelProto, graph: GraphProto, node: NodeProto, rng: random.Random) -> str | None:
    if rng.random() < 0.5:
        node.output[len(node.output) - 1] = ""
        return f"blank last output of {node.op_type} {node.name!r}"
    del node.output[len(node.output) - 1]
    return f"drop last output of {node.op_type} {node.name!r}"


@_at_a_node()
def duplicate_node(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = _fresh(model, "dup")
    del copy.output[:]
    copy.output.extend(_fresh(model, f"dup_out{i}_") for i in range(len(node.output)))
    index = list(graph.node).index(node)
    graph.node.insert(index + 1, copy)
    return f"duplicate {node.op_type} {node.name!r}"


# -- attributes -----------------------------------------------------------------------


@_at_a_node(lambda n: len(n.attribute) > 0)
def drop_attribute(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    index = rng.randrange(len(node.attribute))
    name = node.attribute[index].name
    del node.attribute[index]
    return f"drop attribute {name} of {node.op_type} {node.name!r}"


def _odd_value(attr: onnx.AttributeProto, rng: random.Random) -> None:
    if attr.type == AttributeProto.INT:
        attr.i = rng.choice(_ODD_INTS)
    elif attr.type == AttributeProto.INTS:
        values = list(attr.ints)
        choice = rng.randrange(5)
        if choice == 0:
            values = []
        elif choice == 1:
            values.append(rng.choice(_ODD_INTS))
        elif choice == 2:
            values = values[:-1]
        elif choice == 3:
            values = [rng.choice(_ODD_INTS) for _ in values]
        else:
            values = values[::-1] + values
        del attr.ints[:]
        attr.ints.extend(values)
    elif attr.type == AttributeProto.FLOAT:
        attr.f = rng.choice([float("nan"), float("inf"), 0.0, -1.0, 1e30])
    elif attr.type == AttributeProto.FLOATS:
        del attr.floats[:]
        attr.floats.extend(rng.choice([[], [float("nan")], [0.0, 0.0, 0.0]]))
    elif attr.type == AttributeProto.STRING:
        attr.s = rng.choice([b"", b"bogus", b"SAME_UPPER", b"VALID", b"ij,jk", b"->"])
    elif attr.type == AttributeProto.TENSOR:
        array = rng.choice([np.zeros((0,), np.float32), np.array(3, np.int64), np.zeros((2, 0), np.int32)])
        attr.t.CopyFrom(numpy_helper.from_array(array, attr.t.name))


@_at_a_node(lambda n: any(a.type != AttributeProto.GRAPH for a in n.attribute))
def alter_attribute(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    attr = rng.choice([a for a in node.attribute if a.type != AttributeProto.GRAPH])
    _odd_value(attr, rng)
    return f"alter attribute {attr.name} of {node.op_type} {node.name!r}"


@_at_a_node(lambda n: any(a.type != AttributeProto.GRAPH for a in n.attribute))
def retype_attribute(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    attr = rng.choice([a for a in node.attribute if a.type != AttributeProto.GRAPH])
    name = attr.name
    replacement = rng.choice(
        [helper.make_attribute(name, 1), helper.make_attribute(name, [1, 2]), helper.make_attribute(name, 0.5),
         helper.make_attribute(name, "x"), helper.make_attribute(name, [0.5]), helper.make_attribute(name, [])]
    )  # fmt: skip
    attr.CopyFrom(replacement)
    return f"retype attribute {name} of {node.op_type} {node.name!r}"


@_at_a_node()
def add_attribute(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    name = rng.choice([*_AXIS_ATTRS, "keepdims", "to", "transA", "allowzero", "bogus"])
    if any(a.name == name for a in node.attribute):
        return None
    value = rng.choice([rng.choice(_ODD_INTS), [rng.choice(_ODD_INTS) for _ in range(rng.randrange(4))]])
    node.attribute.append(helper.make_attribute(name, value))
    return f"add attribute {name}={value} to {node.op_type} {node.name!r}"


def out_of_range_axes(model: onnx.ModelProto, rng: random.Random) -> str | None:
    """An axis attribute, or a constant int input (axes, shape, starts), out of range."""
    candidates: list[object] = []
    for _, node in _nodes(model):
        candidates += [a for a in node.attribute if a.name in _AXIS_ATTRS and a.type in (2, 7)]
    candidates += [t for g in _graphs(model.graph) for t in g.initializer if t.data_type == TensorProto.INT64]
    if not candidates:
        return None
    target = rng.choice(candidates)
    if isinstance(target, TensorProto):
        array = numpy_helper.to_array(target).copy()
        if array.size:
            array.flat[rng.randrange(array.size)] = rng.choice(_ODD_INTS)
        target.CopyFrom(numpy_helper.from_array(array, target.name))
        return f"odd value in initializer {target.name!r}"
    assert isinstance(target, AttributeProto)
    if target.type == AttributeProto.INT:
        target.i = rng.choice([-100, 100, 7, -7])
    elif len(target.ints):
        target.ints[rng.randrange(len(target.ints))] = rng.choice([-100, 100, 7, -7])
    return f"out-of-range {target.name}"


# -- declared types -------------------------------------------------------------------


def _typed_values(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    return [v for g in _graphs(model.graph) for v in [*g.input, *g.output, *g.value_info]]


def alter_declared_type(model: onnx.ModelProto, rng: random.Random) -> str | None:
    values = _typed_values(model)
    if not values:
        return None
    value = rng.choice(values)
    kind = value.type
    choice = rng.randrange(8)
    if choice == 0:
        kind.tensor_type.elem_type = rng.choice(_DTYPES)
        return f"dtype of {value.name!r}"
    if choice == 1:
        kind.tensor_type.shape.dim.add().dim_value = rng.choice([1, 2, 3])
        return f"one more dim on {value.name!r}"
    if choice == 2 and len(kind.tensor_type.shape.dim):
        del kind.tensor_type.shape.dim[rng.randrange(len(kind.tensor_type.shape.dim))]
        return f"one dim fewer on {value.name!r}"
    dims = kind.tensor_type.shape.dim
    if choice == 3 and len(dims):
        dims[rng.randrange(len(dims))].dim_param = rng.choice(["N", "M", "batch", "unk__0", "2*N"])
        return f"symbolic dim on {value.name!r}"
    if choice == 4 and len(dims):
        dims[rng.randrange(len(dims))].Clear()
        return f"unknown dim on {value.name!r}"
    if choice == 5 and len(dims):
        dims[rng.randrange(len(dims))].dim_value = rng.choice([0, 1, 1000])
        return f"altered dim on {value.name!r}"
    if choice == 6:
        kind.tensor_type.ClearField("shape")
        return f"no shape on {value.name!r}"
    if kind.HasField("tensor_type"):
        inner = onnx.TypeProto()
        inner.CopyFrom(kind)
        wrapper = rng.choice(["sequence", "optional", "none"])
        if wrapper == "sequence":
            kind.CopyFrom(helper.make_sequence_type_proto(inner))
        elif wrapper == "optional":
            kind.CopyFrom(helper.make_optional_type_proto(inner))
        else:
            value.ClearField("type")
        return f"{wrapper} type on {value.name!r}"
    return None


@_at_a_node(lambda n: any(n.output))
def wrong_value_info(
    model: onnx.ModelProto, graph: onnx.GraphProto, node: onnx.NodeProto, rng: random.Random
) -> str | None:
    """Declare a node output with a type unrelated to what the node computes."""
    name = rng.choice([o for o in node.output if o])
    for existing in list(graph.value_info):
        if existing.name == name:
            graph.value_info.remove(existing)
    shape = rng.choice([None, [], [0], ["N", 3], [1, 1, 1, 1, 1], [7]])
    graph.value_info.append(helper.make_tensor_value_info(name, rng.choice(_DTYPES), shape))
    return f"value_info for {name!r} of {node.op_type}"


# -- tensors --------------------------------------------------------------------------


def empty_initializer(model: onnx.ModelProto, rng: random.Random) -> str | None:
    inits = [t for g in _graphs(model.graph) for t in g.initializer]
    if not inits:
        return None
    target = rng.choice(inits)
    array = numpy_helper.to_array(target) if target.data_type != TensorProto.UNDEFINED else None
    dtype = array.dtype if array is not None and array.dtype != object else np.float32
    shape = rng.choice([(0,), (), (0, 3), (1,)])
    target.CopyFrom(numpy_helper.from_array(np.zeros(shape, dtype), target.name))
    return f"initializer {target.name!r} becomes shape {shape}"


def retype_initializer(model: onnx.ModelProto, rng: random.Random) -> str | None:
    inits = [t for g in _graphs(model.graph) for t in g.initializer if t.data_type != TensorProto.STRING]
    if not inits:
        return None
    target = rng.choice(inits)
    array = numpy_helper.to_array(target)
    dtype = rng.choice([np.float32, np.int64, np.int32, np.bool_, np.float16, np.uint8])
    target.CopyFrom(numpy_helper.from_array(array.astype(dtype), target.name))
    return f"initializer {target.name!r} becomes {np.dtype(dtype).name}"


def initializer_as_input(model: onnx.ModelProto, rng: random.Random) -> str | None:
    inits = list(model.graph.initializer)
    if not inits:
        return None
    target = rng.choice(inits)
    if any(v.name == target.name for v in model.graph.input):
        return None
    shape = list(target.dims)
    model.graph.input.append(helper.make_tensor_value_info(target.name, target.data_type, shape))
    return f"initializer {target.name!r} also a graph input"


def _constant_attribute(rng: random.Random, name: str) -> list[onnx.AttributeProto]:
    spelling = rng.choice(
        ["value_int", "value_ints", "value_float", "value_floats", "value_string", "value_strings",
         "sparse_value", "empty_ints", "scalar", "empty", "two", "none", "bogus"]
    )  # fmt: skip
    make = helper.make_attribute
    if spelling == "value_int":
        return [make("value_int", rng.choice(_ODD_INTS))]
    if spelling == "value_ints":
        return [make("value_ints", [rng.choice(_ODD_INTS) for _ in range(rng.randrange(1, 4))])]
    if spelling == "empty_ints":
        attr = AttributeProto(name="value_ints", type=AttributeProto.INTS)
        return [attr]
    if spelling == "value_float":
        return [make("value_float", 0.5)]
    if spelling == "value_floats":
        return [make("value_floats", [0.5, -1.0])]
    if spelling == "value_string":
        return [make("value_string", "text")]
    if spelling == "value_strings":
        return [make("value_strings", ["a", "b"])]
    if spelling == "sparse_value":
        values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "values")
        indices = numpy_helper.from_array(np.array([0, 3], np.int64), "indices")
        return [make("sparse_value", helper.make_sparse_tensor(values, indices, [4]))]
    if spelling == "scalar":
        return [make("value", numpy_helper.from_array(np.array(2, np.int64), name))]
    if spelling == "empty":
        return [make("value", numpy_helper.from_array(np.zeros((0,), np.int64), name))]
    if spelling == "two":
        return [make("value_int", 1), make("value_float", 1.0)]
    if spelling == "bogus":
        return [make("bogus", 1)]
    return []


def odd_constant(model: onnx.ModelProto, rng: random.Random) -> str | None:
    """A Constant node respelled, or an initializer turned into such a Constant."""
    picked = _pick_node(model, rng, lambda n: n.op_type == "Constant")
    if picked is not None and rng.random() < 0.6:
        node = picked[1]
        del node.attribute[:]
        node.attribute.extend(_constant_attribute(rng, node.output[0]))
        return f"Constant {node.name!r} as {[a.name for a in node.attribute]}"
    inits = list(model.graph.initializer)
    if not inits:
        return None
    target = rng.choice(inits)
    model.graph.initializer.remove(target)
    node = helper.make_node("Constant", [], [target.name], name=_fresh(model, "const"))
    node.attribute.extend(_constant_attribute(rng, target.name))
    model.graph.node.insert(0, node)
    return f"initializer {target.name!r} as Constant {[a.name for a in node.attribute]}"


# -- opsets and control flow -----------------------------------------------------------


def repeat_graph_output(model: onnx.ModelProto, rng: random.Random) -> str | None:
    """A graph output listed twice, or a graph input listed as an output too."""
    graph = rng.choice(list(_graphs(model.graph)))
    choices = [*graph.output, *(graph.input if graph is model.graph else [])]
    if not choices:
        return None
    value = rng.choice(choices)
    graph.output.append(value)
    return f"{value.name!r} listed again as an output of {graph.name!r}"


def move_opset(model: onnx.ModelProto, rng: random.Random) -> str | None:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = rng.choice([1, 6, 7, 9, 10, 11, 12, 13, 17, 18, 21])
            return f"opset {entry.version}"
    return None


def into_if(model: onnx.ModelProto, rng: random.Random) -> str | None:
    """Move a node of the main graph into both branches of an If (the else branch gets a
    copy); the If takes over its outputs, its inputs are captured from the outer scope."""
    nodes = [n for n in model.graph.node if n.output and all(n.output)]
    if not nodes:
        return None
    node = rng.choice(nodes)
    index = list(model.graph.node).index(node)
    branches: list[onnx.GraphProto] = []
    if rng.random() < 0.3 and len(node.output) == 1 and node.input and node.input[0]:
        # The else branch returns an outer value directly (onnx allows it; onnxruntime does not).
        outer = helper.make_tensor_value_info(node.input[0], TensorProto.UNDEFINED, None)
        branches.append(helper.make_graph([], f"outer_{node.name}", [], [outer]))
    for label in ("then", "else")[: 2 - len(branches)]:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        del copy.output[:]
        copy.output.extend(_fresh(model, f"{label}_{i}_") for i in range(len(node.output)))
        outputs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in copy.output]
        branches.append(helper.make_graph([copy], f"{label}_{node.name}", [], outputs))
    cond = _fresh(model, "cond")
    flag = helper.make_node("Constant", [], [cond], value=numpy_helper.from_array(np.array(True)))
    wrapper = helper.make_node(
        "If", [cond], list(node.output), name=_fresh(model, "if"), then_branch=branches[-1], else_branch=branches[0]
    )
    model.graph.node.remove(node)
    model.graph.node.insert(index, wrapper)
    model.graph.node.insert(index, flag)
    return f"{node.op_type} {node.name!r} into an If"


def into_loop(model: onnx.ModelProto, rng: random.Random) -> str | None:
    """Move a single-output node of the main graph into a Loop body run once, its output
    carried out as a loop-carried value that starts as the node's first input."""
    nodes = [n for n in model.graph.node if len(n.output) == 1 and n.output[0] and n.input and n.input[0]]
    if not nodes:
        return None
    node = rng.choice(nodes)
    index = list(model.graph.node).index(node)
    trip, step, cond_in, carried, body_out = (
        _fresh(model, s) for s in ("trip", "step", "cond_in", "carried", "body_out")
    )
    body_cond = body_out + "_cond"
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    del copy.output[:]
    copy.output.append(body_out)
    keep = helper.make_node("Identity", [cond_in], [body_cond])
    body = helper.make_graph(
        [copy, keep],
        f"loop_{node.name}",
        [helper.make_tensor_value_info(step, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond_in, TensorProto.BOOL, []),
         helper.make_tensor_value_info(carried, TensorProto.UNDEFINED, None)],
        [helper.make_tensor_value_info(body_cond, TensorProto.BOOL, []),
         helper.make_tensor_value_info(body_out, TensorProto.UNDEFINED, None)],
    )  # fmt: skip
    count = helper.make_node("Constant", [], [trip], value=numpy_helper.from_array(np.array(1, np.int64)))
    loop = helper.make_node("Loop", [trip, "", node.input[0]], list(node.output), name=_fresh(model, "loop"), body=body)
    model.graph.node.remove(node)
    model.graph.node.insert(index, loop)
    model.graph.node.insert(index, count)
    return f"{node.op_type} {node.name!r} into a Loop"


MUTATIONS: dict[str, Mutation] = {
    "drop_input": drop_input,
    "blank_input": blank_input,
    "swap_inputs": swap_inputs,
    "rewire_input": rewire_input,
    "extra_input": extra_input,
    "extra_output": extra_output,
    "drop_output": drop_output,
    "duplicate_node": duplicate_node,
    "drop_attribute": drop_attribute,
    "alter_attribute": alter_attribute,
    "retype_attribute": retype_attribute,
    "add_attribute": add_attribute,
    "out_of_range_axes": out_of_range_axes,
    "alter_declared_type": alter_declared_type,
    "wrong_value_info": wrong_value_info,
    "empty_initializer": empty_initializer,
    "retype_initializer": retype_initializer,
    "initializer_as_input": initializer_as_input,
    "odd_constant": odd_constant,
    "repeat_graph_output": repeat_graph_output,
    "move_opset": move_opset,
    "into_if": into_if,
    "into_loop": into_loop,
}


def mutants(
    model: onnx.ModelProto, seed: int, count: int, kinds: list[str] | None = None
) -> Iterator[tuple[str, onnx.ModelProto]]:
    rng = random.Random(seed)
    names = kinds or list(MUTATIONS)
    for _ in range(count):
        mutant = onnx.ModelProto()
        mutant.CopyFrom(model)
        done = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            name = rng.choice(names)
            try:
                what = MUTATIONS[name](mutant, rng)
            except (ValueError, TypeError, IndexError):
                what = None  # a mutation that cannot apply to this model
            if what is not None:
                done.append(what)
        if done:
            yield "; ".join(done), mutant
