"""Compile-time folding of maximal constant regions, under size guards.

A region is a connected set of nodes of one graph whose outputs are all COMPILE_CONST.
It is evaluated once (``ctx.evaluator``), and its live outputs (those read outside it,
or graph outputs) become initializers. The guards, on bytes stored in the file:

- net growth: bytes of the new initializers minus bytes of the initializers that die with
  the region, at most ``max_growth_bytes`` per region;
- no new tensor over ``max_tensor_bytes``;
- the whole model grows by at most what is left of its growth budget.

A region that breaks a guard keeps its largest prefix (in topological order) that fits;
the sizes come from the values' types (static once constants are known), so choosing the
prefix costs one linear scan and nothing is evaluated twice. Every refused region is
reported with its reason and byte figures.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphopt.facts import fully_known
from graphopt.ir import Graph, Node, TensorType, Value
from graphopt.ir.graph import ancestor_in
from graphopt.ir.rewrite import Namer
from graphopt.passes.constcache.constants import replace_by_constant
from graphopt.passes.constcache.lattice import Constness, Lattice

if TYPE_CHECKING:  # the evaluator reaches passes through the context only
    from graphopt.evaluate import Evaluator

__all__ = ["Guards", "RegionFolder", "regions"]


@dataclass
class Guards:
    max_growth_bytes: int
    max_tensor_bytes: int
    # Bytes the model may still grow by (shrinking folds give bytes back).
    budget: int


@dataclass
class RegionFolder:
    """Folds the regions of graphs, recording what it folded and what it refused."""

    evaluator: Evaluator
    guards: Guards
    names: Namer
    typer: Callable[[Node], None]
    folded_nodes: int = 0
    folded_regions: int = 0
    refused: list[dict[str, Any]] = field(default_factory=list)
    # Nodes of the main graph left unfolded because they would grow the file.
    grew: list[Node] = field(default_factory=list)
    # Whether a folded value feeds a node whose output type is incomplete: the fold may
    # make that type known (a Pad's output size, once its pads are constant).
    retype: bool = False

    def graph(self, graph: Graph, lattice: Lattice, opsets: Mapping[str, int]) -> None:
        for region in regions(graph, lattice):
            self.region(graph, region, opsets)

    def region(self, graph: Graph, region: list[Node], opsets: Mapping[str, int]) -> None:
        for node in region:
            if any(v.type is None for v in node.outputs):
                self.typer(node)
        scan = _PrefixScan(graph, region, self.guards)
        kept = scan.best
        if kept < len(region):
            self._refuse(graph, region, kept, scan)
        if kept == 0:
            return
        prefix = region[:kept]
        live = scan.live(kept)
        try:
            arrays = self.evaluator.evaluate(prefix, {}, live, opsets)
        except Exception as err:  # any failure to evaluate means: leave the region as it is
            self.refused.append(_record(graph, region, 0, f"evaluation failed: {err}", scan.figures(len(region))))
            return
        if any(not _fits_type(v, arrays[v]) for v in live):
            self.refused.append(_record(graph, region, 0, "a result differs from its declared type", {}))
            return
        for value in live:
            self.retype |= any(not fully_known(v.type) for use in value.uses() for v in use.node.outputs)
            replace_by_constant(value, arrays[value], self.names)
        graph.remove(prefix)
        self.guards.budget -= scan.net(kept)
        self.folded_nodes += kept
        self.folded_regions += 1

    def _refuse(self, graph: Graph, region: list[Node], kept: int, scan: _PrefixScan) -> None:
        reason = scan.reason(len(region))
        self.refused.append(_record(graph, region, kept, reason, scan.figures(len(region))))
        if graph.parent is None and reason != "an output's size is unknown":
            self.grew.extend(region[kept:])


def _record(graph: Graph, region: list[Node], kept: int, reason: str, figures: dict[str, int]) -> dict[str, Any]:
    first = region[0]
    return {
        "graph": graph.name or "main",
        "first_node": first.name or first.outputs[0].name,
        "ops": dict(Counter(n.op_type for n in region)),
        "nodes": len(region),
        "folded_prefix": kept,
        "reason": reason,
        **figures,
    }


def _fits_type(value: Value, array: Any) -> bool:
    declared = value.type
    if not isinstance(declared, TensorType):
        return True
    try:
        return bool(declared.dtype.numpy() == array.dtype)
    except TypeError:
        return False


def regions(graph: Graph, lattice: Lattice, level: Constness = Constness.COMPILE_CONST) -> list[list[Node]]:
    """Connected sets of nodes of ``graph`` whose outputs are all at ``level``, each in
    topological order; a lone ``Constant`` is no region (it is one already)."""
    order = [n for n in graph.topological() if n.outputs and all(lattice[v] == level for v in n.outputs)]
    members = {id(n) for n in order}
    parent: dict[int, int] = {id(n): id(n) for n in order}

    def root(key: int) -> int:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for node in order:
        for value in node.outputs:
            for use in value.uses():
                reader = ancestor_in(use.node, graph)
                if reader is not None and id(reader) in members:
                    parent[root(id(reader))] = root(id(node))
    grouped: dict[int, list[Node]] = {}
    for node in order:
        grouped.setdefault(root(id(node)), []).append(node)
    return [r for r in grouped.values() if not (len(r) == 1 and r[0].op_type == "Constant")]


def value_bytes(value: Value) -> int | None:
    """Bytes of a value whose type has a static shape, else None."""
    kind = value.type
    if not isinstance(kind, TensorType) or kind.shape is None or not all(isinstance(d, int) for d in kind.shape):
        return None
    count = math.prod(d for d in kind.shape if isinstance(d, int))
    return (count * kind.dtype.itemsize_bits + 7) // 8


class _PrefixScan:
    """Net bytes, largest new tensor and unknown sizes of every prefix of a region, in one pass."""

    def __init__(self, graph: Graph, region: list[Node], guards: Guards) -> None:
        self.region = region
        self.guards = guards
        position = {id(n): i for i, n in enumerate(region)}
        # For every value the region produces or reads: the region positions of its readers,
        # and whether something outside the region reads it too.
        self._readers: dict[Value, Counter[int]] = {}
        self._outside: set[Value] = set()
        for node in region:
            for value in [*node.outputs, *_reads(node)]:
                if value in self._readers:
                    continue
                readers: Counter[int] = Counter()
                for use in value.uses():
                    reader = ancestor_in(use.node, graph)
                    index = position.get(id(reader)) if reader is not None else None
                    if index is None:
                        self._outside.add(value)
                    else:
                        readers[index] += 1
                if value.is_graph_output or value.is_graph_input:
                    self._outside.add(value)
                self._readers[value] = readers
        self.new: list[int] = [0]
        self.dying: list[int] = [0]
        self.unknown: list[int] = [0]
        self.over_cap: list[int] = [0]
        self._scan()
        self.best = max((k for k in range(len(region) + 1) if self._fits(k)), default=0)

    def _scan(self) -> None:
        pending = {v: r.total() for v, r in self._readers.items()}
        produced: set[Value] = set()
        new = dying = unknown = over = 0
        for index, node in enumerate(self.region):
            for value in node.outputs:
                produced.add(value)
                if pending[value] or value in self._outside:
                    size = value_bytes(value)
                    new, unknown, over = self._account(size, new, unknown, over, +1)
            for value in dict.fromkeys(_reads(node)):
                pending[value] -= self._readers[value][index]
                if pending[value] or value in self._outside:
                    continue
                size = value_bytes(value)
                if value in produced:
                    new, unknown, over = self._account(size, new, unknown, over, -1)
                elif value.const is not None and size is not None:
                    dying += size
            self.new.append(new)
            self.dying.append(dying)
            self.unknown.append(unknown)
            self.over_cap.append(over)

    def _account(self, size: int | None, new: int, unknown: int, over: int, sign: int) -> tuple[int, int, int]:
        if size is None:
            return new, unknown + sign, over
        return new + sign * size, unknown, over + sign * (size > self.guards.max_tensor_bytes)

    def net(self, k: int) -> int:
        return self.new[k] - self.dying[k]

    def _fits(self, k: int) -> bool:
        return self.reason(k) == ""

    def reason(self, k: int) -> str:
        """Why folding the first ``k`` nodes is refused ("" when it is not)."""
        if self.unknown[k]:
            return "an output's size is unknown"
        if self.over_cap[k]:
            return f"a new tensor would exceed max_tensor_bytes ({self.guards.max_tensor_bytes})"
        if self.net(k) > self.guards.max_growth_bytes:
            return f"net growth {self.net(k)} bytes exceeds max_growth_bytes ({self.guards.max_growth_bytes})"
        if self.net(k) > max(self.guards.budget, 0):
            return f"net growth {self.net(k)} bytes exceeds what is left of the model's growth budget"
        return ""

    def figures(self, k: int) -> dict[str, int]:
        return {"new_bytes": self.new[k], "freed_bytes": self.dying[k], "net_bytes": self.net(k)}

    def live(self, k: int) -> list[Value]:
        """Outputs of the first ``k`` nodes read after them or outside the region."""
        found = []
        for node in self.region[:k]:
            for value in node.outputs:
                if value in self._outside or any(i >= k for i in self._readers[value]):
                    found.append(value)
        return found


def _reads(node: Node) -> list[Value]:
    reads = [v for v in node.inputs if v is not None]
    if node.attributes and any(True for _ in node.subgraphs()):
        reads += node.captures()
    return reads
