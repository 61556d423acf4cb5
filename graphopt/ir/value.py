"""Values: the edges of a graph, with their producer and an exact list of uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphopt.ir.dims import Dim
from graphopt.ir.tensor import SparseTensor, Tensor
from graphopt.ir.types import DataType, TensorType, Type

if TYPE_CHECKING:
    from graphopt.ir.graph import Graph
    from graphopt.ir.node import Node

__all__ = ["Use", "Value", "read_value", "tensor_dtype", "tensor_shape"]


@dataclass(frozen=True, slots=True)
class Use:
    """``node`` reads the value as its input number ``index``."""

    node: Node
    index: int


class Value:
    """One named tensor (or sequence, map, ...) flowing through a graph.

    A value is defined exactly once: as a graph input, an initializer (``const`` is set),
    or an output of a node (``producer`` is set). Its uses are maintained by the mutation
    API of :class:`~graphopt.ir.node.Node` and :class:`~graphopt.ir.graph.Graph`; a node
    inside a subgraph that reads this value is a use like any other, which is how the IR
    makes outer-scope captures visible to every pass. Being a graph output counts as a use.

    ``declared`` is the type the loaded file declared for it (its value_info), kept apart from
    ``type``, which passes refine: the writer declares it again where it still fits (see
    graphopt.passes.shapes.strip).
    """

    __slots__ = (
        "_output_of",
        "_producer",
        "_uses",
        "const",
        "declared",
        "doc_string",
        "graph",
        "index",
        "metadata_props",
        "name",
        "type",
    )

    def __init__(
        self,
        name: str,
        type: Type | None = None,
        const: Tensor | SparseTensor | None = None,
    ) -> None:
        self.name = name
        self.type = type
        self.const = const
        self.declared: Type | None = None
        self.doc_string = ""
        self.metadata_props: dict[str, str] = {}
        self.graph: Graph | None = None
        self.index = 0
        self._producer: Node | None = None
        self._uses: dict[Use, None] = {}
        self._output_of: dict[Graph, int] = {}

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.type})"

    @property
    def producer(self) -> Node | None:
        return self._producer

    def uses(self) -> list[Use]:
        """A copy of the uses, so callers may rewire while they iterate."""
        return list(self._uses)

    @property
    def is_graph_output(self) -> bool:
        return bool(self._output_of)

    def output_of(self) -> list[Graph]:
        """The graphs (this one or subgraph bodies) that return this value."""
        return list(self._output_of)

    def is_used(self) -> bool:
        return bool(self._uses) or bool(self._output_of)

    @property
    def is_graph_input(self) -> bool:
        return self.graph is not None and self._producer is None and self.graph.is_input(self)

    def replace_all_uses_with(self, other: Value, *, outputs: bool = False) -> None:
        """Point every node that reads this value at ``other``.

        A graph output is part of the model's interface: it is redirected (and so renamed)
        only with ``outputs=True``. Passes use :func:`graphopt.ir.rewrite.replace_value`,
        which keeps output names.
        """
        if other is self:
            return
        for use in self.uses():
            use.node.set_input(use.index, other)
        if outputs:
            for graph in self.output_of():
                graph.outputs = [other if v is self else v for v in graph.outputs]

    # Private mutators: only Node and Graph call these, so the use lists stay exact.
    def _add_use(self, use: Use) -> None:
        self._uses[use] = None

    def _remove_use(self, use: Use) -> None:
        self._uses.pop(use, None)

    def _set_producer(self, node: Node | None, index: int) -> None:
        self._producer = node
        self.index = index

    def _count_output(self, graph: Graph, delta: int) -> None:
        count = self._output_of.get(graph, 0) + delta
        if count:
            self._output_of[graph] = count
        else:
            self._output_of.pop(graph, None)


def read_value(read: Use | Value) -> Value:
    """The value a body takes from outside, given as an entry of
    :meth:`~graphopt.ir.graph.Graph.free_reads`: a read by one of its nodes, or an output."""
    if isinstance(read, Value):
        return read
    value = read.node.input(read.index)
    assert value is not None  # free_reads lists only inputs that are set
    return value


def tensor_shape(value: Value | None) -> tuple[Dim, ...] | None:
    """The dims of a tensor value; None when it is no tensor or its rank is unknown."""
    kind = value.type if value is not None else None
    return kind.shape if isinstance(kind, TensorType) else None


def tensor_dtype(value: Value | None) -> DataType | None:
    """The element type of a tensor value; None when it is no tensor."""
    kind = value.type if value is not None else None
    return kind.dtype if isinstance(kind, TensorType) else None
