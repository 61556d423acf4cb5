"""The runtime split: what is constant only at run time moves into a ``runtime_fold`` function.

The form (one model file, still runnable by any ONNX runtime as it is):

- a model-local function ``graphopt.runtime::runtime_fold`` holds the nodes that compute
  from runtime constants (inputs marked ``--const-input``, initializers the caller may
  override) and, with ``--defer-growth``, the folds the size guard refused;
- the main graph calls it once; the call's inputs are graph inputs and initializers
  only, its outputs are the folded tensors, and everything else in the main graph is
  ``entry``.

A plain runtime inlines the function and recomputes it on every run;
:class:`graphopt.runtime.CachedSession` splits the model at the call into two sessions and
runs ``runtime_fold`` once per distinct content of its inputs.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from graphopt.ir import Graph, Model, Node, Value
from graphopt.ir.graph import ancestor_in
from graphopt.ir.model import RUNTIME_DOMAIN, Function
from graphopt.ir.rewrite import Namer, replace_value
from graphopt.passes.constcache.lattice import Constness, Lattice

__all__ = ["split_runtime"]

FOLD_NAME = "runtime_fold"


def split_runtime(model: Model, lattice: Lattice, deferred: Collection[Node], names: Namer) -> dict[str, Any]:
    """Move the main graph's runtime-constant nodes (and ``deferred`` ones) into a new
    ``runtime_fold`` function called once; describe what moved (empty: nothing did)."""
    graph = model.graph
    region = _region(graph, lattice, deferred)
    if not region:
        return {}
    members = {id(n) for n in region}
    inputs = list(dict.fromkeys(v for n in region for v in n.inputs if v is not None and v.producer is None))
    live = [
        v
        for n in region
        for v in n.outputs
        if v.is_graph_output or any(id(ancestor_in(u.node, graph)) not in members for u in v.uses())
    ]
    if not live:
        return {}
    name = names.fresh(FOLD_NAME)
    call = Node(
        name,
        inputs,
        [Value(names.fresh(f"{v.name}_folded"), v.type) for v in live],
        domain=RUNTIME_DOMAIN,
        name=names.fresh(name),
    )
    graph.insert_before(region[0], call)
    for old, new in zip(live, call.outputs, strict=True):
        replace_value(old, new, names)
    graph.remove(region, safe=False)
    body_inputs = {v: Value(names.fresh(f"{v.name}_in"), v.type) for v in inputs}
    for node in region:
        for index, value in enumerate(node.inputs):
            if value in body_inputs:
                node.set_input(index, body_inputs[value])
    body = Graph(list(body_inputs.values()), live, region, name=name)
    model.functions.append(Function(RUNTIME_DOMAIN, name, body, opset_imports=dict(model.opset_imports)))
    model.opset_imports = {**model.opset_imports, RUNTIME_DOMAIN: 1}
    return {"function": name, "nodes": len(region), "inputs": [v.name for v in inputs], "outputs": len(live)}


def _region(graph: Graph, lattice: Lattice, deferred: Collection[Node]) -> list[Node]:
    """Runtime-constant nodes, the deferred ones, and the unfolded constant nodes they read."""
    chosen = {id(n) for n in deferred}
    order = graph.topological()
    for node in order:
        if node.outputs and all(lattice[v] == Constness.RUNTIME_CONST for v in node.outputs):
            chosen.add(id(node))
    for node in reversed(order):
        if id(node) in chosen:
            for value in node.inputs:
                producer = value.producer if value is not None else None
                if producer is not None and all(lattice[v] != Constness.VAR for v in producer.outputs):
                    chosen.add(id(producer))
    # A function body cannot read the main graph's values: keep only nodes whose computed
    # inputs come from the region itself (bodies stay in entry, and so does what reads them).
    admitted: set[int] = set()
    for node in order:
        if (
            id(node) in chosen
            and not any(True for _ in node.subgraphs())
            and all(v is None or v.producer is None or id(v.producer) in admitted for v in node.inputs)
        ):
            admitted.add(id(node))
    return [n for n in order if id(n) in admitted]
