"""How graphopt's passes and rewrite toolkit grow with graph size (a benchmark, not a test).

    python benchmarks/scale.py                      # 10k and 100k nodes
    python benchmarks/scale.py --sizes 10000,100000,1000000

Two tables:

1. Rewrites: a 10,000-node chain, then K rewrites (each rebuilds one node through the
   builder and swaps it in with replace_nodes) for K = 1,000 ... 5,000. Time per rewrite
   stays flat when insertion and removal are O(1).
2. Passes: each pass of the default pipeline, and the whole pipeline, over generated
   graphs of each size and shape (an Identity chain, a wide Sum fan-in, a wide fan-out, a
   chain of nested If bodies): seconds and peak RSS, so growth shows row by row.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.api import optimize, pass_context
from graphopt.ir import Attr, AttrKind, DataType, Graph, Model, Node, TensorType, Value
from graphopt.ir.rewrite import replace_nodes
from graphopt.passes.pipeline import default_pipeline


def _x() -> Value:
    return Value("x", TensorType(DataType.FLOAT, ("N", 4)))


def chain(size: int, op: str = "Identity") -> Model:
    x = _x()
    nodes = [Node(op, [x], ["v0"])]
    for i in range(1, size):
        nodes.append(Node(op, [nodes[-1].outputs[0]], [f"v{i}"]))
    return Model(Graph([x], [nodes[-1].outputs[0]], nodes), opset_imports={"": 18})


def fan_in(size: int) -> Model:
    x = _x()
    nodes = [Node("Relu", [x], [f"r{i}"]) for i in range(size - 1)]
    total = Node("Sum", [n.outputs[0] for n in nodes], ["total"])
    return Model(Graph([x], [total.outputs[0]], [*nodes, total]), opset_imports={"": 18})


def fan_out(size: int) -> Model:
    x = _x()
    shared = Node("Relu", [x], ["shared"])
    nodes = [Node("Neg" if i % 2 else "Abs", [shared.outputs[0]], [f"o{i}"]) for i in range(size - 1)]
    return Model(Graph([x], [n.outputs[0] for n in nodes], [shared, *nodes]), opset_imports={"": 18})


def nested_ifs(size: int) -> Model:
    """Ifs nested ten deep, repeated: each body reads x from the outermost scope."""
    x = _x()
    cond = Value("c", TensorType(DataType.BOOL, ()))
    depth = 10
    nodes: list[Node] = []
    last: Value = x
    for i in range(max(1, size // (2 * depth))):
        inner: Value = last
        body_out = None
        for d in range(depth):
            relu = Node("Relu", [inner], [f"b{i}_{d}"])
            then = Graph([], [relu.outputs[0]], [relu])
            other = Graph([], [inner])
            node = Node(
                "If",
                [cond],
                [f"if{i}_{d}"],
                [Attr("then_branch", AttrKind.GRAPH, then), Attr("else_branch", AttrKind.GRAPH, other)],
            )
            body_out = node
            inner = node.outputs[0]
            nodes.append(node)
        assert body_out is not None
        last = body_out.outputs[0]
    return Model(Graph([x, cond], [last], nodes), opset_imports={"": 18})


SHAPES: dict[str, Callable[[int], Model]] = {
    "identity chain": chain,
    "wide Sum fan-in": fan_in,
    "wide fan-out": fan_out,
    "nested If bodies": nested_ifs,
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rewrites_table(console: Console) -> None:
    table = Table(title="rewrites on a 10,000-node chain (builder + replace_nodes)")
    for column in ("rewrites", "seconds", "µs per rewrite"):
        table.add_column(column, justify="right")
    for count in (1000, 2000, 3000, 4000, 5000):
        model = chain(10_000, "Relu")
        ctx = pass_context()
        names = ctx.names(model)
        targets = model.graph.nodes[:: 10_000 // count][:count]
        start = time.perf_counter()
        for node in targets:
            twin = ctx.builder(model, model.graph, before=node, tag="bench").op("Relu", node.inputs[0])
            replace_nodes([node], {node.outputs[0]: twin}, names)
        seconds = time.perf_counter() - start
        table.add_row(f"{count:,}", f"{seconds:.3f}", f"{seconds / count * 1e6:.1f}")
    console.print(table)


def passes_table(console: Console, sizes: list[int]) -> None:
    passes = default_pipeline().pass_names()
    names = list(dict.fromkeys(passes))
    table = Table(title="seconds per pass (peak RSS of the process after the row)", width=200)
    for column in ("shape", "nodes", *names, "pipeline", "peak RSS MB"):
        table.add_column(column, justify="right")
    for shape, make in SHAPES.items():
        for size in sizes:
            cells = []
            for name in names:
                model = make(size)
                start = time.perf_counter()
                optimize(model, name)
                cells.append(f"{time.perf_counter() - start:.2f}")
            model = make(size)
            start = time.perf_counter()
            optimize(model)
            pipeline = time.perf_counter() - start
            nodes = sum(1 for _ in make(size).all_nodes())
            table.add_row(shape, f"{nodes:,}", *cells, f"{pipeline:.2f}", f"{peak_rss_mb():.0f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="comma list of node counts")
    parser.add_argument("--skip-rewrites", action="store_true")
    args = parser.parse_args()
    console = Console(width=200)
    if not args.skip_rewrites:
        rewrites_table(console)
    passes_table(console, [int(s) for s in args.sizes.split(",")])


if __name__ == "__main__":
    main()
