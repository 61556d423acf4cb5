"""The model: opsets, metadata, local functions and the main graph."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from graphopt.ir.graph import Graph
from graphopt.ir.node import Attr, Node

__all__ = ["RUNTIME_DOMAIN", "Function", "Model"]

# The domain of the fold-once function that const-cache writes and graphopt.runtime.CachedSession
# runs: a file-format contract between the two, so it lives with the model, below both.
RUNTIME_DOMAIN = "graphopt.runtime"


@dataclass(eq=False)
class Function:
    """A model-local function; its body's inputs and outputs are untyped values."""

    domain: str
    name: str
    body: Graph
    attributes: list[str] = field(default_factory=list)
    attribute_defaults: dict[str, Attr] = field(default_factory=dict)
    opset_imports: dict[str, int] = field(default_factory=dict)
    overload: str = ""
    doc_string: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.domain, self.name, self.overload)


@dataclass(eq=False)
class Model:
    graph: Graph
    opset_imports: dict[str, int] = field(default_factory=lambda: {"": 21})
    ir_version: int = 10
    producer_name: str = ""
    producer_version: str = ""
    domain: str = ""
    model_version: int = 0
    doc_string: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)
    functions: list[Function] = field(default_factory=list)
    # Fields graphopt does not model (training_info, configuration), kept verbatim by io/
    # as serialized bytes so a round trip does not lose them.
    opaque_fields: dict[str, list[bytes]] = field(default_factory=dict)
    # Free-form JSON sections that later passes attach (the unwind pass's layout problem);
    # kept by the JSON form, ignored by ONNX.
    extensions: dict[str, Any] = field(default_factory=dict)

    @property
    def opset(self) -> int:
        """The default-domain opset version."""
        return self.opset_imports.get("", self.opset_imports.get("ai.onnx", 1))

    def opsets_of(self, graph: Graph) -> dict[str, int]:
        """The opset imports that hold in ``graph``: its function's own, else the model's."""
        top = list(graph.enclosing())[-1]
        for function in self.functions:
            if function.body is top:
                return {**self.opset_imports, **function.opset_imports}
        return dict(self.opset_imports)

    def opset_in(self, graph: Graph, domain: str = "") -> int:
        """The version of ``domain`` imported where ``graph`` is (0: not imported)."""
        imports = self.opsets_of(graph)
        if domain in ("", "ai.onnx"):
            return imports.get("", imports.get("ai.onnx", 0))
        return imports.get(domain, 0)

    def all_graphs(self) -> Iterator[Graph]:
        """The main graph, every nested body, and every function body."""
        yield self.graph
        yield from self.graph.subgraphs()
        for function in self.functions:
            yield function.body
            yield from function.body.subgraphs()

    def all_nodes(self) -> Iterator[Node]:
        for graph in self.all_graphs():
            yield from graph
