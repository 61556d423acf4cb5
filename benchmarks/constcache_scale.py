"""const-cache on shape plumbing: time grows linearly with the plumbing (a benchmark, not a test).

    python benchmarks/constcache_scale.py                       # 1,250 ... 10,000 nodes
    python benchmarks/constcache_scale.py --sizes 10000,40000

Each model is a chain of exporter-style blocks over x: [batch, seq, 256]:
Relu -> Shape -> Gather(0), Gather(1) -> Unsqueeze x2 -> Concat(.., [256]) -> Reshape
(8 nodes, 6 of them plumbing). const-cache turns every Reshape target into the constant
[0, 0, 256] and cleanup removes the plumbing; the table shows seconds and microseconds
per node for const-cache and for const-cache + cleanup, which stay flat when the work is
linear.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.api import optimize
from graphopt.ir import DataType, Graph, Model, Node, Sym, Tensor, TensorType, Value
from graphopt.ir.rewrite import attribute

BLOCK = 8


def plumbing_model(nodes: int) -> Model:
    x = Value("x", TensorType(DataType.FLOAT, (Sym("batch"), Sym("seq"), 256)))

    def constant(name: str, values: list[int] | int) -> Value:
        array = np.asarray(values, dtype=np.int64)
        return Value(name, TensorType(DataType.INT64, array.shape), Tensor.from_array(array, name))

    inits = [constant("i0", 0), constant("i1", 1), constant("axis", [0]), constant("hidden", [256])]
    i0, i1, axis, hidden = inits
    body: list[Node] = []
    h = x
    for k in range(nodes // BLOCK):
        relu = Node("Relu", [h], [f"r{k}"])
        shape = Node("Shape", [relu.outputs[0]], [f"s{k}"])
        g0 = Node("Gather", [shape.outputs[0], i0], [f"g0_{k}"])
        g1 = Node("Gather", [shape.outputs[0], i1], [f"g1_{k}"])
        u0 = Node("Unsqueeze", [g0.outputs[0], axis], [f"u0_{k}"])
        u1 = Node("Unsqueeze", [g1.outputs[0], axis], [f"u1_{k}"])
        concat = Node("Concat", [u0.outputs[0], u1.outputs[0], hidden], [f"c{k}"], [attribute("axis", 0)])
        reshape = Node("Reshape", [relu.outputs[0], concat.outputs[0]], [f"h{k}"])
        body += [relu, shape, g0, g1, u0, u1, concat, reshape]
        h = reshape.outputs[0]
    return Model(Graph([x], [h], body, inits), opset_imports={"": 18})


def measure(nodes: int, passes: str) -> tuple[float, int]:
    model = plumbing_model(nodes)
    optimize(model, "shape-infer", verify=False, check=False)
    start = time.perf_counter()
    optimize(model, passes, verify=False, check=False)
    return time.perf_counter() - start, len(model.graph)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1250,2500,5000,10000", help="comma list of node counts")
    args = ap.parse_args(argv)
    table = Table(title="const-cache on shape plumbing")
    for column in ("nodes", "const-cache s", "us/node", "+ cleanup s", "us/node", "nodes after"):
        table.add_column(column, justify="right")
    for size in (int(s) for s in args.sizes.split(",")):
        alone, _ = measure(size, "const-cache")
        both, left = measure(size, "const-cache,noop,dce,cse")
        table.add_row(
            str(size), f"{alone:.3f}", f"{1e6 * alone / size:.1f}", f"{both:.3f}", f"{1e6 * both / size:.1f}", str(left)
        )
    Console().print(table)


if __name__ == "__main__":
    main()
