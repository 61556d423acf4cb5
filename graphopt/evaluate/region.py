"""Running a region of nodes in onnxruntime, with onnx.reference as the fallback.

The region is copied into a small model of its own (its inputs become graph inputs, or
initializers for small integer tensors, so onnx's shape inference can follow the shapes
they carry), written through graphopt.io, and run in ONE session. Before the session,
onnx's shape inference tells what the outputs will weigh wherever it can, so a region that
would exceed the byte budget is refused before anything is allocated.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.reference
import onnxruntime

from graphopt.evaluate.base import EvaluationError, describe
from graphopt.io.onnx_infer import infer_proto
from graphopt.io.onnx_write import to_proto
from graphopt.ir import Attr, AttrKind, DataType, Graph, Model, Node, Tensor, TensorType, Value
from graphopt.ir.clone import clone_graph

__all__ = ["OutOfTime", "run_region"]

# Integer inputs this small are embedded as initializers: they are shapes, axes and indices.
_EMBEDDED_ELEMENTS = 64


def run_region(
    nodes: Sequence[Node],
    feeds: Mapping[Value, np.ndarray],
    outputs: Sequence[Value],
    opsets: Mapping[str, int],
    budget_left: int,
    seconds: float,
) -> list[np.ndarray]:
    """The arrays of ``outputs``, computed by ``nodes`` (in topological order) from ``feeds``;
    a session still running after ``seconds`` is stopped (EvaluationError)."""
    model, arrays = _extract(nodes, feeds, outputs, opsets)
    proto = to_proto(model)
    expected = _inferred_bytes(proto)
    if expected > budget_left:
        raise EvaluationError(
            f"{_label(nodes)}: its outputs would take {expected} bytes, over the {budget_left} bytes left in the budget"
        )
    names = [v.name for v in model.graph.outputs]
    try:
        session = onnxruntime.InferenceSession(
            proto.SerializeToString(), _options(), providers=["CPUExecutionProvider"]
        )
        results = _run_for(session, names, arrays, seconds)
    except _Terminated:
        raise OutOfTime(
            f"{_label(nodes)}: still running after {seconds:g} s, the time budget of an evaluation; stopped"
        ) from None
    except Exception as runtime_error:  # onnxruntime raises its own assorted exception types
        try:
            results = onnx.reference.ReferenceEvaluator(proto).run(names, arrays)
        except Exception as reference_error:
            raise EvaluationError(
                f"{_label(nodes)}: onnxruntime failed ({_first_line(runtime_error)}) "
                f"and so did onnx.reference ({_first_line(reference_error)})"
            ) from reference_error
    for value, result in zip(outputs, results):
        if not isinstance(result, np.ndarray):
            raise EvaluationError(f"{_label(nodes)}: {value.name!r} is a {type(result).__name__}, not a tensor")
        try:
            DataType.from_numpy(result.dtype)
        except TypeError:
            raise EvaluationError(
                f"{_label(nodes)}: {value.name!r} has dtype {result.dtype}, not an ONNX one"
            ) from None
    return [np.asarray(r) for r in results]


class OutOfTime(EvaluationError):
    """A session stopped at the time budget."""


class _Terminated(Exception):
    pass


def _run_for(
    session: onnxruntime.InferenceSession, names: list[str], arrays: dict[str, np.ndarray], seconds: float
) -> Any:
    """``session.run``, told to terminate after ``seconds`` (onnxruntime checks the flag
    between nodes, and between a Loop's iterations)."""
    options = onnxruntime.RunOptions()
    options.log_severity_level = 4
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        options.terminate = True

    timer = threading.Timer(seconds, stop)
    timer.start()
    try:
        return session.run(names, arrays, options)
    except Exception:
        if stopped.is_set():
            raise _Terminated from None
        raise
    finally:
        timer.cancel()


def _options() -> onnxruntime.SessionOptions:
    options = onnxruntime.SessionOptions()
    # Each op as the standard defines it: no fusions with numerics of their own.
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


class _Names:
    """Unique names for the sub-model: the original where it is free, else a suffixed one."""

    def __init__(self, reserved: Iterable[str]) -> None:
        self.taken = set(reserved)

    def take(self, name: str) -> str:
        candidate, suffix = name or "value", 0
        while candidate in self.taken:
            suffix += 1
            candidate = f"{name or 'value'}_{suffix}"
        self.taken.add(candidate)
        return candidate


def _extract(
    nodes: Sequence[Node], feeds: Mapping[Value, np.ndarray], outputs: Sequence[Value], opsets: Mapping[str, int]
) -> tuple[Model, dict[str, np.ndarray]]:
    """The region as a model of its own, and the arrays to feed its graph inputs."""
    names = _Names(v.name for node in nodes for body in node.subgraphs() for v in _body_values(body))
    read = {id(v) for node in nodes for v in [*node.inputs, *node.captures()] if v is not None}
    read |= {id(v) for v in outputs}
    copies: dict[int, Value] = {}
    graph_inputs: list[Value] = []
    initializers: list[Value] = []
    arrays: dict[str, np.ndarray] = {}
    for value, array in feeds.items():
        try:
            dtype = DataType.from_numpy(array.dtype)
        except TypeError:
            raise EvaluationError(f"{value.name!r} has dtype {array.dtype}, which onnxruntime cannot be fed") from None
        copy = Value(names.take(value.name), TensorType(dtype, tuple(array.shape)))
        if dtype in (DataType.INT32, DataType.INT64) and array.size <= _EMBEDDED_ELEMENTS:
            copy.const = Tensor.from_array(array, copy.name)
            initializers.append(copy)
        else:
            graph_inputs.append(copy)
            arrays[copy.name] = np.asarray(array, order="C")
        copies[id(value)] = copy
    region: list[Node] = []
    for node in nodes:
        # An unnamed output nobody reads stays unnamed: it is an optional output not asked for.
        produced = [Value(names.take(v.name) if v.name or id(v) in read else "") for v in node.outputs]
        copies.update((id(v), c) for v, c in zip(node.outputs, produced))
        region.append(
            Node(
                node.op_type,
                [None if v is None else copies[id(v)] for v in node.inputs],
                produced,
                [_copy_attr(a, copies) for a in node.attributes.values()],
                domain=node.domain,
                name=node.name,
                overload=node.overload,
            )
        )
    graph = Graph(graph_inputs, [copies[id(v)] for v in outputs], region, initializers, name="region")
    opset_imports = dict(opsets)
    ir_version = onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid(d, v) for d, v in opset_imports.items()], ignore_unknown=True
    )
    return Model(graph, opset_imports, ir_version=max(ir_version, 7)), arrays


def _body_values(graph: Graph) -> Iterable[Value]:
    yield from graph.values()
    for body in graph.subgraphs():
        yield from body.values()


def _copy_attr(attr: Attr, copies: dict[int, Value]) -> Attr:
    """The attribute for the copied node: bodies are cloned (a body belongs to one node),
    with their captures pointing at the copies; other values are shared."""
    if attr.kind == AttrKind.GRAPH and attr.value is not None:
        return Attr(attr.name, attr.kind, clone_graph(attr.value, copies))
    if attr.kind == AttrKind.GRAPHS:
        return Attr(attr.name, attr.kind, [clone_graph(g, copies) for g in attr.value])
    return attr


def _inferred_bytes(proto: onnx.ModelProto) -> int:
    """The bytes of every value whose shape onnx's inference fixes (0 when it cannot tell).

    Inference runs in a child process: on a malformed node (an input left blank) onnx's
    C++ code can end the process instead of raising."""
    try:
        inferred = infer_proto(proto)
    except Exception:  # onnx raises assorted C++ exception types; then nothing is known
        return 0
    total = 0
    for info in [*inferred.graph.value_info, *inferred.graph.output]:
        tensor = info.type.tensor_type
        if not info.type.HasField("tensor_type") or not tensor.HasField("shape") or not tensor.elem_type:
            continue
        dims = tensor.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            total += math.prod(d.dim_value for d in dims) * DataType(tensor.elem_type).itemsize_bits // 8
    return total


def _label(nodes: Sequence[Node]) -> str:
    if len(nodes) == 1:
        return describe(nodes[0])
    ops = ", ".join(dict.fromkeys(n.op_type for n in nodes))
    return f"a region of {len(nodes)} nodes ({ops})"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(err: BaseException) -> str:
    text = _ANSI.sub("", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__
