"""Random small valid ONNX graphs for property-based tests, drawn with hypothesis.

A graph is a DAG of 2-12 nodes over float tensors: elementwise ops, MatMul, Transpose,
Reshape, Identity, Concat, Slice, Squeeze/Unsqueeze, Cast round trips, Shape-plumbing
(Shape -> Gather -> Concat -> Reshape), repeated subexpressions and repeated constants.
Every tensor's shape is tracked while drawing, with the first dim either static or the
symbolic "N", the others static or "M", so every drawn op is valid whatever N and M are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

Dim = int | str
UNARY = ["Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Identity"]
BINARY = ["Add", "Sub", "Mul", "Max"]
KINDS = [
    "unary",
    "binary",
    "bias",
    "matmul",
    "transpose",
    "reshape",
    "concat",
    "slice",
    "unsqueeze",
    "cast",
    "plumbing",
    "repeat",
]


@dataclass
class _Builder:
    draw: st.DrawFn
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: dict[str, onnx.TensorProto] = field(default_factory=dict)
    pool: list[tuple[str, tuple[Dim, ...]]] = field(default_factory=list)
    counter: int = 0

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}"

    def const(self, values: np.ndarray) -> str:
        # Constants come from a small set, so identical initializers under two names occur.
        name = self.fresh("c")
        self.inits[name] = numpy_helper.from_array(values, name)
        return name

    def add(self, op: str, inputs: list[str], shape: tuple[Dim, ...], **attrs: object) -> str:
        out = self.fresh("v")
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.fresh("n"), **attrs))
        self.pool.append((out, shape))
        return out

    def pick(self) -> tuple[str, tuple[Dim, ...]]:
        return self.draw(st.sampled_from(self.pool))

    def step(self) -> None:
        kind = self.draw(st.sampled_from(KINDS))
        x, shape = self.pick()
        rank = len(shape)
        if kind == "unary":
            self.add(self.draw(st.sampled_from(UNARY)), [x], shape)
        elif kind == "binary":
            same = [name for name, s in self.pool if s == shape]
            self.add(self.draw(st.sampled_from(BINARY)), [x, self.draw(st.sampled_from(same))], shape)
        elif kind == "bias" and isinstance(shape[-1], int):
            scale = self.draw(st.sampled_from([0.5, 1.0, -2.0]))
            self.add(self.draw(st.sampled_from(BINARY)), [x, self.const(np.full(shape[-1], scale, np.float32))], shape)
        elif kind == "matmul" and isinstance(shape[-1], int):
            width = self.draw(st.sampled_from([3, 4]))
            weight = np.linspace(-1, 1, shape[-1] * width, dtype=np.float32).reshape(shape[-1], width)
            self.add("MatMul", [x, self.const(weight)], (*shape[:-1], width))
        elif kind == "transpose" and rank >= 2:
            perm = self.draw(st.permutations(range(rank)))
            self.add("Transpose", [x], tuple(shape[p] for p in perm), perm=list(perm))
        elif kind == "reshape" and rank >= 2 and all(isinstance(d, int) for d in shape[1:]):
            flat = int(np.prod([int(d) for d in shape[1:]]))
            self.add("Reshape", [x, self.const(np.array([0, -1], np.int64))], (shape[0], flat))
        elif kind == "concat":
            axis = self.draw(st.integers(0, rank - 1))
            if isinstance(shape[axis], int):
                same = [name for name, s in self.pool if s == shape]
                other = self.draw(st.sampled_from(same))
                self.add("Concat", [x, other], (*shape[:axis], 2 * shape[axis], *shape[axis + 1 :]), axis=axis)
        elif kind == "slice" and isinstance(shape[-1], int) and shape[-1] > 1:
            end = self.draw(st.integers(1, shape[-1] - 1))
            starts, ends = self.const(np.array([0], np.int64)), self.const(np.array([end], np.int64))
            self.add("Slice", [x, starts, ends, self.const(np.array([-1], np.int64))], (*shape[:-1], end))
        elif kind == "unsqueeze" and rank < 4:
            axis = self.draw(st.integers(0, rank))
            axes = self.const(np.array([axis], np.int64))
            wide = self.add("Unsqueeze", [x, axes], (*shape[:axis], 1, *shape[axis:]))
            if self.draw(st.booleans()):
                self.add("Squeeze", [wide, self.const(np.array([axis], np.int64))], shape)
        elif kind == "cast":
            via = self.draw(st.sampled_from([TensorProto.FLOAT, TensorProto.DOUBLE]))
            if via == TensorProto.FLOAT:
                self.add("Cast", [x], shape, to=via)
            else:
                wide = self.fresh("v")
                self.nodes.append(helper.make_node("Cast", [x], [wide], name=self.fresh("n"), to=via))
                self.add("Cast", [wide], shape, to=TensorProto.FLOAT)
        elif kind == "plumbing" and rank >= 2 and all(isinstance(d, int) for d in shape[1:]):
            # x.reshape(x.shape[0], -1), the way exporters spell it
            dims = self.fresh("s")
            first = self.fresh("s")
            target = self.fresh("s")
            self.nodes.append(helper.make_node("Shape", [x], [dims], name=self.fresh("n")))
            index = self.const(np.array([0], np.int64))
            self.nodes.append(helper.make_node("Gather", [dims, index], [first], name=self.fresh("n"), axis=0))
            rest = self.const(np.array([-1], np.int64))
            self.nodes.append(helper.make_node("Concat", [first, rest], [target], name=self.fresh("n"), axis=0))
            flat = int(np.prod([int(d) for d in shape[1:]]))
            self.add("Reshape", [x, target], (shape[0], flat))
        elif kind == "repeat" and self.nodes:
            # the same computation again under new names: what cse is for
            node = self.draw(st.sampled_from(self.nodes))
            shape_of = dict(self.pool)
            if len(node.output) == 1 and node.output[0] in shape_of:
                copy = onnx.NodeProto()
                copy.CopyFrom(node)
                copy.name = self.fresh("n")
                del copy.output[:]
                out = self.fresh("v")
                copy.output.append(out)
                self.nodes.append(copy)
                self.pool.append((out, shape_of[node.output[0]]))


@st.composite
def random_models(draw: st.DrawFn) -> onnx.ModelProto:
    """A valid model of 2-12 steps over one or two float inputs."""
    builder = _Builder(draw)
    first = draw(st.sampled_from(["N", 2, 3]))
    inner = tuple(draw(st.lists(st.sampled_from([2, 4, 4, "M"]), min_size=1, max_size=2)))
    inputs = []
    for i in range(draw(st.integers(1, 2))):
        name = f"x{i}"
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [first, *inner]))
        builder.pool.append((name, (first, *inner)))
    steps = draw(st.integers(2, 12))
    while len(builder.nodes) < steps:
        builder.step()
    produced = [p for p in builder.pool if p[0].startswith("v")]
    chosen = [produced[-1], *draw(st.lists(st.sampled_from(produced), max_size=2))]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in dict(chosen).items()]
    graph = helper.make_graph(builder.nodes, "random", inputs, outputs, list(builder.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model
