"""Converting a model to another default-domain opset with onnx's version converter.

Passes reach this through ``PassContext.convert_opset`` (graphopt.api wires it in), so
they stay free of protobuf. A model the converter cannot take to the requested opset is
bad input; the message names the op that blocks it when onnx's error says which.

The converter also returns models it did not convert correctly, so its result is held to
three rules before it is used, and a conversion that breaks one is refused the same way:

- a step the converter takes but gets wrong is refused before it runs (``UNSAFE_STEPS``), or
  set right after it (an Upsample's coordinates on the Resize it becomes);
- an attribute the op's schema has at the source opset must exist at the target: one the
  target lacks is dropped where it holds the value its op defines as default (what every
  older version does), and refused otherwise (AveragePool's ``dilations`` below opset 19);
- where onnxruntime loads the model before the conversion, it must load it after (an op
  version onnxruntime has no kernel for, such as RandomUniformLike-22, would not run).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import onnx
from onnx import defs, helper, version_converter

from graphopt.errors import InputError
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from graphopt.ir import Model

__all__ = ["UNSAFE_STEPS", "convert_opset"]

# op -> (the since-version the converter's adapter into it mistranslates, why). A conversion
# that crosses that version in either direction is refused. Each row has a test in
# tests/test_target_opset.py, found by benchmarks/opset_sweep.py.
UNSAFE_STEPS = {
    "Hardmax": (13, "Hardmax-11 takes the input flattened to 2-D around its axis, Hardmax-13 the one axis"),
    "Resize": (11, "Resize-10 maps coordinates asymmetrically, Resize-11 by default at half pixels"),
    "Scan": (9, "Scan-8 iterates over a batch axis that Scan-9 lacks; the converter keeps the inputs as they are"),
}


def convert_opset(model: Model, version: int) -> Model:
    """``model`` converted to default-domain opset ``version`` (a new IR model)."""
    highest = onnx.defs.onnx_opset_version()
    if not 1 <= version <= highest:
        raise InputError(
            f"cannot convert the model to opset {version}: onnx {onnx.__version__} knows opsets 1 to {highest}"
        )
    proto = to_proto(model)
    source = _default_opset(proto)
    try:
        _refuse_unsafe_steps(proto, source, version)
        converted = version_converter.convert_version(proto, version)
        _fit_attributes(converted, source, version)
        _pin_upsample_coordinates(proto, converted, version)
    except InputError as err:
        raise InputError(f"cannot convert the model to opset {version}: {err}") from None
    except Exception as err:  # onnx raises assorted C++ exception types
        raise InputError(f"cannot convert the model to opset {version}: {_blocking_op(err, proto, version)}") from None
    _refuse_what_onnxruntime_cannot_load(proto, converted, version)
    return from_proto(converted)


def _default_opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)


def _default_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The default-domain nodes of ``graph`` and of its subgraphs, at any depth."""
    return (node for node in _all_nodes(graph) if node.domain in ("", "ai.onnx"))


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``graph`` and of its subgraphs, at any depth, of every domain."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _all_nodes(sub)


def _schema(op_type: str, version: int) -> defs.OpSchema | None:
    try:
        return defs.get_schema(op_type, version, "")
    except defs.SchemaError:
        return None


def _refuse_unsafe_steps(proto: onnx.ModelProto, source: int, version: int) -> None:
    low, high = sorted((source, version))
    for node in _default_nodes(proto.graph):
        if node.op_type in UNSAFE_STEPS:
            since, why = UNSAFE_STEPS[node.op_type]
            before, after = _schema(node.op_type, low), _schema(node.op_type, high)
            if before and after and before.since_version < since <= after.since_version:
                raise InputError(f"op {node.op_type} blocks it ({why})")


def _pin_upsample_coordinates(before: onnx.ModelProto, converted: onnx.ModelProto, version: int) -> None:
    """Give each Resize an Upsample became its Upsample's coordinates: output pixel i reads
    input i / scale, nearest its floor (an Upsample only enlarges), where Resize-11 and later
    default to half pixels and rounding (measured equal in onnxruntime, both modes)."""
    resize = _schema("Resize", version)
    if resize is None or "coordinate_transformation_mode" not in resize.attributes:
        return  # Resize-10 maps coordinates as Upsample does
    upsampled = {node.output[0] for node in _default_nodes(before.graph) if node.op_type == "Upsample"}
    for node in _default_nodes(converted.graph):
        if node.op_type != "Resize" or node.output[0] not in upsampled:
            continue
        pinned = {"coordinate_transformation_mode": "asymmetric"}
        mode = next((a for a in node.attribute if a.name == "mode"), None)
        if mode is None or mode.s == b"nearest":
            pinned["nearest_mode"] = "floor"
        for attr in [a for a in node.attribute if a.name in pinned]:
            node.attribute.remove(attr)
        node.attribute.extend(helper.make_attribute(name, value) for name, value in pinned.items())


def _fit_attributes(converted: onnx.ModelProto, source: int, version: int) -> None:
    """Drop the attributes the target's schemas lack that hold their default; refuse the rest."""
    for node in _default_nodes(converted.graph):
        schema = _schema(node.op_type, version)
        if schema is None:
            raise InputError(f"op {node.op_type} blocks it (it has no schema at opset {version})")
        before = _schema(node.op_type, source)
        known = before.attributes if before else {}
        # An attribute the source schema lacks too came with the input as it is: left be.
        for attr in [a for a in node.attribute if a.name in known and a.name not in schema.attributes]:
            if not _holds_default(attr, known[attr.name]):
                raise InputError(
                    f"op {node.op_type} blocks it (its attribute {attr.name}="
                    f"{helper.get_attribute_value(attr)!r} does not exist at opset {version})"
                )
            node.attribute.remove(attr)


def _holds_default(attr: onnx.AttributeProto, declared: defs.OpSchema.Attribute) -> bool:
    default = declared.default_value
    return bool(default.name) and bool(helper.get_attribute_value(attr) == helper.get_attribute_value(default))


def _refuse_what_onnxruntime_cannot_load(before: onnx.ModelProto, after: onnx.ModelProto, version: int) -> None:
    """InputError when onnxruntime loads ``before`` but not ``after`` (kernels are checked
    on skeletons: the weights become inputs of the same type, so nothing large is copied)."""
    if _load_error(before) is not None:
        return  # a model onnxruntime cannot load anyway (custom ops, newer opsets) is not judged by it
    error = _load_error(after)
    if error is not None:
        why = _blocking_op(error, after)
        raise InputError(f"cannot convert the model to opset {version}: onnxruntime cannot load the result: {why}")


def _load_error(proto: onnx.ModelProto) -> Exception | None:
    import onnxruntime as ort

    skeleton = _without_weights(proto)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    try:
        ort.InferenceSession(skeleton.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's own exception types
        return err
    return None


def _without_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    graph = proto.graph
    fed = {i.name for i in graph.input}
    weights = [w for w in graph.initializer if w.name not in fed]
    as_inputs = [helper.make_tensor_value_info(w.name, w.data_type, w.dims) for w in weights]
    skeleton_graph = onnx.GraphProto(
        name=graph.name,
        node=graph.node,
        input=[*graph.input, *as_inputs],
        output=graph.output,
        value_info=graph.value_info,
        sparse_initializer=graph.sparse_initializer,
    )
    return onnx.ModelProto(
        ir_version=proto.ir_version,
        opset_import=proto.opset_import,
        functions=proto.functions,
        graph=skeleton_graph,
    )


def _blocking_op(err: BaseException, proto: onnx.ModelProto, target: int | None = None) -> str:
    """``err`` as a refusal that names the op behind it: the op its text names, else (the
    converter's messages often name none: "Attribute layout must have value 0") the ops of
    the model the conversion to ``target`` has to adapt, those whose schema differs between
    the two opsets, or those of domains the converter does not know."""
    text = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    text = re.sub(r"^.*?(Assertion `[^`]*` failed: )", "", text)
    nodes = list(_all_nodes(proto.graph))
    ops = {node.op_type for node in nodes}
    named = [op for op in sorted(ops) if re.search(rf"\b{re.escape(op)}\b", text)]
    if not named and target is not None:
        source = _default_opset(proto)
        named = sorted(
            {
                node.op_type
                for node in nodes
                if node.domain in ("", "ai.onnx") and _adapted(node.op_type, source, target)
            }
        ) or sorted({node.op_type for node in nodes if node.domain not in ("", "ai.onnx")})
    if not named:
        return text
    if len(named) == 1:
        return f"op {named[0]} blocks it ({text})"
    return f"one of the ops {', '.join(named)} blocks it ({text})"


def _adapted(op_type: str, source: int, target: int) -> bool:
    """Whether converting between the two opsets changes ``op_type``'s schema (the converter
    adapts it, or finds no adapter)."""
    before, after = _schema(op_type, source), _schema(op_type, target)
    return before is None or after is None or before.since_version != after.since_version
