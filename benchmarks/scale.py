"""How graphopt's passes and rewrite toolkit grow with graph size (a benchmark, not a test).

    python benchmarks/scale.py                      # 10k and 100k nodes
    python benchmarks/scale.py --sizes 10000,100000,1000000 --repeat 3

Two tables:

1. Rewrites: a 10,000-node chain, then K rewrites (each rebuilds one node through the
   builder and swaps it in with replace_nodes) for K = 1,000 ... 5,000. Time per rewrite
   stays flat when insertion and removal are O(1).
2. Passes: each pass of the default pipeline, unwind, and the whole pipeline, over
   generated graphs of each size and shape (an Identity chain, a wide Sum fan-in, a wide
   fan-out, a nest of If bodies ten deep, TensorFlow-style Transposes around each Conv):
   the median seconds and the peak RSS of each run, each in a child process of its own (so
   the peak is that run's: the graph, the pass and the rollback snapshot the pipeline
   takes). "model alone" is the child's peak once the graph is built. A run that takes
   longer than --cap seconds is stopped and its cell shows "> cap"; larger graphs of that
   shape are not tried for that column.

    python benchmarks/scale.py --skip-rewrites --sizes 100000 --repeat 5
    python benchmarks/scale.py --skip-rewrites --sizes 1000000 --cap 600
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.api import optimize, pass_context
from graphopt.ir import Attr, AttrKind, DataType, Graph, Model, Node, Tensor, TensorType, Value
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
    """Blocks of Ifs nested ten deep, chained: each then-branch holds a Relu of the value one
    scope out and the next If; each else-branch an Identity of that outer value."""
    x = _x()
    cond = Value("c", TensorType(DataType.BOOL, ()))
    depth = 10
    nodes: list[Node] = []
    last: Value = x
    for i in range(max(1, size // (3 * depth))):
        relus: list[Node] = []
        source = last
        for d in range(depth):
            relus.append(Node("Relu", [source], [f"b{i}_{d}"]))
            source = relus[-1].outputs[0]
        inner: Node | None = None
        for d in reversed(range(depth)):
            relu = relus[d]
            then = Graph(
                [],
                [inner.outputs[0] if inner else relu.outputs[0]],
                [relu, *([inner] if inner else [])],
                name=f"then{i}_{d}",
            )
            keep = Node("Identity", [relu.inputs[0]], [f"e{i}_{d}"])
            other = Graph([], [keep.outputs[0]], [keep], name=f"else{i}_{d}")
            inner = Node(
                "If",
                [cond],
                [f"if{i}_{d}"],
                [Attr("then_branch", AttrKind.GRAPH, then), Attr("else_branch", AttrKind.GRAPH, other)],
            )
        assert inner is not None
        nodes.append(inner)
        last = inner.outputs[0]
    return Model(Graph([x, cond], [last], nodes), opset_imports={"": 18})


def transposed_convs(size: int) -> Model:
    """TensorFlow-style NHWC: Transpose -> Conv -> Transpose -> Relu, repeated (work for unwind)."""
    x = Value("x", TensorType(DataType.FLOAT, (1, 8, 8, 4)))
    weight = Tensor.from_array(np.full((4, 4, 1, 1), 0.25, np.float32), "w")
    w = Value("w", TensorType(DataType.FLOAT, (4, 4, 1, 1)), weight)
    nodes: list[Node] = []
    last = x
    for i in range(max(1, size // 4)):
        to_nchw = Node("Transpose", [last], [f"a{i}"], [Attr("perm", AttrKind.INTS, [0, 3, 1, 2])])
        conv = Node("Conv", [to_nchw.outputs[0], w], [f"c{i}"])
        to_nhwc = Node("Transpose", [conv.outputs[0]], [f"b{i}"], [Attr("perm", AttrKind.INTS, [0, 2, 3, 1])])
        relu = Node("Relu", [to_nhwc.outputs[0]], [f"r{i}"])
        nodes += [to_nchw, conv, to_nhwc, relu]
        last = relu.outputs[0]
    return Model(Graph([x], [last], nodes, [w]), opset_imports={"": 18})


SHAPES: dict[str, Callable[[int], Model]] = {
    "identity chain": chain,
    "wide Sum fan-in": fan_in,
    "wide fan-out": fan_out,
    "nested If bodies": nested_ifs,
    "NHWC Conv chain": transposed_convs,
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


PIPELINE = "pipeline"
# The passes alone, as the table always measured them: no numerics check and no runtime guard (onnxruntime
# loading the model twice is onnxruntime's time, not the engine's).
_PIPELINE_ALONE = {"check": False, "runtime_guard": False}


def measure_cell(shape: str, size: int, passes: str) -> dict[str, float]:
    """In this process: build the graph, run ``passes`` (or the default pipeline) once."""
    optimize(
        SHAPES[shape](100), None if passes == PIPELINE else passes, **_PIPELINE_ALONE
    )  # lazy imports off the clock
    model = SHAPES[shape](size)
    nodes = sum(1 for _ in model.all_nodes())
    gc.collect()
    base = peak_rss_mb()
    start = time.perf_counter()
    result = optimize(model, None if passes == PIPELINE else passes, **_PIPELINE_ALONE)
    seconds = time.perf_counter() - start
    failures = len(result.report["failures"])
    return {"nodes": nodes, "seconds": seconds, "model_mb": base, "peak_mb": peak_rss_mb(), "failures": failures}


@dataclass
class Cell:
    seconds: list[float] = field(default_factory=list)
    peak_mb: float = 0.0
    model_mb: float = 0.0
    nodes: int = 0
    failures: int = 0
    capped: bool = False

    def text(self, cap: float) -> str:
        if self.capped:
            return f"> {cap:.0f} s"
        failed = " FAILED" if self.failures else ""
        return f"{statistics.median(self.seconds):.2f} s / {self.peak_mb:.0f} MB{failed}"


def run_cell(shape: str, size: int, passes: str, repeat: int, cap: float) -> Cell:
    """Each run in a child process of its own, so its peak RSS is the pass's alone."""
    cell = Cell()
    for _ in range(repeat):
        command = [sys.executable, __file__, "--cell", shape, str(size), passes]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=cap, check=True)
        except subprocess.TimeoutExpired:
            cell.capped = True
            return cell
        found = json.loads(done.stdout.strip().splitlines()[-1])
        cell.seconds.append(found["seconds"])
        cell.peak_mb = max(cell.peak_mb, found["peak_mb"])
        cell.model_mb = max(cell.model_mb, found["model_mb"])
        cell.nodes = int(found["nodes"])
        cell.failures += int(found["failures"])
    return cell


COLUMNS = [*dict.fromkeys(default_pipeline().pass_names()), "unwind", PIPELINE]


def passes_table(
    console: Console, sizes: list[int], repeat: int, cap: float, shapes: list[str], names: list[str], markdown: bool
) -> None:
    table = Table(
        title=f"median seconds of {repeat} run(s) / peak RSS, each run in a child process of its own", width=240
    )
    columns = ("shape", "nodes", "model alone", *names)
    for column in columns:
        table.add_column(column, justify="right")
    rows: list[list[str]] = []
    for shape in shapes:
        capped: set[str] = set()
        for size in sizes:
            cells: dict[str, Cell] = {}
            for name in names:
                cells[name] = Cell(capped=True) if name in capped else run_cell(shape, size, name, repeat, cap)
                if cells[name].capped:
                    capped.add(name)  # a larger graph would take longer still
            measured = [c for c in cells.values() if not c.capped]
            nodes = f"{measured[0].nodes:,}" if measured else f"~{size:,}"
            model_mb = f"{max(c.model_mb for c in measured):.0f} MB" if measured else "?"
            rows.append([shape, nodes, model_mb, *(cells[n].text(cap) for n in names)])
            table.add_row(*rows[-1])
            print(f"{shape}, {size:,}: " + ", ".join(f"{n} {c.text(cap)}" for n, c in cells.items()), file=sys.stderr)
    console.print(table)
    if markdown:
        print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
        for row in rows:
            print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="comma list of node counts")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of graph shapes")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma list of passes (and 'pipeline')")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell (the median is shown)")
    parser.add_argument("--cap", type=float, default=300, help="seconds a run may take before the cell is capped")
    parser.add_argument("--skip-rewrites", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="also print the passes table as Markdown")
    parser.add_argument("--cell", nargs=3, metavar=("SHAPE", "SIZE", "PASSES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        shape, size, passes = args.cell
        print(json.dumps(measure_cell(shape, int(size), passes)))
        return
    console = Console(width=240)
    if not args.skip_rewrites:
        rewrites_table(console)
    shapes = [s.strip() for s in args.shapes.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    columns = [c.strip() for c in args.columns.split(",")]
    passes_table(console, sizes, args.repeat, args.cap, shapes, columns, args.markdown)


if __name__ == "__main__":
    main()
