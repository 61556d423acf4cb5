"""Graphs: inputs, initializers, nodes and outputs, with order and levels on demand."""

from __future__ import annotations

import heapq
from collections import ChainMap
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from graphopt.ir.node import Node
from graphopt.ir.value import Use, Value, read_value

__all__ = ["Graph", "GraphError", "ancestor_in"]


class GraphError(ValueError):
    """The graph breaks an invariant: a cycle, a duplicate name, a dangling value."""


class Graph:
    """A main graph or a subgraph body (``parent`` is then the node that owns it).

    Every mutation goes through methods here or on :class:`Node`, so use lists stay
    exact and the cached topological order and levels are dropped when they go stale.
    """

    def __init__(
        self,
        inputs: Sequence[Value] = (),
        outputs: Sequence[Value] = (),
        nodes: Iterable[Node] = (),
        initializers: Iterable[Value] = (),
        name: str = "",
    ) -> None:
        self.name = name
        self.doc_string = ""
        self.metadata_props: dict[str, str] = {}
        self.quantization_annotation: list[tuple[str, dict[str, str]]] = []
        self.parent: Node | None = None
        # Nodes form a doubly linked list through Node._prev / Node._next, so inserting
        # before an anchor and removing are O(1) however large the graph.
        self._head: Node | None = None
        self._tail: Node | None = None
        self._count = 0
        self._inputs: list[Value] = []
        self._input_ids: set[int] = set()
        self._outputs: list[Value] = []
        self.initializers: dict[str, Value] = {}
        self._version = 0
        self._cache: dict[str, tuple[int, object]] = {}
        self._free: Sequence[Use | Value] = ()
        self._free_version = -1
        self.inputs = list(inputs)
        for value in initializers:
            self.add_initializer(value)
        for node in nodes:
            self.append(node)
        self.outputs = list(outputs)

    # -- iteration and lookup -------------------------------------------------
    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return self._count

    @property
    def nodes(self) -> list[Node]:
        """The nodes in stored order (a copy: callers may mutate the graph while they iterate)."""
        found: list[Node] = []
        node = self._head
        while node is not None:
            found.append(node)
            node = node._next
        return found

    def all_nodes(self) -> Iterator[Node]:
        """Every node, including those in subgraph bodies (depth first)."""
        # An explicit stack, not nested generators: a node k bodies deep would otherwise pass
        # through k generator frames on its way out.
        pending: list[Iterator[Node]] = [iter(self.nodes)]
        while pending:
            node = next(pending[-1], None)
            if node is None:
                pending.pop()
                continue
            yield node
            if node.attributes:
                pending.append(chain.from_iterable(body.nodes for body in node.subgraphs()))

    def subgraphs(self) -> Iterator[Graph]:
        """Every body graph nested anywhere below this one (depth first)."""
        pending = _bodies_in(self)[::-1]
        while pending:
            body = pending.pop()
            yield body
            pending += _bodies_in(body)[::-1]

    def values(self) -> Iterator[Value]:
        """Every value defined in this graph (inputs, initializers, node outputs)."""
        seen: set[int] = set()
        for value in [*self._inputs, *self.initializers.values()]:
            if id(value) not in seen:
                seen.add(id(value))
                yield value
        for node in self.nodes:
            yield from node.outputs

    def enclosing(self) -> Iterator[Graph]:
        """This graph, then each graph around it out to the main graph."""
        graph: Graph | None = self
        while graph is not None:
            yield graph
            graph = graph.parent.graph if graph.parent is not None else None

    # -- inputs, outputs, initializers ------------------------------------------
    @property
    def inputs(self) -> list[Value]:
        return list(self._inputs)

    @inputs.setter
    def inputs(self, values: Sequence[Value]) -> None:
        for value in values:
            value.graph = self
        self._inputs = list(values)
        self._input_ids = {id(v) for v in self._inputs}
        self._touch()

    def is_input(self, value: Value) -> bool:
        return id(value) in self._input_ids

    @property
    def outputs(self) -> list[Value]:
        return list(self._outputs)

    @outputs.setter
    def outputs(self, values: Sequence[Value]) -> None:
        for value in self._outputs:
            value._count_output(self, -1)
        self._outputs = list(values)
        for value in self._outputs:
            value._count_output(self, +1)
        self._touch()

    def add_initializer(self, value: Value) -> Value:
        if value.const is None:
            raise GraphError(f"initializer {value.name!r} has no data")
        existing = self.initializers.get(value.name)
        if existing is not None and existing is not value:
            raise GraphError(f"an initializer named {value.name!r} already exists")
        value.graph = self
        self.initializers[value.name] = value
        self._touch()
        return value

    def remove_initializer(self, value: Value) -> None:
        if value.is_used():
            raise GraphError(f"initializer {value.name!r} is still used")
        self.initializers.pop(value.name, None)
        self._touch()

    # -- nodes ----------------------------------------------------------------
    def append(self, node: Node) -> Node:
        return self._link(node, None)

    def insert_before(self, anchor: Node, node: Node) -> Node:
        if anchor.graph is not self:
            raise GraphError(f"{anchor} is not in this graph")
        return self._link(node, anchor)

    def insert_after(self, anchor: Node, node: Node) -> Node:
        if anchor.graph is not self:
            raise GraphError(f"{anchor} is not in this graph")
        return self._link(node, anchor._next)

    def insert(self, position: int, node: Node) -> Node:
        """Insert at ``position`` of the stored order (O(position); prefer insert_before)."""
        anchor = self._head
        for _ in range(position):
            if anchor is None:
                break
            anchor = anchor._next
        return self._link(node, anchor)

    def records_use_of(self, value: Value) -> bool:
        """Whether a read of ``value`` by a node of this graph is recorded now. A read of a
        value from outside an unattached body is recorded when the body's owner is inserted
        (as a capture), so a body that is never used leaks no uses."""
        owner = value.graph
        return owner is None or owner is self or any(g is owner for g in self.enclosing())

    def _link(self, node: Node, anchor: Node | None) -> Node:
        if node.graph is not None:
            raise GraphError(f"{node} already belongs to a graph")
        node.graph = self
        for value in node.outputs:
            value.graph = self
        for index, read in enumerate(node.inputs):
            if read is not None and self.records_use_of(read):
                read._add_use(Use(node, index))
        for value, use in _capture_uses(node):
            value._add_use(use)
        self._join(anchor._prev if anchor is not None else self._tail, node)
        self._join(node, anchor)
        self._count += 1
        self._touch()
        return node

    def _join(self, left: Node | None, right: Node | None) -> None:
        """Make ``right`` follow ``left`` in the stored order (None: the list's ends)."""
        if left is None:
            self._head = right
        else:
            left._next = right
        if right is None:
            self._tail = left
        else:
            right._prev = left

    def remove(self, nodes: Node | Iterable[Node], *, safe: bool = True) -> None:
        """Detach nodes. With ``safe``, first verify no surviving reader needs their outputs."""
        doomed = [nodes] if isinstance(nodes, Node) else list(nodes)
        doomed_ids = {id(n) for n in doomed}
        for node in doomed:
            if node.graph is not self:
                raise GraphError(f"{node} is not in this graph")
            if safe:
                for value in node.outputs:
                    if value.is_graph_output:
                        raise GraphError(f"cannot remove {node}: {value.name!r} is a graph output")
                    if any(id(u.node) not in doomed_ids and not _inside(u.node, doomed_ids) for u in value.uses()):
                        raise GraphError(f"cannot remove {node}: {value.name!r} is still used")
        for node in doomed:
            node._unregister_uses()
            for value, use in _capture_uses(node):
                value._remove_use(use)
            node.graph = None
            self._join(node._prev, node._next)
            node._prev = node._next = None
            self._count -= 1
        self._touch()

    # -- derived orders -------------------------------------------------------
    def _touch(self) -> None:
        self._version += 1
        parent = self.parent
        if parent is not None and parent.graph is not None:
            parent.graph._touch()

    def _cached(self, key: str) -> object | None:
        hit = self._cache.get(key)
        return hit[1] if hit is not None and hit[0] == self._version else None

    def free_reads(self) -> Sequence[Use | Value]:
        """What this graph and the bodies nested in it take from outside: each read of an
        outer value by one of their nodes (a :class:`Use`), and each outer value one of
        them returns as an output. Cached until the next mutation here or below.

        Built from the bodies' own cached lists, so a read costs one step per scope it
        crosses: walking every nested node for every enclosing node was O(nodes x depth).
        """
        if self._free_version == self._version:
            return self._free
        found: list[Use | Value] = []
        for node in self.nodes:
            for index, value in enumerate(node._inputs):
                if value is not None and value.graph is not self:
                    found.append(Use(node, index))
            if node.attributes:
                for body in node.subgraphs():
                    found += [read for read in body.free_reads() if read_value(read).graph is not self]
        found += [value for value in self._outputs if value.graph is not self]
        # A body reads little from outside, and there is one list per body: keep none when empty.
        self._free = found or ()
        self._free_version = self._version
        return self._free

    def _dependencies(self, node: Node) -> list[Node]:
        """Nodes of this graph that must run before ``node`` (captures included)."""
        deps: list[Node] = []
        values = [v for v in node.inputs if v is not None]
        if node.attributes:
            values += node.captures()
        for value in values:
            producer = value.producer
            if producer is not None:
                local = ancestor_in(producer, self)
                if local is not None and local is not node:
                    deps.append(local)
        return deps

    def topological(self) -> list[Node]:
        """A topological order that keeps the stored order wherever it is already valid."""
        cached = self._cached("topo")
        if cached is not None:
            return list(cached)  # type: ignore[call-overload]
        order = self._kahn(self.nodes)
        self._cache["topo"] = (self._version, order)
        return list(order)

    def ordered(self, nodes: Iterable[Node]) -> list[Node]:
        """``nodes`` of this graph in an order in which each runs after those of them it reads,
        ties kept in the given order. It costs the size of ``nodes``, not of the graph: the rule
        engine orders every match it tries, and a whole-graph sort there made a sweep quadratic."""
        return self._kahn(list({id(n): n for n in nodes}.values()))

    def _kahn(self, given: list[Node]) -> list[Node]:
        """``given`` sorted by their dependencies among themselves, ties in the given order."""
        rank = {id(n): i for i, n in enumerate(given)}
        readers: dict[int, list[Node]] = {}
        pending: dict[int, int] = {}
        for node in given:
            deps = {id(d) for d in self._dependencies(node) if id(d) in rank}
            pending[id(node)] = len(deps)
            for dep in deps:
                readers.setdefault(dep, []).append(node)
        ready = [(rank[id(n)], n) for n in given if pending[id(n)] == 0]
        heapq.heapify(ready)
        order: list[Node] = []
        while ready:
            _, node = heapq.heappop(ready)
            order.append(node)
            for reader in readers.get(id(node), ()):
                pending[id(reader)] -= 1
                if pending[id(reader)] == 0:
                    heapq.heappush(ready, (rank[id(reader)], reader))
        if len(order) != len(given):
            stuck = [n for n in given if pending[id(n)] > 0]
            raise GraphError(
                f"the graph has a cycle through {len(stuck)} nodes, e.g. {stuck[0].name or stuck[0].op_type!r}"
            )
        return order

    def positions(self) -> dict[int, int]:
        """Each node's index in :meth:`topological`, by ``id``; cached until the next mutation
        (shared: callers must not change it)."""
        cached = self._cached("positions")
        if cached is not None:
            return cached  # type: ignore[return-value]
        found = {id(n): i for i, n in enumerate(self.topological())}
        self._cache["positions"] = (self._version, found)
        return found

    def levels(self, *, ignore_constants: bool = False) -> list[list[Node]]:
        """ASAP levels: level 0 reads only inputs and constants; level k's inputs come from < k.

        With ``ignore_constants``, nodes that compute only from compile-time constants
        (a Constant, a Transpose of a weight) are left out and do not count as a level, so
        siblings whose weights are spelled differently still share a level.
        """
        key = "levels-ignoring-constants" if ignore_constants else "levels"
        cached = self._cached(key)
        if cached is not None:
            return [list(level) for level in cached]  # type: ignore[attr-defined]
        from graphopt.ir.constness import is_constant, is_deterministic

        level_of: dict[int, int] = {}
        levels: list[list[Node]] = []
        constant: set[int] = set()
        for node in self.topological():
            deps = [d for d in self._dependencies(node) if id(d) not in constant]
            if (
                ignore_constants
                and not deps
                and is_deterministic(node)
                and not any(True for _ in node.subgraphs())
                and all(v is None or is_constant(v) or id(v.producer) in constant for v in node.inputs)
            ):
                constant.add(id(node))
                continue
            level = 1 + max((level_of[id(d)] for d in deps), default=-1)
            level_of[id(node)] = level
            while len(levels) <= level:
                levels.append([])
            levels[level].append(node)
        self._cache[key] = (self._version, levels)
        return [list(level) for level in levels]

    # -- invariants -----------------------------------------------------------
    def verify(self) -> None:
        """Raise :class:`GraphError` if names repeat, a value dangles or uses are inexact."""
        enclosing = list(self.enclosing())[1:]
        self._verify(ChainMap(*({v.name: v for v in g.values()} for g in enclosing)), [g._ids() for g in enclosing])

    def _ids(self) -> set[int]:
        return {id(v) for v in self.values()}

    def _verify(self, outer: ChainMap[str, Value], outer_ids: list[set[int]]) -> None:
        # Bodies get their scope handed down (a chain of the enclosing graphs' tables) rather
        # than rebuilding it from every enclosing graph, which was quadratic in the bodies.
        defined: dict[str, Value] = {}
        for value in self.values():
            if not value.name:
                # ONNX spells an omitted optional output as ''; anything read needs a name.
                if value.uses():
                    raise GraphError(f"{value.uses()[0].node} reads a value that has no name")
                if value.is_used() or value.producer is None:
                    raise GraphError("a graph input, initializer or output has no name")
                continue
            if (value.name in defined and defined[value.name] is not value) or (
                value.name in outer and outer[value.name] is not value
            ):
                raise GraphError(f"duplicate value name {value.name!r}")
            defined[value.name] = value
        scope_ids = [self._ids(), *outer_ids]

        def visible(value: Value) -> bool:
            return any(id(value) in ids for ids in scope_ids)

        for node in self.nodes:
            if node.graph is not self:
                raise GraphError(f"{node} does not know it belongs to this graph")
            for index, read in enumerate(node.inputs):
                if read is None:
                    continue
                if not visible(read):
                    raise GraphError(f"{node} reads {read.name!r}, which is not defined in scope")
                if Use(node, index) not in read._uses:
                    raise GraphError(f"use of {read.name!r} by {node} is not recorded")
            for body in node.subgraphs():
                if body.parent is not node:
                    raise GraphError(f"a body of {node} does not point back to it")
                body._verify(outer.new_child(defined), scope_ids)
        for value in defined.values():
            for use in value.uses():
                if (
                    use.node.graph is None
                    or use.index >= len(use.node.inputs)
                    or use.node.inputs[use.index] is not value
                ):
                    raise GraphError(f"stale use of {value.name!r} by {use.node}")
        for value in self._outputs:
            if not visible(value):
                raise GraphError(f"graph output {value.name!r} is not defined in scope")
        self.topological()


def ancestor_in(node: Node, graph: Graph) -> Node | None:
    """``node`` itself if it is in ``graph``, else the node of ``graph`` whose body holds it."""
    current: Node | None = node
    while current is not None and current.graph is not None:
        if current.graph is graph:
            return current
        current = current.graph.parent
    return None


def _inside(node: Node, owner_ids: set[int]) -> bool:
    """Whether ``node`` sits in the body of one of the nodes whose ids are given."""
    graph = node.graph
    while graph is not None and graph.parent is not None:
        if id(graph.parent) in owner_ids:
            return True
        graph = graph.parent.graph
    return False


def _bodies_in(graph: Graph) -> list[Graph]:
    """The bodies of the nodes of ``graph`` (not those nested deeper), in order."""
    found: list[Graph] = []
    node = graph._head
    while node is not None:
        if node.attributes:
            for attr in node.attributes.values():
                found += attr.graphs()
        node = node._next
    return found


def _capture_uses(node: Node) -> list[tuple[Value, Use]]:
    """The uses by nodes in ``node``'s bodies of values defined outside ``node``."""
    if not node.attributes:
        return []
    return [(read_value(r), r) for body in node.subgraphs() for r in body.free_reads() if isinstance(r, Use)]
