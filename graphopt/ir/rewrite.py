"""The rewrite toolkit: fresh names, a node builder, and replacements that keep the interface.

    names = Namer(model)
    b = Builder(graph, names, before=matmul, tag="matmul-add-to-gemm")
    y = b.op("Gemm", a, w, bias, transB=0)          # attribute kinds follow the Python values
    replace_nodes([matmul, add], {add.outputs[0]: y})

Every output a builder creates gets a name unique in the whole model (subgraphs and
functions included). :func:`replace_value` keeps graph-output names: the new value takes
the old name over, or, where that would merge two outputs, an Identity carries it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from graphopt.ir.graph import Graph, GraphError
from graphopt.ir.model import Model
from graphopt.ir.node import Attr, AttrKind, Node
from graphopt.ir.tensor import Tensor
from graphopt.ir.types import TensorType
from graphopt.ir.value import Value

__all__ = ["PROVENANCE_KEY", "Builder", "Namer", "attribute", "can_take_over", "replace_nodes", "replace_value"]

# The metadata key under which a node records the rule or pass that made it.
PROVENANCE_KEY = "graphopt.rule"


class Namer:
    """Names unique across a model: every value and node name of every graph is taken."""

    def __init__(self, model: Model) -> None:
        self._taken: set[str] = set()
        for graph in model.all_graphs():
            self._taken.update(v.name for v in graph.values())
            self._taken.update(n.name for n in graph)
        self._taken.update(v.name for v in model.graph.outputs)
        self._counters: dict[str, int] = {}

    def fresh(self, base: str) -> str:
        """``base`` if it is free, else ``base_1``, ``base_2``, ... (the first free one)."""
        base = base or "v"
        name = base
        count = self._counters.get(base, 0)
        while name in self._taken:
            count += 1
            name = f"{base}_{count}"
        self._counters[base] = count
        self._taken.add(name)
        return name

    def take(self, name: str) -> None:
        """Record a name made elsewhere (io, a user) so it is never handed out."""
        self._taken.add(name)


def attribute(name: str, value: Any) -> Attr:
    """An attribute whose kind follows the Python value: int, float, str/bytes, array or
    Tensor, Graph, or a non-empty list of one of those."""
    if isinstance(value, Attr):
        return value
    kind, stored = _kind_of(value)
    if kind is None:
        raise TypeError(f"attribute {name!r}: cannot tell the ONNX kind of {value!r}")
    return Attr(name, kind, stored)


def _kind_of(value: Any) -> tuple[AttrKind | None, Any]:
    if isinstance(value, (bool, int, np.integer)):
        return AttrKind.INT, int(value)
    if isinstance(value, (float, np.floating)):
        return AttrKind.FLOAT, float(value)
    if isinstance(value, str):
        return AttrKind.STRING, value.encode()
    if isinstance(value, bytes):
        return AttrKind.STRING, value
    if isinstance(value, np.ndarray):
        return AttrKind.TENSOR, Tensor.from_array(value)
    if isinstance(value, Tensor):
        return AttrKind.TENSOR, value
    if isinstance(value, Graph):
        return AttrKind.GRAPH, value
    if isinstance(value, (list, tuple)) and value:
        kinds = {kind for kind, _ in map(_kind_of, value) if kind is not None}
        if len(kinds) == 0 or any(_kind_of(v)[0] is None for v in value):
            return None, None
        plural = {
            frozenset({AttrKind.INT}): AttrKind.INTS,
            frozenset({AttrKind.FLOAT}): AttrKind.FLOATS,
            frozenset({AttrKind.INT, AttrKind.FLOAT}): AttrKind.FLOATS,
            frozenset({AttrKind.STRING}): AttrKind.STRINGS,
            frozenset({AttrKind.TENSOR}): AttrKind.TENSORS,
            frozenset({AttrKind.GRAPH}): AttrKind.GRAPHS,
        }.get(frozenset(kinds))
        if plural is None:
            return None, None
        singular = [_kind_of(v)[1] for v in value]
        if plural == AttrKind.FLOATS:
            singular = [float(v) for v in singular]
        return plural, singular
    return None, None


class Builder:
    """Creates nodes and constants in ``graph`` (before ``before``, or at the end).

    ``typer`` gives new nodes their output types (the facts service's shape rules);
    ``tag`` names the rule or pass that made them, written to each node's metadata when
    ``provenance`` is on. ``created`` and ``constants`` list what it made, in order. ``opset``
    is the graph's default-domain opset, which :meth:`shape` writes for.
    """

    def __init__(
        self,
        graph: Graph,
        names: Namer,
        *,
        before: Node | None = None,
        tag: str = "",
        provenance: bool = False,
        typer: Callable[[Node], None] | None = None,
        opset: int | None = None,
    ) -> None:
        self.graph = graph
        self.opset = opset
        self.names = names
        self.before = before
        self.tag = tag
        self.provenance = provenance
        self.typer = typer
        self.created: list[Node] = []
        self.constants: list[Value] = []

    def op(self, op_type: str, *inputs: Value | None, **spec: Any) -> Value:
        """Add one node (keywords as for :meth:`node`); its first output."""
        return self.node(op_type, *inputs, **spec).outputs[0]

    def node(
        self,
        op_type: str,
        *inputs: Value | None,
        domain: str = "",
        outputs: int | Sequence[str] = 1,
        name: str = "",
        **attributes: Any,
    ) -> Node:
        """Add one node; keywords other than ``domain``, ``outputs`` (a count or name hints)
        and ``name`` are its attributes."""
        hints = [f"{name or op_type}_out"] * outputs if isinstance(outputs, int) else list(outputs)
        node = Node(
            op_type,
            list(inputs),
            [Value(self.names.fresh(h)) for h in hints],
            [attribute(k, v) for k, v in attributes.items()],
            domain=domain,
            name=self.names.fresh(name or op_type),
        )
        if self.provenance and self.tag:
            node.metadata_props[PROVENANCE_KEY] = self.tag
        if self.before is not None:
            self.graph.insert_before(self.before, node)
        else:
            self.graph.append(node)
        if self.typer is not None:
            self.typer(node)
        self.created.append(node)
        return node

    def shape(self, x: Value, start: int = 0, end: int | None = None, **spec: Any) -> Value:
        """``x``'s dims ``start:end`` as a 1-D int64 value: Shape's own ``start`` / ``end`` from opset 15,
        a Slice of the whole Shape before it (Shape had no attributes). ``spec`` (a name) goes to the last
        node."""
        if self.opset is None or self.opset >= 15:
            return self.op("Shape", x, start=start, **({"end": end} if end is not None else {}), **spec)
        last = np.iinfo(np.int64).max if end is None else end
        starts, ends = (self.constant(np.array([v], np.int64), n) for v, n in ((start, "start"), (last, "end")))
        return self.op("Slice", self.op("Shape", x), starts, ends, **spec)

    def listed(self, op_type: str, x: Value, key: str, ints: Sequence[int], *, as_input: bool, **spec: Any) -> Node:
        """``op_type`` of ``x`` given a list of ints (Squeeze / Unsqueeze ``axes``, Split's
        ``split``, ReduceMean's ``axes``): an int64 input where ``as_input`` (the opset the op
        took them as an input from), else the attribute ``key``."""
        if as_input:
            return self.node(op_type, x, self.constant(np.asarray(ints, dtype=np.int64), key), **spec)
        attributes: dict[str, Any] = {key: list(ints)}
        return self.node(op_type, x, **attributes, **spec)

    def constant(self, array: np.ndarray | Tensor, name: str = "const") -> Value:
        """A new initializer holding ``array`` (its type follows the array)."""
        tensor = array if isinstance(array, Tensor) else Tensor.from_array(array)
        tensor.name = self.names.fresh(name)
        value = Value(tensor.name, TensorType(tensor.dtype, tensor.shape), tensor)
        self.constants.append(value)
        return self.graph.add_initializer(value)


def can_take_over(old: Value, new: Value) -> bool:
    """Whether ``new`` can stand for ``old`` with no Identity: ``old`` is no graph output, or
    ``new`` is a node output of the same graph that is not an output already."""
    if not old.is_graph_output:
        return True
    producer = new.producer
    return producer is not None and producer.graph is old.graph and not new.is_graph_output


def replace_value(old: Value, new: Value, names: Namer, *, keep: Collection[Node] = ()) -> None:
    """Make every reader of ``old`` read ``new``; a graph output keeps its name and type.

    Readers in ``keep`` go on reading ``old``: the nodes that compute ``new`` from it, when a
    rewrite wraps a value (``x -> Mul(x, s)``).

    Where ``old`` is a graph output, ``new`` takes its name over when :func:`can_take_over`
    allows; otherwise an Identity of ``new`` carries the name, so two outputs never merge
    into one and an input is never renamed. The caller removes ``old``'s producer after.
    """
    if old is new:
        return
    kept = {id(n) for n in keep}
    for use in old.uses():
        if id(use.node) not in kept:
            use.node.set_input(use.index, new)
    graphs = old.output_of()
    if not graphs:
        return
    takes_over = can_take_over(old, new)
    for graph in graphs:
        if graph.is_input(old):
            raise GraphError(f"cannot replace {old.name!r}: it is both an input and an output of its graph")
        name = old.name
        if old.producer is not None:  # a node output gives its name up; an initializer goes with its entry
            old.name = names.fresh(f"{name}_replaced")
        carrier = new
        if takes_over:
            new.name = name
        else:
            identity = Node("Identity", [new], [Value(name)], name=names.fresh("Identity"))
            graph.append(identity)
            carrier = identity.outputs[0]
        carrier.type = old.type if old.type is not None else new.type
        carrier.doc_string = carrier.doc_string or old.doc_string
        graph.outputs = [carrier if v is old else v for v in graph.outputs]


def replace_nodes(old: Iterable[Node], replacements: Mapping[Value, Value], names: Namer) -> None:
    """Replace each value of ``replacements`` (outputs of ``old``) by its new value, then remove
    ``old``; an output of ``old`` not in ``replacements`` must be unused."""
    doomed = list(old)
    for before, after in replacements.items():
        replace_value(before, after, names)
    if not doomed:
        return
    graph = doomed[0].graph
    if graph is None or any(n.graph is not graph for n in doomed):
        raise GraphError("replace_nodes: the nodes must belong to one graph")
    graph.remove(doomed)
