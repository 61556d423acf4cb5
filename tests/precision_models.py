"""A small transformer in every precision people deploy, made with onnxruntime's own tools.

The float32 model (``block``): blocks of a decomposed LayerNorm, two-head self-attention, a
residual, a ReLU MLP and a second residual, over ``x[batch, 128, 64]`` (K = 64 >= the int4
block of 32); ``Size`` sets the blocks, the batch and how sharp the attention is. Its variants:

- float16: ``onnxruntime.transformers.float16.convert_float_to_float16`` with float32 inputs
  and outputs;
- bfloat16: the float16 model with every float16 tensor, type and Cast bfloat16 (no tool of
  onnxruntime's writes one; onnxruntime's CPU provider runs no bfloat16 arithmetic, so the check
  compares the float32 programs, numerics/reference.py);
- QDQ int8: ``onnxruntime.quantization.quantize_static`` in QDQ format, calibrated on four inputs;
- dynamic int8: ``quantize_dynamic`` (DynamicQuantizeLinear and MatMulInteger);
- int4: MatMulNBits (block 32, asymmetric) with its weights packed by onnxruntime's own
  4-bit kernel, the one ``MatMulNBitsQuantizer`` calls (that class needs onnx_ir, which
  is no dependency of graphopt).

``fused_norm`` is a right rewrite of a variant, right up to rounding: each LayerNorm chain as
one LayerNormalization, the fusion an optimizer makes. The seeded wrong rewrites (``MISTAKES``)
are made on the float32 model and converted like it, as a buggy optimizer's output would be,
except a dropped zero point, which is dropped from the quantized model itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.precision_tools import Calibration, bfloat16_of_float16, quantized_through_files, static_options

__all__ = [
    "MISTAKES",
    "SMALL",
    "VARIANTS",
    "Size",
    "block",
    "dynamic_but_the_last_matmul",
    "fused_attention",
    "fused_norm",
    "variant",
]

SEQ, HIDDEN, HEADS, MLP = 128, 64, 2, 128


@dataclass(frozen=True)
class Size:
    """How big the model is: ``layers`` blocks over ``x[batch, SEQ, HIDDEN]``, the query and key
    weights ``sharpness`` times their usual scale (attention logits of std ``sharpness**2``)."""

    layers: int = 1
    batch: int = 1
    sharpness: float = 1.0


SMALL = Size()
HEAD = HIDDEN // HEADS


def block(mistake: str | None = None, size: Size = SMALL) -> onnx.ModelProto:
    """The float32 model of ``size``; ``mistake`` (one of MISTAKES) breaks its first block."""
    layers, batch = size.layers, size.batch
    rng = np.random.default_rng(7)
    nodes: list[onnx.NodeProto] = []
    tensors = {
        "eps": np.array(1e-5, np.float32),
        "heads_shape": np.array([batch, SEQ, HEADS, HEAD], np.int64),
        "hidden_shape": np.array([batch, SEQ, HIDDEN], np.int64),
    }
    for layer in range(layers):
        wrong = mistake if layer == 0 else None
        names = _Names(f"l{layer}.", "x" if layer == 0 else f"l{layer - 1}.y", "y" if layer == layers - 1 else None)
        nodes += _layer(names, wrong)
        tensors |= {names(key): array for key, array in _weights(rng, wrong, size.sharpness).items()}
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, SEQ, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, SEQ, HIDDEN])],
        [numpy_helper.from_array(array, name) for name, array in tensors.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


class _Names:
    """A layer's value names: its own prefixed, ``x`` and ``y`` its input and output, the shared
    constants as they are."""

    def __init__(self, prefix: str, source: str, target: str | None) -> None:
        self.prefix, self.source, self.target = prefix, source, target

    def __call__(self, name: str) -> str:
        if name == "x":
            return self.source
        if name == "y" and self.target is not None:
            return self.target
        return name if name in ("eps", "heads_shape", "hidden_shape") else self.prefix + name


def _weights(rng: np.random.Generator, mistake: str | None, sharpness: float) -> dict[str, np.ndarray]:
    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    weights = {
        "wq": weight(HIDDEN, HIDDEN) * np.float32(sharpness),
        "wk": weight(HIDDEN, HIDDEN) * np.float32(sharpness),
        "wv": weight(HIDDEN, HIDDEN),
        "wo": weight(HIDDEN, HIDDEN),
        "w1": weight(HIDDEN, MLP),
        "w2": weight(MLP, HIDDEN),
        "gamma": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "beta": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "scale": np.array(1 / np.sqrt(HIDDEN if mistake == "wrong scale" else HEAD), np.float32),
    }
    if mistake == "one head changed":  # the second head's query weights copied from the first
        weights["wq"][:, HEAD:] = weights["wq"][:, :HEAD]
    return weights


def _layer(name: _Names, mistake: str | None) -> list[onnx.NodeProto]:
    def node(op: str, inputs: list[str], outputs: list[str], **attributes: object) -> onnx.NodeProto:
        return helper.make_node(op, [name(i) for i in inputs], [name(o) for o in outputs], **attributes)

    norm = [
        node("ReduceMean", ["x"], ["mean"], axes=[-1]),
        node("Sub", ["x", "mean"], ["d"]),
        node("Mul", ["d", "d"], ["dd"]),
        node("ReduceMean", ["dd"], ["var"], axes=[-1]),
        node("Add", ["var", "eps"], ["var_eps"]),
        node("Sqrt", ["var_eps"], ["std"]),
        node("Div", ["x" if mistake == "dropped zero point" else "d", "std"], ["normed"]),
        node("Mul", ["normed", "gamma"], ["scaled"]),
        node("Add", ["scaled", "beta"], ["h"]),
    ]
    heads = []
    for part in ("q", "k", "v"):
        heads += [
            node("MatMul", ["h", f"w{part}"], [f"{part}_flat"]),
            node("Reshape", [f"{part}_flat", "heads_shape"], [f"{part}_split"]),
            node("Transpose", [f"{part}_split"], [f"{part}_heads"], perm=[0, 2, 3, 1] if part == "k" else [0, 2, 1, 3]),
        ]
    attention = [
        node("MatMul", ["q_heads", "k_heads"], ["scores"]),
        node("Mul", ["scores", "scale"], ["scaled_scores"]),
        node("Softmax", ["scaled_scores"], ["probs"], axis=-2 if mistake == "swapped axis" else -1),
        node("MatMul", ["probs", "v_heads"], ["context"]),
        node("Transpose", ["context"], ["context_seq"], perm=[0, 2, 1, 3]),
        node("Reshape", ["context_seq", "hidden_shape"], ["context_flat"]),
        node("MatMul", ["context_flat", "wo"], ["attended"]),
        node("Add", ["x", "attended"], ["a"]),
        node("MatMul", ["a", "w1"], ["up"]),
        node("Relu", ["up"], ["act"]),
        node("MatMul", ["act", "w2"], ["down"]),
        node("Add", ["a", "down"], ["y"]),
    ]
    return norm + heads + attention


# The seeded wrong rewrites: each breaks what its name says, as a buggy rewrite would. On the
# quantized variants "dropped zero point" drops a real zero point (quantized afterwards, see
# variant); on float ones, the LayerNorm's centring, the offset a float model has instead.
MISTAKES = ("wrong scale", "dropped zero point", "swapped axis", "one head changed")


def _float16(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted: onnx.ModelProto = convert_float_to_float16(model, keep_io_types=True)
    return converted


def _calibration(model: onnx.ModelProto) -> Calibration:
    """Four seeded inputs."""
    rng = np.random.default_rng(11)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return Calibration({"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(4))


def _static(kind: str) -> Callable[[onnx.ModelProto], onnx.ModelProto]:
    """The quantize_static ``kind`` (tests/precision_tools.py) of a model."""

    def quantize(model: onnx.ModelProto) -> onnx.ModelProto:
        from onnxruntime.quantization import quantize_static

        calibration = _calibration(model)
        options = static_options(kind)
        return quantized_through_files(model, lambda a, b: quantize_static(a, b, calibration, **options))

    return quantize


def _dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization import quantize_dynamic

    return quantized_through_files(model, quantize_dynamic)


def dynamic_but_the_last_matmul(size: Size = SMALL) -> onnx.ModelProto:
    """The dynamic int8 variant with its last MatMul (the MLP's down projection) reading its
    activation in float: MatMul(x, DequantizeLinear(weight)), the same weight, a rewrite that
    computes one quantized MatMul in a higher precision."""
    model = variant("dynamic int8", None, size)
    nodes = list(model.graph.node)
    integer = next(node for node in reversed(nodes) if node.op_type == "MatMulInteger")
    cast = next(node for node in nodes if node.input[:1] == integer.output[:1])
    scaled = next(node for node in nodes if cast.output[0] in node.input)
    quantize = next(node for node in nodes if node.output[0] == integer.input[0])
    weight, weight_scale = integer.input[1], f"{integer.input[1].removesuffix('_quantized')}_scale"
    dequantized = helper.make_node("DequantizeLinear", [weight, weight_scale, integer.input[3]], ["dequantized"])
    matmul = helper.make_node("MatMul", [quantize.input[0], "dequantized"], list(scaled.output))
    at = nodes.index(integer)
    nodes = [node for node in nodes if node not in (integer, cast, scaled)]
    nodes[at:at] = [dequantized, matmul]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _int4(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every MatMul by a 2-D weight as MatMulNBits, 4 bits, blocks of 32, with zero points."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    block_size, model = 32, onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for index, node in enumerate(graph.node):
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or weight.ndim != 2:
            continue
        rows, cols = weight.shape
        blocks = -(-rows // block_size)  # the last block zero-padded where K is no multiple of 32
        packed = np.zeros((cols, blocks, block_size // 2), np.uint8)
        scales = np.zeros((cols, blocks), np.float32)
        zeros = np.zeros((cols, (blocks + 1) // 2), np.uint8)
        quantize_matmul_4bits(packed, np.ascontiguousarray(weight), scales, zeros, block_size, cols, rows, False)
        name = node.input[1]
        graph.initializer.extend(
            numpy_helper.from_array(array, f"{name}_{part}")
            for part, array in (("q4", packed), ("scales", scales.ravel()), ("zeros", zeros.ravel()))
        )
        graph.node[index].CopyFrom(
            helper.make_node(
                "MatMulNBits",
                [node.input[0], f"{name}_q4", f"{name}_scales", f"{name}_zeros"],
                list(node.output),
                name=node.name,
                domain="com.microsoft",
                K=rows,
                N=cols,
                bits=4,
                block_size=block_size,
            )
        )
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


VARIANTS: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "float32": lambda model: model,
    "float16": _float16,
    "bfloat16": lambda model: bfloat16_of_float16(_float16(model)),
    "qdq int8": _static("qdq"),
    "qdq int16": _static("qdq16"),
    "dynamic int8": _dynamic,
    "int4": _int4,
}


def variant(name: str, mistake: str | None = None, size: Size = SMALL) -> onnx.ModelProto:
    """The block in precision ``name``, broken by ``mistake`` (one of MISTAKES); a dropped zero
    point in a quantized variant is a real one: the first quantized MatMul's activation zero point."""
    real_zero_point = name in ("qdq int8", "qdq int16", "dynamic int8", "int4") and mistake == "dropped zero point"
    model = VARIANTS[name](block(None if real_zero_point else mistake, size))
    if real_zero_point:
        _drop_zero_point(model, name)
    return model


_NORM_CHAIN = ("mean", "d", "dd", "var", "var_eps", "std", "normed", "scaled", "h")


def fused_norm(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (a variant whose LayerNorm chains are not quantized) with each chain as one
    LayerNormalization: the fusion an optimizer makes, right up to rounding."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    producers = {output: node for node in model.graph.node for output in node.output}
    nodes = list(model.graph.node)
    for layer in range(sum(1 for node in nodes if node.output[0].endswith(".mean"))):
        chain = {f"l{layer}.{name}" for name in _NORM_CHAIN}
        first, scaled, last = (producers[f"l{layer}.{name}"] for name in ("mean", "scaled", "h"))
        gamma = next(name for name in scaled.input if name != scaled.input[0])
        beta = next(name for name in last.input if name != scaled.output[0])
        fused = helper.make_node("LayerNormalization", [first.input[0], gamma, beta], [last.output[0]], epsilon=1e-5)
        at = nodes.index(first)
        nodes = [node for node in nodes if not set(node.output) & chain]
        nodes.insert(at, fused)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


_ATTENTION_INTERIOR = ("scores", "scaled_scores", "probs", "context")


def fused_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (the QDQ variant) as a fusion through Q/DQ computes it: the attention reads the
    dequantized Q, K and V, and the Q/DQ pairs strictly inside it (scores, probabilities,
    context) are gone."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    producers = {output: node for node in model.graph.node for output in node.output}
    for node in model.graph.node:
        quantize = producers.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if quantize is not None and quantize.input[0].split(".")[-1] in _ATTENTION_INTERIOR:
            node.CopyFrom(helper.make_node("Identity", [quantize.input[0]], list(node.output), name=node.name))
    return model


def _drop_zero_point(model: onnx.ModelProto, name: str) -> None:
    op, position = {
        "qdq int8": ("DequantizeLinear", 2),
        "qdq int16": ("DequantizeLinear", 2),
        "dynamic int8": ("MatMulInteger", 2),
        "int4": ("MatMulNBits", 3),
    }[name]
    stored = {tensor.name for tensor in model.graph.initializer}
    for node in model.graph.node:
        # An activation's zero point: a DequantizeLinear of a weight reads a stored tensor.
        if node.op_type == op and len(node.input) > position and node.input[position] and node.input[0] not in stored:
            node.input[position] = ""
            return
    raise AssertionError(f"no zero point to drop in the {name} model")
