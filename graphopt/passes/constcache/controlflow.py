"""Control flow decided at compile time: If nodes replaced by the branch they take, and
Loops and Scans that run at most once replaced by their body, inlined.

An If is decided when

- its condition is a constant: a literal, or a test of shapes that symbolic folding made one
  (``Equal(Gather(Shape(x), 1), 512)`` where that dim is 512; in bodies too, where the types
  of the outer values are in view), or
- it sits in a branch of an If on the same condition value (true in the then branch), or
- its two branches compute the same thing: equal node for node (op, attributes, constants,
  the same outer values read; an Identity stands for its input), so it does not matter which
  one runs. Bodies nested in the branches are compared the same way.

Inlining moves the branch's nodes and initializers into the If's graph, before it, and the
branch's outputs stand for the If's:

- names: a moved value keeps its name unless another value of the model has it too (sibling
  branches may reuse a name, and the graph they now sit in would shadow it): then it gets a
  fresh one;
- types: what the model declares for the If's output stays; the branch fills in only the
  dims (or the rank) it leaves unknown;
- a branch output that is an outer value (a graph input, a value of an enclosing graph)
  stands for the If's output as it is, its type untouched; a graph output keeps its name
  (where the value cannot take the name over, an Identity carries it: see ``replace_value``);
- a function body holds no initializers: an If there whose branch has some stays.

A Loop runs no iteration when its condition is the constant false or its trip count the
constant 0: its carried values come out as they went in (a Loop with scan outputs stays,
their empty shape is not known). It runs one when its trip count is the constant 1 and its
condition absent or the constant true: its body is inlined as a branch is, reading the
iteration number 0, the loop's condition and the initial values, and each scan output is
the body's, unsqueezed to a stack of one. A Scan (opset 9 on) whose scan inputs all have
length 1 along their axis runs one iteration too: its body reads the initial states and
each input squeezed at its axis, and each scan output is unsqueezed at its own.

The pipeline repeats const-cache to a fixed point: inlining an If brings the Ifs nested in
its branch into the outer graph, whose conditions may fold next (their dims are known there).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import numpy as np

from graphopt.facts.op import norm_axis
from graphopt.ir import Graph, Model, Node, TensorType, Type, Value, tensor_shape
from graphopt.ir.constness import constant_array, constant_tensor, is_deterministic
from graphopt.ir.rewrite import Namer, replace_value
from graphopt.passes.cleanup.cse import attribute_key
from graphopt.passes.constcache.symbolic import MakeBuilder

__all__ = ["inline_decided_control_flow"]


def inline_decided_control_flow(model: Model, make: MakeBuilder) -> dict[str, int]:
    """Inline each decided If and each Loop or Scan of at most one iteration (see the module
    docstring); how many of each went."""
    # Innermost bodies first: an If whose branches hold decided Ifs compares them inlined.
    graphs = list(model.all_graphs())[::-1]
    function_bodies = {id(f.body) for f in model.functions}  # they hold no initializers
    owners = [n for g in graphs for n in g.topological() if n.op_type in _CONTROL_FLOW and n.in_standard_domain]
    counts = Counter(v.name for g in graphs for v in g.values())
    done: Counter[str] = Counter()
    for node in owners:
        graph = node.graph
        if graph is None or node.opaque:  # its owner went with a branch not taken
            continue
        if node.op_type == "If":
            branch = _taken_branch(node)
            if branch is None or len(branch.outputs) != len(node.outputs):
                continue
            if branch.initializers and id(graph) in function_bodies:
                continue
            _replace_outputs(graph, node, *_hoist(graph, node, branch, make.names, counts), make.names)
            done["ifs_inlined"] += 1
        elif id(graph) not in function_bodies and _UNROLL[node.op_type](graph, node, make, counts):
            done[f"{node.op_type.lower()}s_unrolled"] += 1
    return dict(done)


def _taken_branch(node: Node) -> Graph | None:
    """The branch ``node`` runs whatever its inputs, or None when that depends on them."""
    then, other = node.attr("then_branch"), node.attr("else_branch")
    if not isinstance(then, Graph) or not isinstance(other, Graph) or node.input(0) is None:
        return None
    condition = constant_array(node.input(0), limit=1)
    if condition is not None and condition.size == 1:
        return then if bool(condition.ravel()[0]) else other
    known = _known_inside(node)
    if known is not None:
        return then if known else other
    return then if _same_computation(then, other) else None


def _known_inside(node: Node) -> bool | None:
    """The condition of an If nested in a branch of an If on the same condition value: true
    in a then branch, false in an else branch."""
    condition = node.input(0)
    graph = node.graph
    while graph is not None and graph.parent is not None:
        owner = graph.parent
        if owner.op_type == "If" and owner.in_standard_domain and owner.input(0) is condition:
            return graph is owner.attr("then_branch")
        graph = owner.graph
    return None


# -- equal branches ------------------------------------------------------------------------


def _same_computation(a: Graph, b: Graph) -> bool:
    """Whether two bodies compute equal outputs from the same outer values."""
    if len(a.outputs) != len(b.outputs) or _op_census(a) != _op_census(b):
        return False
    numbers: dict[Hashable, int] = {}  # one table: equal keys, equal numbers, in either body
    found_a, found_b = _Keys(numbers).body(a, 0), _Keys(numbers).body(b, 0)
    return found_a is not None and found_a == found_b


def _op_census(graph: Graph) -> Counter[str]:
    """The op types of ``graph`` and of the bodies in it (Identity aside): a quick refusal."""
    return Counter(n.op_type for n in [*graph, *(m for g in graph.subgraphs() for m in g)] if n.op_type != "Identity")


class _Keys:
    """Numbers for the values of one body, equal where two bodies compute the same thing: a
    node output is numbered by its op, attributes and its inputs' numbers, a constant by its
    content, a body input by its depth and position, an outer value by itself. Keys are
    numbered as they are made, so a key holds numbers, never a whole chain of nested keys."""

    def __init__(self, numbers: dict[Hashable, int]) -> None:
        self.numbers = numbers
        self.known: dict[int, int] = {}

    def number(self, key: Hashable) -> int:
        return self.numbers.setdefault(key, len(self.numbers))

    def value(self, value: Value) -> int:
        found = self.known.get(id(value))
        return self.number(("outer", id(value))) if found is None else found

    def body(self, graph: Graph, depth: int) -> tuple[int, ...] | None:
        """The numbers of ``graph``'s outputs, or None if a node in it may differ run to run."""
        for position, value in enumerate(graph.inputs):
            self.known[id(value)] = self.number(("input", depth, position))
        for value in graph.initializers.values():
            tensor = constant_tensor(value)
            if tensor is None:
                return None
            self.known[id(value)] = self.number(("constant", tensor.dtype, tensor.shape, tensor.digest()))
        for node in graph.topological():
            passed_on = node.input(0) if node.op_type == "Identity" and node.in_standard_domain else None
            if passed_on is not None:
                self.known[id(node.outputs[0])] = self.value(passed_on)  # numbered as what it passes on
                continue
            key = self.node(node, depth)
            if key is None:
                return None
            for index, value in enumerate(node.outputs):
                self.known[id(value)] = self.number((key, index))
        return tuple(self.value(v) for v in graph.outputs)

    def node(self, node: Node, depth: int) -> int | None:
        if not node.in_standard_domain or node.opaque or not is_deterministic(node):
            return None
        inputs = tuple(None if v is None else self.value(v) for v in node.inputs)
        attributes: list[Hashable] = []
        for name in sorted(node.attributes):
            attr = node.attributes[name]
            bodies = attr.graphs()
            if attr.ref_attr_name:
                found: Hashable | None = ("ref", attr.ref_attr_name)
            elif bodies:
                keyed = [self.body(g, depth + 1) for g in bodies]
                found = None if any(k is None for k in keyed) else tuple(keyed)
            else:
                found = attribute_key(attr)
            if found is None:
                return None
            attributes.append((name, found))
        produced = tuple(bool(v.name) for v in node.outputs)
        return self.number((node.op_type, node.overload, inputs, produced, tuple(attributes)))


# -- loops of no or one iteration ------------------------------------------------------------


def _trip_count(loop: Node) -> int | None:
    """0 or 1 when the Loop is known to run that many iterations, else None. It runs while
    ``i < M and condition``: one iteration needs the condition absent or the constant true."""
    condition = loop.input(1)
    flag = constant_array(condition, limit=1)
    known = None if flag is None or flag.size != 1 else bool(flag.ravel()[0])
    count = constant_array(loop.input(0), limit=1)
    trips = int(count.ravel()[0]) if count is not None and count.size == 1 else None
    if known is False or trips == 0:
        return 0
    return 1 if trips == 1 and (condition is None or known) else None


def _unroll(graph: Graph, loop: Node, make: MakeBuilder, counts: Counter[str]) -> bool:
    """Replace a Loop of no or one iteration by what it computes; whether it did."""
    body, trips = loop.attr("body"), _trip_count(loop)
    initial = loop.inputs[2:]
    n_carried = len(initial)
    if not isinstance(body, Graph) or trips is None or any(v is None for v in initial):
        return False
    if len(body.inputs) != n_carried + 2 or len(body.outputs) != len(loop.outputs) + 1:
        return False
    carried_in = [v for v in initial if v is not None]
    if trips == 0:
        if any(v.is_used() for v in loop.outputs[n_carried:]):
            return False  # scan outputs: empty stacks of a shape not known here
        _replace_outputs(graph, loop, carried_in, set(), make.names)
        return True
    b = make(graph, loop)
    iteration, condition = body.inputs[:2]
    first = [
        b.constant(np.array(0, np.int64), "iteration") if iteration.is_used() else None,
        loop.input(1) or (b.constant(np.array(True), "condition") if condition.is_used() else None),
        *carried_in,
    ]
    n_scans = len(loop.outputs) - n_carried
    _inline_iteration(graph, loop, body, first, [0] * n_scans, make, counts, skip=1)
    return True


def _unroll_scan(graph: Graph, scan: Node, make: MakeBuilder, counts: Counter[str]) -> bool:
    """Replace a Scan whose every scan input has length 1 (a known dim) by its body, each
    input's one slice squeezed out of it; whether it did."""
    body, n_scan_inputs = scan.attr("body"), scan.attr("num_scan_inputs", 0)
    n_states = len(scan.inputs) - n_scan_inputs
    b = make(graph, scan)
    opset = b.opset or 13
    if opset < 9 or not isinstance(body, Graph) or n_scan_inputs < 1 or n_states < 0:
        return False  # Scan-8 scans a batch of sequences
    if any(v is None for v in scan.inputs):
        return False
    if len(body.inputs) != len(scan.inputs) or len(body.outputs) != len(scan.outputs):
        return False
    input_axes = scan.attr("scan_input_axes") or [0] * n_scan_inputs
    axes: list[int] = []
    for value, axis in zip(scan.inputs[n_states:], input_axes, strict=False):
        shape = tensor_shape(value)
        index = None if shape is None else norm_axis(axis, len(shape))
        if shape is None or index is None or shape[index] != 1:
            return False
        axes.append(index)
    slices = [
        b.listed("Squeeze", v, "axes", [a], as_input=opset >= 13).outputs[0]
        for v, a in zip(scan.inputs[n_states:], axes, strict=True)
        if v is not None
    ]
    states = [v for v in scan.inputs[:n_states] if v is not None]
    output_axes = scan.attr("scan_output_axes") or [0] * (len(scan.outputs) - n_states)
    _inline_iteration(graph, scan, body, [*states, *slices], list(output_axes), make, counts, skip=0)
    return True


def _inline_iteration(
    graph: Graph,
    owner: Node,
    body: Graph,
    first: list[Value | None],
    stack_axes: list[int],
    make: MakeBuilder,
    counts: Counter[str],
    *,
    skip: int,
) -> None:
    """Inline one iteration of ``owner``'s ``body``: its inputs read ``first`` (None where
    nothing reads them), the outputs after the ``skip`` first (a Loop's condition) stand for
    ``owner``'s: the carried ones as they are, the last ``len(stack_axes)`` unsqueezed at
    their axis to a stack of one."""
    replacements = {id(v): value for v, value in zip(body.inputs, first, strict=True)}
    for value, replacement in zip(body.inputs, first, strict=True):
        for use in value.uses():
            use.node.set_input(use.index, replacement)
    outputs, moved = _hoist(graph, owner, body, make.names, counts)
    results = [replacements.get(id(v)) or v for v in outputs[skip:]]  # a value the body passes on as it is
    n_carried = len(results) - len(stack_axes)
    b = make(graph, owner)
    opset = b.opset or 13
    stacked = [
        b.listed("Unsqueeze", v, "axes", [axis], as_input=opset >= 13).outputs[0]
        for v, axis in zip(results[n_carried:], stack_axes, strict=True)
    ]
    _replace_outputs(graph, owner, [*results[:n_carried], *stacked], moved, make.names)


_UNROLL = {"Loop": _unroll, "Scan": _unroll_scan}
_CONTROL_FLOW = ("If", *_UNROLL)


# -- inlining ------------------------------------------------------------------------------


def _hoist(
    graph: Graph, owner: Node, branch: Graph, names: Namer, counts: Counter[str]
) -> tuple[list[Value], set[int]]:
    """Move ``branch``'s nodes and initializers before ``owner``; the branch's outputs, and
    the ids of the values that moved."""
    moved = {id(v) for v in branch.values()}
    for body in [*owner.subgraphs(), *(g for b in owner.subgraphs() for g in b.subgraphs())]:
        counts.subtract(v.name for v in body.values())  # the owner goes, and its names with it
    for value in list(branch.initializers.values()):
        branch.initializers.pop(value.name)
        _claim(value, names, counts)
        graph.add_initializer(value)
    results = branch.outputs
    branch.outputs = []
    for inner in branch.topological():
        branch.remove(inner, safe=False)
        for value in inner.outputs:
            _claim(value, names, counts)
        graph.insert_before(owner, inner)
        for body in inner.subgraphs():
            counts.update(v.name for g in [body, *body.subgraphs()] for v in g.values())
    return results, moved


def _replace_outputs(graph: Graph, owner: Node, results: list[Value], moved: set[int], names: Namer) -> None:
    """Make ``results`` stand for ``owner``'s first outputs (those after them are unused), then
    remove it."""
    for old, new in zip(owner.outputs[: len(results)], results, strict=True):
        if id(new) in moved:  # an outer value keeps its own type
            new.type = _declared_first(old.type, new.type)
        replace_value(old, new, names)
    graph.remove(owner)


def _claim(value: Value, names: Namer, counts: Counter[str]) -> None:
    """Give a moved value a fresh name if another value of the model has its name."""
    if value.name and counts[value.name] > 0:
        value.name = names.fresh(value.name)
    counts[value.name] += 1


def _declared_first(declared: Type | None, found: Type | None) -> Type | None:
    """``declared``, with the rank or dims it leaves unknown taken from ``found``."""
    if not isinstance(declared, TensorType) or not isinstance(found, TensorType) or declared.dtype != found.dtype:
        return declared if declared is not None else found
    if declared.shape is None or found.shape is None or len(declared.shape) != len(found.shape):
        return declared if declared.shape is not None else found
    shape = tuple(d if d is not None else f for d, f in zip(declared.shape, found.shape, strict=True))
    return TensorType(declared.dtype, shape)
