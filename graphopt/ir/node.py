"""Nodes (operator applications) and their typed attributes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from graphopt.ir.value import Use, Value, read_value

if TYPE_CHECKING:
    from graphopt.ir.graph import Graph

__all__ = ["CONTRIB_DOMAIN", "QDQ_DOMAINS", "STANDARD_DOMAINS", "Attr", "AttrKind", "Node"]

# The ONNX standard's own domain, under both of its spellings.
STANDARD_DOMAINS = ("", "ai.onnx")
# onnxruntime's contrib ops (its own kernels, such as FusedConv and SkipLayerNormalization).
CONTRIB_DOMAIN = "com.microsoft"
# Where QuantizeLinear and DequantizeLinear have the standard's contract: onnxruntime's own forms take 16- and
# 4-bit integers below opset 21, and quantize_static writes them for 16-bit QDQ (QNN's format).
QDQ_DOMAINS = (*STANDARD_DOMAINS, CONTRIB_DOMAIN)


class AttrKind(IntEnum):
    """Attribute kinds, numbered as in the ONNX standard."""

    UNDEFINED = 0
    FLOAT = 1
    INT = 2
    STRING = 3
    TENSOR = 4
    GRAPH = 5
    FLOATS = 6
    INTS = 7
    STRINGS = 8
    TENSORS = 9
    GRAPHS = 10
    SPARSE_TENSOR = 11
    SPARSE_TENSORS = 12
    TYPE_PROTO = 13
    TYPE_PROTOS = 14


@dataclass
class Attr:
    """One attribute. Strings are ``bytes`` (ONNX strings are byte strings); a ``GRAPH``
    value is a :class:`~graphopt.ir.graph.Graph`. Inside a function body an attribute
    may instead refer to one of the function's own attributes (``ref_attr_name``)."""

    name: str
    kind: AttrKind
    value: Any
    ref_attr_name: str = ""
    doc_string: str = ""

    def graphs(self) -> list[Graph]:
        if self.kind == AttrKind.GRAPH and self.value is not None:
            return [self.value]
        if self.kind == AttrKind.GRAPHS:
            return list(self.value)
        return []


class Node:
    """An operator application. Inputs may be ``None`` for omitted optional inputs.

    Uses are registered while the node belongs to a graph: constructing a node does not
    touch its inputs' use lists, adding it to a graph does, and removing it undoes that.

    ``opaque`` marks an op graphopt has no schema for at the model's opset (set on load):
    passes keep it as it is and reason about nothing through it. It is never written out.
    """

    def __init__(
        self,
        op_type: str,
        inputs: Sequence[Value | None] = (),
        outputs: int | Sequence[str | Value] = 1,
        attributes: Iterable[Attr] = (),
        *,
        domain: str = "",
        name: str = "",
        overload: str = "",
    ) -> None:
        self.op_type = op_type
        self.domain = domain
        self.name = name
        self.overload = overload
        self.doc_string = ""
        self.metadata_props: dict[str, str] = {}
        self.opaque = False
        self.attributes: dict[str, Attr] = {a.name: a for a in attributes}
        self.graph: Graph | None = None
        self._prev: Node | None = None
        self._next: Node | None = None
        self._inputs: list[Value | None] = list(inputs)
        self._inputs_view: tuple[Value | None, ...] | None = None
        if isinstance(outputs, int):
            outputs = [""] * outputs
        self._outputs: list[Value] = [v if isinstance(v, Value) else Value(v) for v in outputs]
        for index, value in enumerate(self._outputs):
            value._set_producer(self, index)
        for attr in self.attributes.values():
            for body in attr.graphs():
                body.parent = self

    @property
    def in_standard_domain(self) -> bool:
        return self.domain in STANDARD_DOMAINS

    def is_qdq(self, op_type: str) -> bool:
        """Whether this is a QuantizeLinear or DequantizeLinear (``op_type``) of the standard's contract."""
        return self.op_type == op_type and self.domain in QDQ_DOMAINS

    def __repr__(self) -> str:
        label = f"{self.domain}::{self.op_type}" if self.domain else self.op_type
        return f"Node({label}, {self.name!r})"

    @property
    def inputs(self) -> tuple[Value | None, ...]:
        # Cached until the next set_input: rules read the inputs of a 200,000-input Sum often.
        if self._inputs_view is None:
            self._inputs_view = tuple(self._inputs)
        return self._inputs_view

    def input(self, index: int) -> Value | None:
        """Input ``index``, or None when it is omitted or past the end (O(1))."""
        return self._inputs[index] if index < len(self._inputs) else None

    @property
    def outputs(self) -> tuple[Value, ...]:
        return tuple(self._outputs)

    def set_input(self, index: int, value: Value | None) -> None:
        old = self._inputs[index]
        if old is value:
            return
        if self.graph is not None:
            if old is not None:
                old._remove_use(Use(self, index))
            if value is not None and self.graph.records_use_of(value):
                value._add_use(Use(self, index))
            self.graph._touch()
        self._inputs[index] = value
        self._inputs_view = None

    def attr(self, name: str, default: Any = None) -> Any:
        attr = self.attributes.get(name)
        return default if attr is None else attr.value

    def subgraphs(self) -> Iterator[Graph]:
        for attr in self.attributes.values():
            yield from attr.graphs()

    def captures(self) -> list[Value]:
        """Values defined outside this node that its subgraphs (at any depth) read."""
        return list(dict.fromkeys(read_value(read) for body in self.subgraphs() for read in body.free_reads()))

    def _register_uses(self) -> None:
        for index, value in enumerate(self._inputs):
            if value is not None:
                value._add_use(Use(self, index))

    def _unregister_uses(self) -> None:
        for index, value in enumerate(self._inputs):
            if value is not None:
                value._remove_use(Use(self, index))
