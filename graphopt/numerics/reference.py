"""The original model with its reduced-precision islands evaluated in float32: the reference of
the check's third criterion (compare.py).

A float16 or quantized model approximates a float32 one. A rewrite that computes part of it in
a higher precision (a fused attention reading the dequantized values, where the original
quantized its interior; an Attention op that keeps fully masked rows finite, where the float16
original overflowed) moves the output away from the original, often by more than the original's
own rounding, but towards what it approximates. Judged against the original alone such a
rewrite fails; judged against this reference it is no further than the original is. A wrong
rewrite (a wrong scale, a dropped zero point, a swapped axis, a head's weights changed) adds an
error of its own that no quantization error cancels: it moves the output further from the
reference than the original is.

What is evaluated in float, each only where the original's program stays the same in every
other respect:

- float16 (and bfloat16) tensors become float32: initializers, Constant and ConstantOfShape
  values, Cast and CastLike targets, declared value types. The weights keep their float16
  values; only the arithmetic is float32. Float16's extremes, -65504 and 65504, become
  float32's: converters clamp float32's -3.4e38 masks to them (onnxruntime's
  convert_float_to_float16), and -65504 masks less than -3.4e38 does: a fully masked row (a
  left-padded causal query) weighs its keys alike under -3.4e38, as the float32 export does,
  and by their scores under -65504, as the float16 model runs in onnxruntime. An Attention op
  that weighs them alike, as the export does, is then nearer the reference than the original
  (llama_dynamo_fp16 at padded bindings: 4.2e-4 from it, the original 1.08e-2).
- an activation's QuantizeLinear -> DequantizeLinear pair (a value computed at run time from the
  inputs, quantized and dequantized with the same scale and zero point tensors, with data
  movement ops between them or not: a Transpose of the quantized integers is the Transpose of
  the value) becomes the value itself: its rounding goes, and so does its saturation at the
  calibrated range, except at 0 where the grid starts at 0 (the zero point its type's smallest
  integer): that is a Relu the quantizer folded into the QuantizeLinear, part of the program
  (without it, a QDQ block was 0.51 from its reference). The rest of the saturation goes: a Clip
  to the whole grid made a worse reference; the fused attention of a QDQ BERT, 0.953 x the
  original's distance to the float32 export, was 1.056 x the original's distance to the clipped
  reference.
  Weight DequantizeLinear stays: a quantized weight is part of the program. So does the pair
  of a value computed from constants alone (a Constant node's, a rotary embedding's inverse
  frequencies): an optimizer folds it into a stored tensor, which would make it a weight, and
  an optimized model must have the same reference as its original (compare.py, the float
  program: llama_ts_qdq's fused attention was 2.7e-4 from its original's program, by the
  rounding of its inverse frequencies alone).
- dynamic int8: MatMulInteger of a DynamicQuantizeLinear's output and a constant int8 weight,
  read by a Cast to float (``quantize_dynamic``'s pattern, its result then multiplied by both
  scales), becomes MatMul(x / x_scale, weight - weight_zero_point) in float32, which the same
  scales then turn into x @ dequantized weight. onnxruntime's fused forms of it
  (DynamicQuantizeMatMul, and MatMulIntegerToFloat of a DynamicQuantizeLinear's outputs, which
  graphopt writes at ``--target ort``) become x @ dequantized weight too: the same program.

The bodies of If, Loop and Scan are evaluated alike, each scope on its own (a body's inputs are
declared float32 where they were float16): a pair or a dynamic int8 MatMul split across scopes
stays as written, in the original's reference and the optimized model's alike. graphopt's
run-time gate at ``--target ort`` is such an If (GroupQueryAttention or the written attention);
without its bodies a dynamically quantized KV decoder had no float program, and a right rewrite
that flipped quantization steps failed (llama_kv_ts_dyn8: 0.00822 from the reference, as the
original).

None when the model holds none of these or has tensors stored outside the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphopt.ir.constness import RANDOM_OPS
from graphopt.ir.node import CONTRIB_DOMAIN, STANDARD_DOMAINS
from graphopt.ir.ops import CARRIERS
from graphopt.numerics.paths import bodies, inline_array, is_qdq

__all__ = ["float_programs", "float_reference", "holds_bfloat16"]

_HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def float_reference(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` with its float16 arithmetic, activation Q/DQ pairs and dynamic int8
    MatMuls evaluated in float32, or None when there is nothing to evaluate so or it cannot be
    done (module docstring)."""
    if any(_stored_outside(scope) for scope, _ in _scopes(model.graph)):
        return None
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    changed = False
    for scope, outer in _scopes(reference.graph):
        changed = _to_float32(scope, is_body=bool(outer)) or changed
        changed = _unquantized_activations(scope, outer) or changed
        changed = _float_matmuls(scope, outer) or changed
    return reference if changed else None


Outer = tuple[onnx.GraphProto, ...]


def _scopes(graph: onnx.GraphProto, outer: Outer = ()) -> Iterator[tuple[onnx.GraphProto, Outer]]:
    """``graph`` and every If, Loop and Scan body nested in it, outer scopes first, each with the scopes that
    enclose it (whose stored tensors and values it reads by name). A scope's nodes are read only once the caller
    is done with it, so that the nodes it inserts there are walked too."""
    yield graph, outer
    for node in graph.node:
        for attribute in node.attribute:
            for body in bodies(attribute):
                yield from _scopes(body, (*outer, graph))


def _visible(graph: onnx.GraphProto, outer: Outer) -> tuple[dict[str, onnx.TensorProto], dict[str, onnx.NodeProto]]:
    """The stored tensors and the producers of the values a node of ``graph`` may read, by name."""
    scopes = (*outer, graph)
    stored = {t.name: t for scope in scopes for t in scope.initializer}
    producer = {out: node for scope in scopes for node in scope.node for out in node.output}
    return stored, producer


def float_programs(original: Path, optimized: Path, folder: Path) -> tuple[Path, Path] | None:
    """Both models' float reference, saved in ``folder``, where the original holds bfloat16
    tensors (which onnxruntime's CPU provider runs no arithmetic on, so that only their float32
    programs can be compared); None where it holds none, or a bfloat16 model's program cannot be
    made (tensors stored outside the file). A model holding nothing reduced is its own program."""
    models = [onnx.load(str(path), load_external_data=False) for path in (original, optimized)]
    if not holds_bfloat16(models[0].graph):
        return None
    paths = (folder / "original.onnx", folder / "optimized.onnx")
    for model, path in zip(models, paths, strict=True):
        program = float_reference(model)
        if program is None and (holds_bfloat16(model.graph) or _stored_outside(model.graph)):
            return None
        onnx.save(program or model, str(path))
    return paths


def _stored_outside(graph: onnx.GraphProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer)


def holds_bfloat16(graph: onnx.GraphProto) -> bool:
    """Whether ``graph`` stores or declares a bfloat16 tensor (its nested bodies are not searched)."""
    described = [*graph.input, *graph.output, *graph.value_info]
    return any(t.data_type == onnx.TensorProto.BFLOAT16 for t in graph.initializer) or any(
        v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for v in described
    )


def _to_float32(graph: onnx.GraphProto, is_body: bool = False) -> bool:
    """``graph``'s float16 and bfloat16 tensors, Cast targets and declared types made float32 (a body's declared
    inputs too: the values its node passes it are float32 now)."""
    changed = False
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type in _HALF:
            graph.initializer[index].CopyFrom(_widened(tensor))
            changed = True
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type in _HALF:
                attribute.t.CopyFrom(_widened(attribute.t))
                changed = True
            elif node.op_type == "Cast" and attribute.name == "to" and attribute.i in _HALF:
                attribute.i = onnx.TensorProto.FLOAT
                changed = True
    for value in [*graph.value_info, *graph.output, *(graph.input if is_body else [])]:
        if value.type.tensor_type.elem_type in _HALF:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
            changed = True
    # A float16 graph input stays float16 (the feeds are); its first use widens it.
    widened_inputs = [] if is_body else [i.name for i in graph.input if i.type.tensor_type.elem_type in _HALF]
    if widened_inputs:
        _widen_inputs(graph, {name: f"{name}__float32" for name in widened_inputs})
        changed = True
    return changed


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    values = numpy_helper.to_array(tensor)
    widened = values.astype(np.float32)
    if values.dtype == np.float16:  # float16's extremes are where converters clamp float32's
        largest = np.float32(np.finfo(np.float32).max)
        widened[values == np.finfo(np.float16).max] = largest
        widened[values == np.finfo(np.float16).min] = -largest
    return numpy_helper.from_array(widened, tensor.name)


def _widen_inputs(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    """Every reader of a graph input of ``renamed``, in the graph or a body nested in it, reads its new name, a Cast
    of it to float32."""
    for scope, _ in _scopes(graph):
        for node in scope.node:
            node.input[:] = [renamed.get(name, name) for name in node.input]
    for index, (old, new) in enumerate(renamed.items()):
        graph.node.insert(index, helper.make_node("Cast", [old], [new], to=onnx.TensorProto.FLOAT))


def _unquantized_activations(graph: onnx.GraphProto, outer: Outer = ()) -> bool:
    stored, producer = _visible(graph, outer)
    constants = _from_constants(graph, outer)
    changed = False
    for node in list(graph.node):
        if not is_qdq(node, "DequantizeLinear"):
            continue
        moves = _integer_moves(node.input[0], producer)
        if moves and not _per_tensor(stored.get(node.input[1])):
            continue  # a per-axis grid moved with the integers: which axis each side means is not read here
        quantize = producer.get(moves[-1].input[0] if moves else node.input[0])
        if quantize is None or not is_qdq(quantize, "QuantizeLinear"):
            continue
        if quantize.input[0] in constants or list(quantize.input[1:]) != list(node.input[1:]):
            continue
        if not _same_grid(node, quantize):
            continue
        zero_point = stored.get(node.input[2]) if len(node.input) > 2 else None
        value = _moved_in_float(graph, node, quantize.input[0], moves)
        node.domain = ""
        del node.attribute[:]
        if zero_point is not None and _lowest_is_zero(zero_point):
            # A grid that starts at 0 is a Relu the quantizer folded into the Q: kept.
            node.op_type, node.input[:] = "Relu", [value]
        else:
            node.op_type, node.input[:] = "Identity", [value]
        changed = True
    return changed


def _integer_moves(value: str, producer: dict[str, onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The data-movement ops between ``value`` and the QuantizeLinear they move, nearest first:
    an optimizer moves integers rather than floats where that is exact (a Transpose of a
    quantized K, graphopt's qdq family), and the pair around them is still one quantization."""
    moves: list[onnx.NodeProto] = []
    node = producer.get(value)
    while node is not None and node.op_type in CARRIERS and node.domain in STANDARD_DOMAINS and node.input:
        moves.append(node)
        node = producer.get(node.input[0])
    return moves


def _moved_in_float(graph: onnx.GraphProto, before: onnx.NodeProto, value: str, moves: list[onnx.NodeProto]) -> str:
    """``value`` moved as ``moves`` move its quantized form (a copy of each, inserted before
    ``before``): the name of the result."""
    position = list(graph.node).index(before)
    for move in reversed(moves):
        copy = onnx.NodeProto()
        copy.CopyFrom(move)
        copy.name = f"{move.name}__float" if move.name else ""
        copy.input[0], copy.output[:] = value, [f"{move.output[0]}__float"]
        graph.node.insert(position, copy)
        position += 1
        value = copy.output[0]
    return value


def _from_constants(graph: onnx.GraphProto, outer: Outer = ()) -> set[str]:
    """The values ``graph`` computes from stored tensors alone, its own and its enclosing scopes' (a stored tensor
    that is also an input is the caller's; a random op draws anew on every run)."""
    constants: set[str] = set()
    for scope in (*outer, graph):
        fed = {value.name for value in scope.input}
        constants |= {t.name for t in scope.initializer if t.name not in fed}
        for node in scope.node:  # in the order they run
            if node.op_type not in RANDOM_OPS and all(name in constants for name in node.input if name):
                constants.update(name for name in node.output if name)
    return constants


def _per_tensor(scale: onnx.TensorProto | None) -> bool:
    """Whether ``scale`` is a stored scalar (one scale for the whole tensor)."""
    return scale is not None and int(np.prod(scale.dims, dtype=np.int64)) == 1


def _lowest_is_zero(zero_point: onnx.TensorProto) -> bool:
    """Whether the grid's lowest value is 0: the zero point is its type's smallest integer."""
    offset = inline_array(zero_point)
    return offset is not None and offset.dtype.kind in "iu" and bool((offset == np.iinfo(offset.dtype).min).all())


def _same_grid(a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
    """Whether the two quantize along the same axis in the same blocks."""

    def of(node: onnx.NodeProto) -> dict[str, int]:
        return {x.name: x.i for x in node.attribute if x.name in ("axis", "block_size")}

    return of(a) == of(b)


def _float_matmuls(graph: onnx.GraphProto, outer: Outer = ()) -> bool:
    stored, producer = _visible(graph, outer)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    changed = False
    for node in list(graph.node):
        if node.op_type != "MatMulInteger" or node.domain not in STANDARD_DOMAINS or len(node.input) < 3:
            continue
        quantize = producer.get(node.input[0])
        weight = stored.get(node.input[1])
        casts = readers.get(node.output[0], [])
        if quantize is None or quantize.op_type != "DynamicQuantizeLinear" or weight is None or len(casts) != 1:
            continue
        cast = casts[0]
        if cast.op_type != "Cast" or [a.i for a in cast.attribute if a.name == "to"] != [onnx.TensorProto.FLOAT]:
            continue
        if node.input[2] != quantize.output[2] or node.output[0] in (o.name for o in graph.output):
            continue
        weights = inline_array(weight)
        zero_point = inline_array(stored[node.input[3]]) if len(node.input) > 3 and node.input[3] in stored else 0
        if weights is None or zero_point is None:
            continue
        name = f"{node.input[1]}__float32"
        if name not in stored:
            graph.initializer.append(numpy_helper.from_array(weights.astype(np.float32) - np.float32(zero_point), name))
            stored[name] = graph.initializer[-1]
        scaled = f"{node.output[0]}__float32_input"
        divide = helper.make_node("Div", [quantize.input[0], quantize.output[1]], [scaled])
        matmul = helper.make_node("MatMul", [scaled, name], [cast.output[0]])
        position = list(graph.node).index(cast)
        graph.node.remove(cast)
        graph.node.insert(position, matmul)
        graph.node.insert(position, divide)
        changed = True
    return _float_fused_matmuls(graph, stored, producer) or changed


# onnxruntime's fused dynamic int8 MatMuls (graphopt writes them at --target ort): the index of their weight, its
# scale and zero point, and their bias.
_FUSED_INTEGER_MATMULS = {"DynamicQuantizeMatMul": (1, 2, 3, 4), "MatMulIntegerToFloat": (1, 3, 5, 6)}


def _float_fused_matmuls(
    graph: onnx.GraphProto, stored: dict[str, onnx.TensorProto], producer: dict[str, onnx.NodeProto]
) -> bool:
    """onnxruntime's DynamicQuantizeMatMul(x, W, Ws, Wz, bias), and MatMulIntegerToFloat of a DynamicQuantizeLinear's
    outputs, as x @ ((W - Wz) * Ws) + bias in float32: the program of the MatMulInteger they stand for."""
    changed = False
    for node in list(graph.node):
        if node.domain != CONTRIB_DOMAIN or node.op_type not in _FUSED_INTEGER_MATMULS:
            continue
        weight_at, scale_at, zero_at, bias_at = _FUSED_INTEGER_MATMULS[node.op_type]
        present = {i: name for i, name in enumerate(node.input) if name}
        x = present.get(0)
        if node.op_type == "MatMulIntegerToFloat":
            quantize = producer.get(x or "")
            if (
                quantize is None
                or quantize.op_type != "DynamicQuantizeLinear"
                or quantize.domain not in STANDARD_DOMAINS
            ):
                continue
            if [present.get(0), present.get(2), present.get(4)] != list(quantize.output):
                continue
            x = quantize.input[0]
        weights, scale, zero_point = (_stored_array(stored, present.get(i)) for i in (weight_at, scale_at, zero_at))
        if x is None or weights is None or scale is None or (zero_at in present and zero_point is None):
            continue
        name = f"{node.output[0]}__float32_weight"
        dequantized = (weights.astype(np.float32) - np.float32(0 if zero_point is None else zero_point)) * scale
        graph.initializer.append(numpy_helper.from_array(dequantized.astype(np.float32), name))
        position = list(graph.node).index(node)
        graph.node.remove(node)
        bias = present.get(bias_at)
        product = f"{node.output[0]}__float32_product" if bias else node.output[0]
        graph.node.insert(position, helper.make_node("MatMul", [x, name], [product]))
        if bias:
            graph.node.insert(position + 1, helper.make_node("Add", [product, bias], [node.output[0]]))
        changed = True
    return changed


def _stored_array(stored: dict[str, onnx.TensorProto], name: str | None) -> np.ndarray | None:
    return inline_array(stored[name]) if name is not None and name in stored else None
