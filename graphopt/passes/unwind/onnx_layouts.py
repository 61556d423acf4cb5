"""ONNX layouts as a layout problem.

A tensor's *layout* is the memory order of its axes, a permutation ``L``: its data is
stored as ``x.transpose(L)``. An element's mapping is its offset in that buffer, so two
tensors of one shape agree element for element exactly when their layouts are equal.

The problem works on *proxy* tensors: one of shape ``(2,) * rank`` per value, on which
every permutation gives distinct mappings. The row-major layout of each rank is one
shared source (``rowmajor<rank>``), so "row-major" means the same offsets wherever it
appears, and layout ``L`` is that source unwound by a DimShuffle. Per node (main graph
only; :func:`role` is the classification the rewrite shares):

- ``Transpose`` is a DimShuffle: a view, free; it disappears from the rewritten model;
- element-wise ops are SumLike, unwound through their first full-rank non-constant
  input; another non-constant input is paired with it; constant operands are sinks
  (re-laid out offline per use), tied to it or, when they broadcast, to a SumLikeReduce;
- reductions with known axes (``keepdims=0``, and Squeeze) slice their reduced axes
  away, so the output's layout is the input's without them; with ``keepdims=1`` the
  output keeps the input's layout;
- the ops of :data:`per_axis.PER_AXIS_OPS` (Pad, Slice, Resize, Tile, Expand, Concat,
  Split, Gather, Softmax-like, ...) keep their input's layout, their per-axis parameters
  rewritten for it (a Concat's inputs are paired); a per-axis input that is not a
  constant makes the op fixed;
- every other node (Conv, pooling, MatMul, Gemm, reshapes, anything unknown) is a
  FixedPoint: its inputs are paired with the layout the target profile prescribes and
  its outputs have that layout (``onnx``: row-major everywhere; ``nhwc``: channels last
  for convolutions and pooling);
- graph inputs are sources in row-major layout, or sinks with ``allow_input_relayout``;
  a constant read only by Transposes is a sink (re-laid out offline, once); graph
  outputs are paired with row-major (their layout is the interface).

Each pair is worth the value's element count (unknown dims count as 1), split over the
proxy's elements: a failed pair is a Transpose in the rewritten model, so maximizing the
objective minimizes the Transposes written, weighted by their size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from graphopt.ir import AttrKind, Graph, Model, Node, TensorType, Value, ops
from graphopt.ir.constness import constant_array, is_constant
from graphopt.layout.problem import Problem
from graphopt.layout.solution import Solution
from graphopt.passes.unwind.per_axis import PER_AXIS_OPS, Reading, read_params

__all__ = ["Derivation", "Layout", "Profile", "Role", "derive", "identity", "inverse", "role"]

Layout = tuple[int, ...]
MAX_RANK = 6

UNARY = frozenset(
    [
        "Abs",
        "Acos",
        "Acosh",
        "Asin",
        "Asinh",
        "Atan",
        "Atanh",
        "Cast",
        "Ceil",
        "Celu",
        "Cos",
        "Cosh",
        "Elu",
        "Erf",
        "Exp",
        "Floor",
        "Gelu",
        "HardSigmoid",
        "HardSwish",
        "Identity",
        "IsInf",
        "IsNaN",
        "LeakyRelu",
        "Log",
        "Mish",
        "Neg",
        "Not",
        "Reciprocal",
        "Relu",
        "Round",
        "Selu",
        "Sigmoid",
        "Sign",
        "Sin",
        "Sinh",
        "Softplus",
        "Softsign",
        "Sqrt",
        "Tan",
        "Tanh",
        "ThresholdedRelu",
    ]
)
# Clip is here on purpose: its min / max are scalars, so it takes the layout of its data as a
# broadcasting op does. The integer bit ops never were: adding them could change the layouts
# chosen for a model that has them; kept as it was.
BROADCASTING = (ops.BROADCASTING - frozenset(ops.BITWISE)) | {"Clip"}
REDUCTIONS = frozenset(
    [
        "ReduceMean",
        "ReduceSum",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
    ]
)
# The opset from which each reduction (and Squeeze, a reduction of unit axes without
# keepdims) reads its axes from an input rather than an attribute.
_AXES_INPUT_FROM = {op: 13 if op == "ReduceSum" else 18 for op in REDUCTIONS} | {"Squeeze": 13}
# Ops whose data input and output a channels-last profile prescribes as NHWC.
SPATIAL = frozenset(
    [
        "Conv",
        "ConvTranspose",
        "MaxPool",
        "AveragePool",
        "LpPool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "GlobalLpPool",
        "BatchNormalization",
        "InstanceNormalization",
        "LRN",
    ]
)
# The layouts a target wants at Conv, pooling, MatMul and Gemm.
Profile = Literal["onnx", "nhwc"]


def identity(rank: int) -> Layout:
    return tuple(range(rank))


def inverse(layout: Layout) -> Layout:
    result = [0] * len(layout)
    for position, axis in enumerate(layout):
        result[axis] = position
    return tuple(result)


@dataclass(frozen=True)
class Role:
    """How a node relates its inputs' layouts to its outputs' (see the module docstring).

    ``kind`` is transpose, elementwise, reduce, per_axis or fixed; ``unwind`` the input
    whose layout an element-wise output takes; ``axes``/``keepdims`` a reduction's;
    ``params`` a per-axis op's parameters as read.
    """

    kind: str
    unwind: int = 0
    axes: tuple[int, ...] = ()
    keepdims: bool = True
    params: tuple[Reading, ...] = ()


def rank_of(value: Value | None, ranks: dict[Value, int]) -> int | None:
    if value is None:
        return None
    if value in ranks:
        return ranks[value]
    if isinstance(value.type, TensorType) and value.type.shape is not None:
        return len(value.type.shape)
    return None


def role(node: Node, ranks: dict[Value, int], opset: int) -> Role:
    """Classify ``node``; anything not understood exactly is ``fixed``."""
    fixed = Role("fixed")
    if not node.in_standard_domain or any(True for _ in node.subgraphs()):
        return fixed
    op = node.op_type
    if op in PER_AXIS_OPS:
        return _per_axis_role(node, ranks, opset)
    out_rank = rank_of(node.outputs[0], ranks) if len(node.outputs) == 1 else None
    if out_rank is None or not 1 <= out_rank <= MAX_RANK:
        return fixed
    data = [v for v in node.inputs if v is not None]
    if op == "Transpose":
        perm = node.attributes.get("perm")
        if perm is not None and (perm.kind != AttrKind.INTS or sorted(perm.value) != list(range(out_rank))):
            return fixed
        return Role("transpose") if rank_of(node.input(0), ranks) == out_rank else fixed
    if op in UNARY or op in BROADCASTING:
        unwind = next(
            (
                index
                for index, value in enumerate(node.inputs)
                if value is not None and not is_constant(value) and rank_of(value, ranks) == out_rank
            ),
            None,
        )
        if unwind is None:
            return fixed
        for value in data:
            rank = rank_of(value, ranks)
            if rank is None or (not is_constant(value) and rank not in (0, out_rank)) or rank > out_rank:
                return fixed
        return Role("elementwise", unwind=unwind)
    in_rank = rank_of(node.inputs[0], ranks) if node.inputs else None
    if op in _AXES_INPUT_FROM and in_rank is not None:
        axes = _reduce_axes(node, opset, in_rank)
        if axes is None:
            return fixed
        keepdims = op != "Squeeze" and bool(node.attr("keepdims", 1))
        return (
            Role("reduce", axes=axes, keepdims=keepdims)
            if out_rank == (in_rank if keepdims else in_rank - len(axes))
            else fixed
        )
    return fixed


def _per_axis_role(node: Node, ranks: dict[Value, int], opset: int) -> Role:
    """A per-axis op keeps its input's rank and layout when its parameters can be rewritten."""
    spec = PER_AXIS_OPS[node.op_type]
    rank = rank_of(node.input(0), ranks)
    if opset < spec.since or rank is None or not 1 <= rank <= MAX_RANK:
        return Role("fixed")
    data = [node.input(index) for index in spec.data_inputs(node)]
    if any(rank_of(v, ranks) != rank for v in [*data, *node.outputs]):
        return Role("fixed")
    params = read_params(node, rank)
    return Role("fixed") if params is None else Role("per_axis", params=params)


def _reduce_axes(node: Node, opset: int, rank: int) -> tuple[int, ...] | None:
    if opset >= _AXES_INPUT_FROM[node.op_type]:
        if len(node.inputs) < 2 or node.inputs[1] is None:
            return None  # all axes, or none with noop_with_empty_axes: leave it to the fixed path
        array = constant_array(node.inputs[1])
        if array is None:
            return None
        axes = [int(a) for a in array.ravel()]
    else:
        listed = node.attr("axes")
        if listed is None:
            return None
        axes = [int(a) for a in listed]
    if not axes or not all(-rank <= a < rank for a in axes):
        return None
    normalized = sorted({a % rank for a in axes})
    return tuple(normalized) if len(normalized) == len(axes) else None


def infer_ranks(graph: Graph) -> dict[Value, int]:
    """Ranks of the values whose types leave them out, for the ops the derivation reads."""
    ranks: dict[Value, int] = {}
    for node in graph.topological():
        rank = _output_rank(node, ranks)
        for value in node.outputs if node.op_type in PER_AXIS_OPS else node.outputs[:1]:
            if rank_of(value, ranks) is None and rank is not None:
                ranks[value] = rank
    return ranks


def _output_rank(node: Node, ranks: dict[Value, int]) -> int | None:
    if not node.in_standard_domain or not node.inputs:
        return None
    op = node.op_type
    first = rank_of(node.inputs[0], ranks)
    inputs = [rank_of(v, ranks) for v in node.inputs if v is not None]
    if not inputs:
        return None
    if op in UNARY or op in BROADCASTING:
        return None if any(r is None for r in inputs) else max(r for r in inputs if r is not None)
    if op in SPATIAL or op in ("Transpose", "Dropout"):
        return first
    if op in PER_AXIS_OPS and op not in ("Gather", "Expand") and node.attr("keepdims", 1):  # ArgMax's
        return first
    if op in REDUCTIONS and first is not None and not node.attr("keepdims", 1):
        listed = node.attr("axes")
        return first - len(listed) if listed is not None else None
    if op in REDUCTIONS:
        return first if node.attr("keepdims", 1) else None
    if op == "MatMul" and None not in inputs and min(r for r in inputs if r is not None) >= 2:
        return max(r for r in inputs if r is not None)
    if op == "Gemm" or op == "Flatten":
        return 2
    return None


def _elements(value: Value) -> int:
    if isinstance(value.type, TensorType) and value.type.shape is not None:
        return math.prod(d if isinstance(d, int) and d > 0 else 1 for d in value.type.shape)
    return 1


def prescribed(node: Node, rank: int, profile: Profile) -> Layout:
    """The layout the profile wants for a fixed node's data input and outputs."""
    if profile == "nhwc" and node.op_type in SPATIAL and rank >= 3:
        return (0, *range(2, rank), 1)
    return identity(rank)


@dataclass
class Derivation:
    """The problem derived from a graph, and what the rewrite needs to read its answer."""

    problem: Problem
    ranks: dict[Value, int]
    roles: dict[Node, Role]
    # Graph inputs and constants whose layout the solver chooses, by their problem tensor.
    sinks: dict[Value, str] = field(default_factory=dict)

    def sink_layouts(self, solution: Solution) -> dict[Value, Layout]:
        """Each chosen sink's layout; a sink the solver left (partly) fresh stays row-major."""
        labels = self.problem.labels_of(solution.labels)
        layouts: dict[Value, Layout] = {}
        for value, tensor in self.sinks.items():
            rank = len(self.problem.shapes[tensor])
            mapped = labels[self.problem.ref[tensor]]
            layouts[value] = _layout_of(self.problem, mapped, rank) or identity(rank)
        return layouts


def _layout_of(problem: Problem, mapped: np.ndarray, rank: int) -> Layout | None:
    """The layout whose mappings ``mapped`` are, or None if they are not one."""
    base = problem.base.get(f"rowmajor{rank}")
    if base is None:
        return None
    offsets = mapped - base
    if offsets.min() < 0 or offsets.max() >= 2**rank:
        return None
    coordinates = np.array(np.unravel_index(offsets.ravel(), (2,) * rank)).T.reshape(*(2,) * rank, rank)
    origin = coordinates[(0,) * rank]
    taken: list[int] = []
    for axis in range(rank):
        step = coordinates[tuple(1 if k == axis else 0 for k in range(rank))] - origin
        moved = np.nonzero(step)[0]
        if len(moved) != 1 or step[moved[0]] != 1:
            return None
        taken.append(int(moved[0]))
    if sorted(taken) != list(range(rank)):
        return None
    expected = np.arange(2**rank).reshape((2,) * rank).transpose(taken)
    return inverse(tuple(taken)) if np.array_equal(offsets, expected) else None


def derive(model: Model, profile: Profile = "onnx", allow_input_relayout: bool = False) -> Derivation:
    graph = model.graph
    ranks = infer_ranks(graph)
    problem = Problem()
    tensors: dict[Value, str] = {}
    derivation = Derivation(problem, ranks, {})
    names = iter(range(1 << 62))

    def layout_tensor(layout: Layout) -> str:
        rank = len(layout)
        if f"rowmajor{rank}" not in problem.shapes:
            problem.source((2,) * rank, f"rowmajor{rank}")
        if layout == identity(rank):
            return f"rowmajor{rank}"
        name = f"layout{list(layout)}"
        if name not in problem.shapes:
            problem.dim_shuffle(f"rowmajor{rank}", inverse(layout), name)
        return name

    def fresh(label: str) -> str:
        return f"{label}#{next(names)}"

    def weight(value: Value) -> float:
        return _elements(value) / 2 ** ranks_or(value)

    def ranks_or(value: Value) -> int:
        rank = rank_of(value, ranks)
        assert rank is not None
        return rank

    def known(value: Value | None) -> str | None:
        """The value's problem tensor, adding a row-major source for values from outside."""
        if value is None:
            return None
        rank = rank_of(value, ranks)
        if rank is None or not 1 <= rank <= MAX_RANK:
            return None
        if value not in tensors:
            tensors[value] = problem.identity(layout_tensor(identity(rank)), fresh(value.name))
        return tensors[value]

    for given in graph.inputs:
        rank = rank_of(given, ranks)
        relayable = given.const is None and not given.is_graph_output  # a default would move too
        if allow_input_relayout and relayable and rank is not None and 2 <= rank <= MAX_RANK:
            tensors[given] = problem.sink((2,) * rank, fresh(given.name))
            derivation.sinks[given] = tensors[given]
    constants = [*graph.initializers.values(), *(n.outputs[0] for n in graph if n.op_type == "Constant")]
    for constant in constants:
        rank = rank_of(constant, ranks)
        readers = {use.node.op_type for use in constant.uses()}
        only_transposed = readers == {"Transpose"} and not constant.is_graph_output and is_constant(constant)
        if only_transposed and rank is not None and 2 <= rank <= MAX_RANK:
            tensors[constant] = problem.sink((2,) * rank, fresh(constant.name))
            derivation.sinks[constant] = tensors[constant]

    for node in graph.topological():
        node_role = role(node, ranks, model.opset)
        derivation.roles[node] = node_role
        ins = [known(v) for v in node.inputs]
        out = node.outputs[0] if node.outputs else None
        if node_role.kind == "transpose" and ins[0] is not None and out is not None:
            perm = node.attr("perm", list(reversed(range(ranks_or(out)))))
            tensors[out] = problem.dim_shuffle(ins[0], perm, fresh(out.name))
        elif node_role.kind == "elementwise" and out is not None:
            main = ins[node_role.unwind]
            assert main is not None
            operands = [main]
            for index, value in enumerate(node.inputs):
                tensor = ins[index]
                if index == node_role.unwind or tensor is None or value is None:
                    continue
                if not is_constant(value):
                    problem.pair(tensor, main, weight(value))
                    operands.append(tensor)
                    continue
                rank = ranks_or(value)
                use = problem.sink((2,) * rank, fresh(f"{value.name}@{node.name or node.op_type}"))
                tied = main if rank == ranks_or(out) else problem.sum_like_reduce(main, (2,) * rank, fresh("reduce"))
                problem.pair(use, tied, weight(value))
                operands.append(use)
            tensors[out] = problem.sum_like(operands, 0, fresh(out.name))
        elif node_role.kind == "reduce" and ins[0] is not None and out is not None:
            rank = ranks_or(node.inputs[0]) if node.inputs[0] is not None else 0
            if node_role.keepdims:
                tensors[out] = problem.identity(ins[0], fresh(out.name))
            else:
                ends = [1 if axis in node_role.axes else 2 for axis in range(rank)]
                kept = problem.slice(ins[0], [0] * rank, ends, None, fresh("kept"))
                tensors[out] = problem.reshape(kept, (2,) * (rank - len(node_role.axes)), fresh(out.name))
        elif node_role.kind == "per_axis" and ins[0] is not None:
            first = ins[0]
            for index in PER_AXIS_OPS[node.op_type].data_inputs(node)[1:]:
                value, tensor = node.inputs[index], ins[index]
                if tensor is not None and value is not None and not is_constant(value):  # a constant is re-laid out
                    problem.pair(tensor, first, weight(value))
            for value in node.outputs:
                tensors[value] = problem.identity(first, fresh(value.name))
        else:
            if node_role.kind != "fixed":
                derivation.roles[node] = Role("fixed")
            for index, (value, tensor) in enumerate(zip(node.inputs, ins)):
                if tensor is not None and value is not None:
                    want = prescribed(node, ranks_or(value), profile if index == 0 else "onnx")
                    problem.pair(tensor, layout_tensor(want), weight(value))
            for value in node.outputs:
                rank = rank_of(value, ranks)
                if rank is not None and 1 <= rank <= MAX_RANK and value not in derivation.sinks:
                    tensors[value] = problem.identity(layout_tensor(prescribed(node, rank, profile)), fresh(value.name))
    for value in graph.outputs:
        tensor = known(value)
        if tensor is not None:
            problem.pair(tensor, layout_tensor(identity(ranks_or(value))), weight(value))
    return derivation
