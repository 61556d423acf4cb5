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

from graphopt.ir.slicing import slice_of

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


# -- shape plumbing through grids -------------------------------------------------------------------

PLUMBING_KINDS = ["reshape", "transpose", "slice", "concat", "binary", "where", "mod", "div", "gather"]
_INT64_EXTREMES = [-(2**63), 2**63 - 1]


@st.composite
def random_plumbing_models(draw: st.DrawFn) -> onnx.ModelProto:
    """Shape plumbing as exporters write it, past vectors: the dims of x [N, a, b] (N symbolic) and
    some numbers, through 1-5 steps of Reshape to another grid, Transpose, Slice (any axis, steps of
    either sign), Concat with a constant along any axis, a broadcast Add / Sub / Mul, Mod and Div by a
    positive number, a Where on a comparison, and Gather, then flattened into the int64 output y. Slice bounds
    run past both ends (and to the int64 extremes), where ONNX's clamping differs from Python's."""
    builder = _Builder(draw)
    inner = draw(st.lists(st.sampled_from([2, 3, 4, 5]), min_size=2, max_size=2))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *inner])
    dims = builder.fresh("s")
    builder.nodes.append(helper.make_node("Shape", ["x"], [dims], name=builder.fresh("n")))
    numbers = np.array(draw(st.lists(st.integers(-6, 9), min_size=1, max_size=9)), np.int64)
    value = builder.fresh("s")
    builder.nodes.append(
        helper.make_node("Concat", [dims, builder.const(numbers)], [value], name=builder.fresh("n"), axis=0)
    )
    grid = np.zeros(3 + numbers.size)  # only its shape is followed
    for _ in range(draw(st.integers(1, 5))):
        value, grid = _plumbing_step(builder, draw, value, grid)
    flat = builder.add("Reshape", [value, builder.const(np.array([-1], np.int64))], (grid.size,))
    y = helper.make_tensor_value_info(flat, TensorProto.INT64, [grid.size])
    graph = helper.make_graph(builder.nodes, "plumbing", [x], [y], list(builder.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model


def _plumbing_step(builder: _Builder, draw: st.DrawFn, value: str, grid: np.ndarray) -> tuple[str, np.ndarray]:
    kind = draw(st.sampled_from(PLUMBING_KINDS))

    def small(shape: list[int]) -> np.ndarray:
        size = int(np.prod(shape))
        return np.array(draw(st.lists(st.integers(-4, 6), min_size=size, max_size=size)), np.int64).reshape(shape)

    if kind == "reshape":
        shape = draw(st.sampled_from(_factorizations(grid.size)))
        return builder.add("Reshape", [value, builder.const(np.array(shape, np.int64))], shape), grid.reshape(shape)
    if kind == "transpose" and grid.ndim >= 2:
        if draw(st.booleans()):  # no perm: the dims reversed
            return builder.add("Transpose", [value], ()), grid.transpose()
        perm = draw(st.permutations(range(grid.ndim)))
        return builder.add("Transpose", [value], (), perm=list(perm)), grid.transpose(perm)
    if kind == "slice":
        axis = draw(st.integers(0, grid.ndim - 1))
        size, step = grid.shape[axis], draw(st.sampled_from([1, -1, 2, -2]))
        bound = st.one_of(st.integers(-size - 3, size + 3), st.sampled_from(_INT64_EXTREMES))
        start, end = draw(bound), draw(bound)
        if step < 0 and end == _INT64_EXTREMES[1]:
            return value, grid  # onnxruntime runs it through the first entry, the standard stops short
        cut = [slice(None)] * grid.ndim
        cut[axis] = slice_of(start, end, step, size)
        if grid[tuple(cut)].size == 0:
            return value, grid
        negative_axis = axis - grid.ndim if draw(st.booleans()) else axis
        bounds = [builder.const(np.array([v], np.int64)) for v in (start, end, negative_axis, step)]
        return builder.add("Slice", [value, *bounds], ()), grid[tuple(cut)]
    if kind == "concat" and grid.size <= 32:
        axis = draw(st.integers(0, grid.ndim - 1))
        shape = list(grid.shape)
        shape[axis] = draw(st.integers(1, 2))
        joined = builder.add("Concat", [value, builder.const(small(shape))], (), axis=axis)
        return joined, np.concatenate([grid, np.zeros(shape)], axis=axis)
    if kind in ("binary", "where"):
        shape = [d if draw(st.booleans()) else 1 for d in grid.shape]
        operands = [value, builder.const(small(shape))]
        if draw(st.booleans()):
            operands.reverse()
        if kind == "binary":
            return builder.add(draw(st.sampled_from(["Add", "Sub", "Mul"])), operands, ()), grid
        cond = builder.add(draw(st.sampled_from(["Greater", "Equal", "Less"])), operands, ())
        return builder.add("Where", [cond, value, builder.const(small([1]))], ()), grid
    if kind in ("mod", "div"):
        divisor = builder.const(np.array(draw(st.integers(1, 5)), np.int64))
        if kind == "mod":
            return builder.add("Mod", [value, divisor], (), fmod=draw(st.sampled_from([0, 1]))), grid
        return builder.add("Div", [value, divisor], ()), grid
    if kind == "gather" and grid.ndim == 1:
        indices = np.array(draw(st.lists(st.integers(-grid.size, grid.size - 1), min_size=1, max_size=6)), np.int64)
        return builder.add("Gather", [value, builder.const(indices)], (), axis=0), grid[indices]
    return value, grid


def _factorizations(size: int) -> list[tuple[int, ...]]:
    """``size`` as a grid of rank 1 to 3."""
    found = [(size,)]
    for a in range(1, size + 1):
        if size % a == 0:
            found.append((a, size // a))
            found += [(a, b, size // a // b) for b in range(1, size // a + 1) if (size // a) % b == 0]
    return found
