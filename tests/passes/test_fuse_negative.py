"""Every fuse rule, table-driven: it fires on its model (numerics equal in onnxruntime, graph
outputs keep their names), and it does not fire when the model is perturbed one way: an
interior value gets an extra reader, an interior value becomes a graph output, an attribute
(or, for a rule that reads none, a constant) is wrong, a shape it needs is not provable, or
the opset is below the rule's gate. A refusal keeps the numerics and, where the engine
reports near misses, names its reason. A lowering rule (it fires only where --target-opset is
below its op's since-version) reads the opset column as a target that has the op; a refusal
leaves the op at a target that lacks it, so the conversion stops naming the op (bad input),
and the near miss is asked of the engine.

A rule that a perturbation does not apply to says why in its CASE (a string instead of the
perturbation); ``python -m tests.passes.test_fuse_negative`` prints the coverage matrix.

A rule newer than the exporter fixtures (tests/fixtures/exports) has a second case in EXPORTED: the
same perturbations on an exporter-written graph, cut after the rule's first match, at the values the
rule's pattern binds there (fuse_exported), or why no fixture has the spelling.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from graphopt.errors import InputError
from graphopt.passes.fuse import registered_rules
from tests.numerics import assert_same_outputs, make_feeds
from tests.passes.fuse_exported import (
    Change,
    Found,
    constant_of,
    cut_feeds,
    first_layer,
    fixture_inputs,
    locate,
    untyped_cut,
    with_constant,
)
from tests.passes.fuse_fixtures import (
    BROADCAST_BIAS,
    FIXTURES,
    exported_attention,
    exported_encoder_attention,
    exported_merged_attention,
    exported_silu,
    softcapped,
)
from tests.passes.fuse_helpers import fires, fuse, info, init, lowering_misses, model, node, ops, refused
from tests.passes.fuse_models import (
    HALF,
    HIDDEN,
    LOWERED,
    bias_gelu,
    computed_reshape,
    conv_act,
    conv_bn,
    conv_channel,
    conv_input_scale,
    embed,
    erf_gelu,
    gemm_bn,
    group_norm,
    hardswish,
    keras_layer_norm,
    kronecker,
    layer_norm,
    masked_feeds,
    matmul_add,
    ort_attention,
    padded,
    projections,
    residual_block,
    rope_model,
    rope_variant_model,
    scaled_matmul,
    skip_norm,
    split_projections,
    tanh_gelu,
    tied,
)

RNG = np.random.default_rng(2)
F16 = TensorProto.FLOAT16


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@dataclass(frozen=True)
class Perturb:
    """A change that must stop the rule, and the near miss it reports (None: the pattern no
    longer matches structurally, so there is nothing to report)."""

    change: Change
    reason: str | None
    feeds: Callable[[onnx.ModelProto], Mapping[str, np.ndarray]] | None = None  # default: the base model's
    note: str = ""  # what the perturbation is, where the column's name does not say it
    settings: Mapping[str, Any] | None = None  # run settings over the case's (a lowering's target opset)
    # A lowering refused leaves this op at a target opset that lacks it: the conversion stops.
    stops: str | None = None


@dataclass(frozen=True)
class Case:
    """One rule's model, where it fires, and its perturbations (a string: why one does not apply)."""

    build: Callable[[], onnx.ModelProto]
    expected: dict[str, int]
    interior: str
    wrong_attr: Perturb | str
    unprovable: Perturb | str
    low_opset: Perturb | str
    settings: dict[str, Any] = field(default_factory=dict)
    feeds: Callable[[], Mapping[str, np.ndarray]] | None = None
    passes: str = "shape-infer,fuse"


# -- perturbations ----------------------------------------------------------------------------------


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    return copy.deepcopy(proto)


def _value_info(proto: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    """``name`` as a graph output: its element type as inference has it, no shape."""
    inferred = shape_inference.infer_shapes(proto)
    for found in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]:
        if found.name == name:
            return helper.make_tensor_value_info(name, found.type.tensor_type.elem_type, None)
    return info(name, None)


def with_reader(proto: onnx.ModelProto, value: str) -> onnx.ModelProto:
    out = _copy(proto)
    out.graph.node.append(node("Identity", [value], f"{value}_read"))
    out.graph.output.append(_value_info(proto, value))
    out.graph.output[-1].name = f"{value}_read"
    return out


def with_output(proto: onnx.ModelProto, value: str) -> onnx.ModelProto:
    out = _copy(proto)
    out.graph.output.append(_value_info(proto, value))
    return out


def set_attr(*outputs: str, **attrs: Any) -> Change:
    """Set attributes on the nodes producing ``outputs`` (None removes one)."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = _copy(proto)
        for found in out.graph.node:
            if found.output[0] in outputs:
                kept = [a for a in found.attribute if a.name not in attrs]
                del found.attribute[:]
                found.attribute.extend(kept)
                found.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items() if v is not None)
        return out

    return change


def set_shape(name: str, shape: list[Any] | None) -> Change:
    """Declare graph input ``name`` with ``shape`` (None: unknown rank)."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = _copy(proto)
        for found in out.graph.input:
            if found.name == name:
                found.CopyFrom(helper.make_tensor_value_info(name, found.type.tensor_type.elem_type, shape))
        return out

    return change


def set_const(name: str, values: Any) -> Change:
    """Replace initializer ``name`` (keeping its element type)."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = _copy(proto)
        for index, found in enumerate(out.graph.initializer):
            if found.name == name:
                dtype = helper.tensor_dtype_to_np_dtype(found.data_type)
                out.graph.initializer[index].CopyFrom(init(name, np.asarray(values, dtype)))
        return out

    return change


def training(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The BatchNormalization in training mode (its running statistics as unused outputs)."""
    out = set_attr("y", training_mode=1)(proto)
    next(n for n in out.graph.node if n.op_type == "BatchNormalization").output.extend(["running_mean", "running_var"])
    return out


def at_opset(version: int) -> Change:
    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = _copy(proto)
        for found in out.opset_import:
            if found.domain in ("", "ai.onnx"):
                found.version = version
        return out

    return change


def below(version: int) -> Perturb:
    """The rule's gate: one opset below its minimum."""
    return Perturb(at_opset(version - 1), f"needs opset >= {version}")


def truncated(build: Callable[[], onnx.ModelProto], value: str) -> Callable[[], onnx.ModelProto]:
    """``build``'s model cut after ``value``, which becomes the output ``y``."""

    def cut() -> onnx.ModelProto:
        proto = build()
        kept = []
        for found in proto.graph.node:
            kept.append(found)
            if value in found.output:
                break
        for found in kept:
            found.output[:] = ["y" if o == value else o for o in found.output]
        del proto.graph.node[:]
        proto.graph.node.extend(kept)
        return proto

    return cut


def nudged(name: str, index: tuple[int, ...], by: float) -> Change:
    """Add ``by`` to one entry of initializer ``name``."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        found = next(t for t in proto.graph.initializer if t.name == name)
        values = numpy_helper.to_array(found).copy()
        values[index] += by
        return set_const(name, values)(proto)

    return change


def refused_lowering(op_type: str, change: Change, reason: str, note: str = "") -> Perturb:
    """A lowering the rule refuses: ``op_type`` stays, and the conversion to the target opset,
    which lacks it, stops naming it (bad input)."""
    return Perturb(change, reason, note=note, stops=op_type)


def not_below(since: int) -> Perturb:
    """A lowering's gate: the target opset is the op's since-version, which has the op."""
    return Perturb(_copy, None, settings={"target_opset": since}, note=f"--target-opset {since}, not below")


# -- builders for rules the other test files build inline ---------------------------------------------


def _chain(outer: str, inner: str) -> Callable[[], onnx.ModelProto]:
    def build() -> onnx.ModelProto:
        return model(
            [node(inner, ["x", "a"], "m"), node(outer, ["m", "b"], "y")],
            [info("x", [2, 3])],
            ["y"],
            [init("a", _w(3) + 3.0), init("b", _w(2, 1) + 3.0)],
        )

    return build


def _rms_round_trip() -> onnx.ModelProto:
    """Hugging Face's RMSNorm of a float16 x as the TorchScript exporter writes it: Cast to float32,
    Pow / ReduceMean / Add / Sqrt / Div(1, .) / Mul, Cast back, times gamma."""
    nodes = [
        node("Cast", ["x"], "xf", to=TensorProto.FLOAT),
        node("Pow", ["xf", "two"], "sq"),
        node("ReduceMean", ["sq", "axes"], "ms", keepdims=1),
        node("Add", ["ms", "eps"], "mse"),
        node("Sqrt", ["mse"], "rms"),
        node("Div", ["one", "rms"], "inv"),
        node("Mul", ["xf", "inv"], "n"),
        node("Cast", ["n"], "n16", to=F16),
        node("Mul", ["gamma", "n16"], "y"),
    ]
    gamma = (1 + 0.1 * RNG.standard_normal(8)).astype(np.float16)
    constants = [init("two", 2.0), init("axes", np.array([-1], np.int64)), init("eps", 1e-6), init("one", 1.0)]
    inputs, outputs = [info("x", ["b", "s", 8], F16)], [info("y", ["b", "s", 8], F16)]
    return model(nodes, inputs, outputs, [*constants, init("gamma", gamma)], opset=23)


def _constant_row() -> onnx.ModelProto:
    fill = helper.make_tensor("k", TensorProto.INT64, [1], [1])
    return model(
        [
            node("ConstantOfShape", ["shape"], "f", value=fill),
            node("Gather", ["table", "f"], "g", axis=0),
            node("Add", ["e", "g"], "y"),
        ],
        [info("e", [4, 4, 4])],
        ["y"],
        [init("table", _w(4, 4)), init("shape", np.array([4, 4], np.int64))],
    )


def _hardsigmoid(opset: int = 17) -> onnx.ModelProto:
    clip = node("Clip", ["a", "lo", "hi"], "c") if opset >= 11 else node("Clip", ["a"], "c", min=0.0, max=6.0)
    return model(
        [node("Add", ["x", "three"], "a"), clip, node("Div", ["c", "six"], "y")],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", 6.0), init("six", 6.0)],
        opset=opset,
    )


def _rmsnorm() -> onnx.ModelProto:
    return model(
        [
            node("Mul", ["x", "x"], "sq"),
            node("ReduceMean", ["sq", "axes"], "ms"),
            node("Add", ["ms", "eps"], "me"),
            node("Sqrt", ["me"], "r"),
            node("Div", ["x", "r"], "n"),
            node("Mul", ["gamma", "n"], "y"),
        ],
        [info("x", ["b", 8])],
        ["y"],
        [init("axes", np.array([-1], np.int64)), init("eps", 1e-6), init("gamma", _w(8))],
        opset=23,
    )


def _softmax(stable: bool, opset: int = 13) -> onnx.ModelProto:
    nodes = [node("ReduceMax", ["x"], "mx", axes=[1]), node("Sub", ["x", "mx"], "d")] if stable else []
    nodes.append(node("Exp", ["d" if stable else "x"], "e"))
    sums = node("ReduceSum", ["e", "axes"], "s") if opset >= 13 else node("ReduceSum", ["e"], "s", axes=[1])
    nodes += [sums, node("Div", ["e", "s"], "y")]
    params = [init("axes", np.array([1], np.int64))] if opset >= 13 else []
    return model(nodes, [info("x", [6, 6])], ["y"], params, opset=opset)


def _transposed_gemm(which: str) -> onnx.ModelProto:
    if which == "a":
        nodes = [node("Transpose", ["a"], "t", perm=[1, 0]), node("Gemm", ["t", "w", "c"], "y")]
        return model(nodes, [info("a", [3, 3])], ["y"], [init("w", _w(3, 4)), init("c", _w(4))])
    nodes = [node("Transpose", ["b"], "t", perm=[1, 0]), node("Gemm", ["w", "t", "c"], "y")]
    return model(nodes, [info("b", [4, 4])], ["y"], [init("w", _w(2, 4)), init("c", _w(4))])


def _scaled_gemm(op: str) -> onnx.ModelProto:
    return model(
        [node("Gemm", ["a", "w", "c"], "g", alpha=0.5), node(op, ["g", "s"], "y")],
        [info("a", [2, 3])],
        ["y"],
        [init("w", _w(3, 4)), init("c", _w(4)), init("s", 4.0)],
    )


def _gemm_relu() -> onnx.ModelProto:
    return model(
        [node("Gemm", ["a", "w", "c"], "g", transB=1), node("Relu", ["g"], "y")],
        [info("a", [2, 3])],
        ["y"],
        [init("w", _w(4, 3)), init("c", _w(4))],
    )


def _transposed_matmul(which: str) -> onnx.ModelProto:
    if which == "a":
        nodes = [node("Transpose", ["q"], "t", perm=[0, 2, 1]), node("MatMul", ["t", "k"], "y")]
    else:
        nodes = [node("Transpose", ["k"], "t", perm=[0, 2, 1]), node("MatMul", ["q", "t"], "y")]
    return model(nodes, [info("q", [4, 4, 4]), info("k", [4, 4, 4])], ["y"])


def _transposes() -> onnx.ModelProto:
    return model(
        [
            node("Transpose", ["x"], "t", perm=[1, 2, 0]),
            node("Transpose", ["t"], "u", perm=[2, 0, 1]),
            node("Relu", ["u"], "y"),
        ],
        [info("x", [2, 3, 4])],
        ["y"],
    )


def _identity_transpose() -> onnx.ModelProto:
    return model(
        [node("Transpose", ["x"], "t", perm=[0, 1, 2]), node("Relu", ["t"], "y")], [info("x", [2, 3, 4])], ["y"]
    )


def _layouts(outer: str, target: list[int] | None = None) -> Callable[[], onnx.ModelProto]:
    """Flatten(x) then a Reshape to ``target`` or an Unsqueeze at 0."""

    def build() -> onnx.ModelProto:
        second = node("Reshape", ["f", "s"], "y") if outer == "Reshape" else node("Unsqueeze", ["f", "s"], "y")
        values = target if outer == "Reshape" else [0]
        return model(
            [node("Flatten", ["x"], "f", axis=1), second],
            [info("x", [2, 3, 4])],
            ["y"],
            [init("s", np.array(values, np.int64))],
        )

    return build


def _pooled_transpose() -> onnx.ModelProto:
    """ConvNeXt's head as dynamo writes it: pooled NHWC [b, 1, 1, C] to NCHW, then flattened."""
    return model(
        [node("Relu", ["x"], "r"), node("Transpose", ["r"], "t", perm=[0, 3, 1, 2]), node("Reshape", ["t", "s"], "y")],
        [info("x", ["b", 1, 1, 8])],
        ["y"],
        [init("s", np.array([-1, 8], np.int64))],
    )


def _unsqueezes() -> onnx.ModelProto:
    return model(
        [node("Unsqueeze", ["x", "a1"], "u"), node("Unsqueeze", ["u", "a2"], "y")],
        [info("x", ["b", "s"])],
        ["y"],
        [init("a1", np.array([1], np.int64)), init("a2", np.array([0, 3], np.int64))],
    )


def _slices() -> onnx.ModelProto:
    """x[:, ::2][..., 1:7]: the second Slice's axis given as -1."""
    whole = np.iinfo(np.int64).max
    bounds = {"s1": [0], "e1": [whole], "a1": [1], "t1": [2], "s2": [1], "e2": [7], "a2": [-1]}
    return model(
        [node("Slice", ["x", "s1", "e1", "a1", "t1"], "s"), node("Slice", ["s", "s2", "e2", "a2"], "y")],
        [info("x", ["b", 6, 8])],
        ["y"],
        [init(name, np.array(values, np.int64)) for name, values in bounds.items()],
    )


def _casts(middle: int = TensorProto.FLOAT, source: int = F16) -> onnx.ModelProto:
    return model(
        [node("Cast", ["x"], "c", to=middle), node("Cast", ["c"], "d", to=source), node("Neg", ["d"], "y")],
        [info("x", [2, 3], source)],
        [info("y", None, source)],
    )


def _same_type_cast(to: int = TensorProto.FLOAT) -> onnx.ModelProto:
    return model([node("Cast", ["x"], "c", to=to), node("Neg", ["c"], "y")], [info("x", [2, 3])], [info("y", None, to)])


def _rows(cast: bool) -> Callable[[], onnx.ModelProto]:
    """BERT's position embedding: the table read at Slice(0..N-1, 0, seq) (float16 + Cast)."""

    def build() -> onnx.ModelProto:
        nodes = [
            node("Shape", ["x"], "seq", start=1),
            node("Slice", ["positions", "zero", "seq", "one", "one"], "pos"),
        ]
        table = _w(8, 8)
        if cast:
            nodes.append(node("Cast", ["table"], "tc", to=TensorProto.FLOAT))
        nodes.append(node("Gather", ["tc" if cast else "table", "pos"], "y", axis=0))
        params = [
            init("table", table.astype(np.float16) if cast else table),
            init("positions", np.arange(8, dtype=np.int64).reshape(1, 8)),
            init("zero", np.array([0], np.int64)),
            init("one", np.array([1], np.int64)),
        ]
        return model(nodes, [info("x", ["b", "s"])], ["y"], params)

    return build


def _cast_table(rows: int = 256) -> onnx.ModelProto:
    """A float16 vocabulary, widened to float32 and looked up by token ids."""
    nodes = [node("Cast", ["table"], "tc", to=TensorProto.FLOAT), node("Gather", ["tc", "ids"], "y", axis=0)]
    params = [init("table", _w(rows, 8).astype(np.float16))]
    return model(nodes, [info("ids", ["b", "s"], TensorProto.INT64)], ["y"], params)


def _attention_split_input(proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
    return {**make_feeds(proto), "split_shape": np.array([0, 0, 2, HIDDEN // 2], np.int64)}


def _standard_attention() -> onnx.ModelProto:
    proto = ort_attention(mask="bias")
    return at_opset(23)(proto)


def _cached_attention() -> onnx.ModelProto:
    """Attention (opset 23, 2 query heads, 1 KV head) on a KV cache: Concat(past, new) along the sequence axis
    for K and V, both graph outputs (present); past and new of one length, so the Concat's axis alone decides
    whether it is a cache."""
    shape = [2, 1, 3, 8]
    return model(
        [
            node("Concat", ["past_key", "k"], "present_key", axis=2),
            node("Concat", ["past_value", "v"], "present_value", axis=2),
            node("Attention", ["q", "present_key", "present_value"], "y"),
        ],
        [info("q", [2, 2, 3, 8]), *(info(n, shape) for n in ("k", "v", "past_key", "past_value"))],
        ["y", "present_key", "present_value"],
        opset=23,
    )


def _unknown_rank(*names: str) -> Change:
    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        for name in names:
            proto = set_shape(name, None)(proto)
        return proto

    return change


def _ort_attention_feeds() -> Mapping[str, np.ndarray]:
    return masked_feeds()


def _one_sample(proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
    """x of batch 1: the only batch a merge Reshape to Shape(x, start=1) takes."""
    return {"x": _w(1, 6, 4, 5)}


def _lowered(key: str) -> Callable[[], onnx.ModelProto]:
    """test_fuse_shatter's opset-23 (Split: 18) model of ``key`` (a copy: the table's is shared)."""
    return lambda: copy.deepcopy(LOWERED[key][0])


def _per_group(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The opset-18 GroupNormalization: the model at opset 20, scale and bias per group."""
    return set_const("b", _w(2))(set_const("g", _w(2))(at_opset(20)(proto)))


def _opset13_split(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The Split at opset 17: sizes as an input (8 does not split evenly in 3)."""
    out = set_attr("a", num_outputs=None)(at_opset(17)(proto))
    out.graph.node[0].input.append("sizes")
    out.graph.initializer.append(init("sizes", np.array([3, 3, 2], np.int64)))
    return out


def _rope_q(**kwargs: Any) -> Callable[[], onnx.ModelProto]:
    """RoPE of q alone (with k too, k's rotation would fuse in every perturbed model)."""
    return lambda: rope_model(roped=("q",), **kwargs)


# -- the table ----------------------------------------------------------------------------------------


NO_ATTR = "n/a: the pattern reads no attribute"
SLICE_INPUTS = "n/a: below opset 10 a Slice's bounds are attributes, which the pattern does not read (no match)"
ELEMENTWISE = "n/a: element-wise; the rule needs no shape"
NO_GATE = "n/a: no opset gate"
ONE_NODE = "n/a: one node"
INT_STASH = set_attr("y", stash_type=TensorProto.INT64)
LOWERED_NODE = "n/a: one node, whose outputs the lowering stands for (their names kept: fires)"
CONSTANTS_ONLY = "n/a: the rule reads constants only, whose shapes are known"
SOFTMAX_AXIS = Perturb(set_attr("probs", axis=2), None)
SPLIT_INPUT = Perturb(
    lambda p: ort_attention(mask=_mask_of(p), packed=_packed(p), extra="split-input"),
    "not provable",
    feeds=_attention_split_input,
)


BROADCAST_SETTINGS: dict[str, Any] = {"target": "ort", "enable": [BROADCAST_BIAS]}


def _bias_fed(name: str) -> Change:
    """Constant ``name`` (the attention bias) becomes a graph input of unknown rank."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = _copy(proto)
        (found,) = [t for t in out.graph.initializer if t.name == name]
        out.graph.initializer.remove(found)
        out.graph.input.append(helper.make_tensor_value_info(name, found.data_type, None))
        return out

    return change


def _levit_feeds(name: str) -> Callable[[onnx.ModelProto], Mapping[str, np.ndarray]]:
    """The inputs of the levit case's model with its constant ``name`` fed: the fixture's, and the constant."""

    def feeds(proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
        base = first_layer("levit_dynamo", BROADCAST_BIAS, BROADCAST_SETTINGS)
        return {**fixture_inputs(base), name: constant_of(base, name)}

    return feeds


def _mask_of(proto: onnx.ModelProto) -> str:
    return "bias" if any(i.name == "bias" for i in proto.graph.input) else "raw"


def _packed(proto: onnx.ModelProto) -> bool:
    return any(n.op_type == "Split" for n in proto.graph.node)


def _gelu_cases(ort: bool) -> dict[str, Case]:
    settings = {"target": "ort"} if ort else {}
    opset = 17 if ort else 20
    gate: Perturb | str = (
        Perturb(at_opset(20), None, note="above its max: standard Gelu takes it") if ort else below(20)
    )
    return {
        ("ort-gelu" if ort else "gelu-none"): Case(
            lambda: erf_gelu(opset),
            {"Gelu": 1},
            "e",
            Perturb(set_const("sqrt2", 1.5), None, note="a constant"),
            ELEMENTWISE,
            gate,
            settings,
        ),
        ("ort-fastgelu" if ort else "gelu-tanh"): Case(
            lambda: tanh_gelu(opset),
            {"FastGelu" if ort else "Gelu": 1},
            "t",
            Perturb(set_const("k", 0.05), None, note="a constant"),
            ELEMENTWISE,
            gate,
            settings,
        ),
    }


# (outer, inner) -> the op the chain becomes
_CHAIN_RESULTS = {
    ("Mul", "Mul"): "Mul",
    ("Add", "Add"): "Add",
    ("Add", "Sub"): "Add",
    ("Sub", "Add"): "Add",
    ("Sub", "Sub"): "Sub",
    ("Div", "Div"): "Div",
    ("Div", "Mul"): "Mul",
    ("Mul", "Div"): "Mul",
}


def _arith_cases() -> dict[str, Case]:
    return {
        f"{inner.lower()}-{outer.lower()}-constants": Case(
            _chain(outer, inner),
            {result: 1},
            "m",
            NO_ATTR,
            Perturb(set_shape("x", None), "could widen x's rank"),
            NO_GATE,
        )
        for (outer, inner), result in _CHAIN_RESULTS.items()
    }


def _skip_case(norm: str, interior: str) -> Case:
    op_type = "SkipLayerNormalization" if norm == "LayerNormalization" else "SkipSimplifiedLayerNormalization"
    axis: Perturb | str = (
        Perturb(set_attr("y", axis=1), "not over the last axis")
        if norm != "decomposed"
        else Perturb(set_attr("ms", axes=[1]), "trailing axes")
    )
    return Case(
        lambda: skip_norm(norm),
        {"MatMul": 1, op_type: 1},
        interior,
        axis,
        Perturb(set_shape("skip", None), "do not provably have one" if norm != "decomposed" else "known float type"),
        NO_GATE,
        {"target": "ort", "enable": ["norm"]},
    )


def _constant_skip(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The residual's ``skip`` operand a constant (a bias, to the rule) instead of an input."""
    out = _copy(proto)
    kept = [i for i in out.graph.input if i.name != "skip"]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.graph.initializer.append(init("skip", _w(1, 3, 8)))
    return out


RESIDUAL_SUM = Case(
    skip_norm,
    {"MatMul": 1, "Add": 1, "Sum": 1, "LayerNormalization": 1},
    "sum",
    Perturb(_constant_skip, "an operand is a constant", feeds=make_feeds, note="skip a constant"),
    Perturb(set_shape("skip", None), "do not provably have one 3-D float shape"),
    NO_GATE,
)


def _lowering_cases() -> dict[str, Case]:
    """The lowering rules fire only below the op's since-version (--target-opset): the opset
    column is a target opset that has the op (or an older form of it), and a refusal stops the
    conversion to the target, which lacks the op."""

    def lowering(
        key: str, expected: dict[str, int], wrong_attr: Perturb | str, unprovable: Perturb | str, gate: Perturb
    ) -> Case:
        return Case(
            _lowered(key), expected, LOWERED_NODE, wrong_attr, unprovable, gate, {"target_opset": LOWERED[key][1]}
        )

    def norm(op_type: str, key: str, expected: dict[str, int], since: int) -> Case:
        return lowering(
            key,
            expected,
            refused_lowering(op_type, INT_STASH, "stash_type 7 is not a float", note="stash_type int64"),
            refused_lowering(
                op_type,
                lambda p: set_shape("x", None)(set_attr("y", axis=2)(p)),
                "a positive axis on an input of unknown rank",
                note="axis=2",
            ),
            not_below(since),
        )

    statistics = {"ReduceMean": 2, "Sub": 1, "Mul": 2, "Add": 2, "Sqrt": 1, "Div": 1}
    return {
        "lower-layernorm": norm("LayerNormalization", "layernorm", statistics, 17),
        "lower-gelu": lowering(
            "gelu",
            {"Div": 1, "Erf": 1, "Add": 1, "Mul": 2},
            "n/a: both approximations lower (the tanh one: test_fuse_shatter)",
            "n/a: element-wise; it needs x's float type only, which a Gelu input has",
            not_below(20),
        ),
        "lower-rmsnorm": norm(
            "RMSNormalization", "rmsnorm", {"Mul": 2, "ReduceMean": 1, "Add": 1, "Sqrt": 1, "Div": 1}, 23
        ),
        "lower-groupnorm": lowering(
            "groupnorm",
            {**statistics, "Reshape": 4, "Shape": 1},
            refused_lowering("GroupNormalization", INT_STASH, "is not a float", note="stash_type int64"),
            refused_lowering("GroupNormalization", set_shape("x", None), "not provably of rank 3 or more"),
            Perturb(
                _per_group,
                "the target opset has this (opset 18) GroupNormalization",
                settings={"target_opset": 19},
                note="the opset-18 form, per group, --target-opset 19",
            ),
        ),
        "lower-attention": lowering(
            "attention-gqa-mask",
            {"Reshape": 6, "Transpose": 4, "Expand": 2, "MatMul": 2, "Mul": 1, "Add": 1, "Softmax": 1},
            refused_lowering("Attention", set_attr("y", softcap=1.0), "softcap", note="softcap=1"),
            refused_lowering("Attention", set_shape("q", None), "not provably all 3-D or all 4-D"),
            not_below(23),
        ),
        "lower-split": lowering(
            "split",
            {"Slice": 3},
            "n/a: any axis and number of outputs lower",
            refused_lowering("Split", set_shape("x", [2, "n"]), "the split axis is not static"),
            Perturb(
                _opset13_split,
                "an opset-13 Split converts as it is",
                settings={"target_opset": 16},
                note="an opset-13 Split, --target-opset 16",
            ),
        ),
    }


EXPORTED_SUM = (
    "n/a: the residual sum is exported (the fused op's 4th output) and a read bias Add leaves the bias out "
    "(test_fuse_ort_rules)"
)


def _rope_variant_cases(ort: bool) -> dict[str, Case]:
    """The interleaved and partial rotary rules: full interleaved (GPT-J without rotary_dim),
    partial rotate-half (Phi, GPT-NeoX) and partial interleaved (GPT-J)."""
    opset, prefix = (18, "ort-") if ort else (23, "")
    # the caches (Cos, Sin of the frequencies; rotate half: of Concat(f, f), then its first half), the 3-D form's
    # Reshapes (pairs), onnxruntime's flattened caches and their row ids
    caches = {"Cos": 1, "Sin": 1}
    ort_ids = {"Reshape": 3, "Shape": 1, "ReduceProd": 1, "Range": 1} if ort else {}
    forms = {
        "interleaved": (True, False, {**caches, **ort_ids, "Reshape": 5 if ort else 2}),
        "partial": (False, True, {**caches, **ort_ids, "Concat": 1, "Slice": 2}),
        "interleaved-partial": (True, True, {**caches, **ort_ids, "Reshape": 5 if ort else 2}),
    }
    cases = {}
    for suffix, (interleaved, partial, kept) in forms.items():

        def build(i: bool = interleaved, p: bool = partial, **changes: int) -> Callable[[], onnx.ModelProto]:
            return lambda: rope_variant_model(i, p, opset, **changes)

        wrong = (
            Perturb(lambda _, b=build: b(rest_start=HALF + 1)(), "the rotated part is not", note="the rest starts late")
            if partial
            else Perturb(lambda _, b=build: b(odd_start=0)(), "not the even and odd", note="both Slices start at 0")
        )
        dynamic = ["b", "s", 2, "d"] if interleaved else ["b", 2, "s", "d"]
        cases[f"{prefix}rotary-embedding-{suffix}"] = Case(
            build(),
            {"RotaryEmbedding": 1, **kept},
            "q_neg",
            wrong,
            Perturb(set_shape("q", dynamic), "the rotated size is not static"),
            NO_GATE if ort else below(23),
            {"target": "ort"} if ort else {},
            passes="shape-infer,fuse,dce",
        )
    return cases


CASES: dict[str, Case] = {
    **_rope_variant_cases(ort=False),
    **_rope_variant_cases(ort=True),
    **_gelu_cases(ort=False),
    **_gelu_cases(ort=True),
    "hardsigmoid": Case(
        _hardsigmoid,
        {"HardSigmoid": 1},
        "c",
        Perturb(lambda p: set_attr("c", max=5.0)(_hardsigmoid(10)), "not to [0, 6]"),
        ELEMENTWISE,
        NO_GATE,
    ),
    "hardswish": Case(
        lambda: hardswish(14),
        {"HardSwish": 1},
        "c",
        Perturb(set_const("hi", 5.0), "not to [0, 6]", note="a constant"),
        ELEMENTWISE,
        below(14),
    ),
    "hardswish-as-hardsigmoid": Case(
        lambda: hardswish(13),
        {"Mul": 1, "HardSigmoid": 1},
        "c",
        Perturb(set_const("hi", 5.0), "not to [0, 6]", note="a constant"),
        ELEMENTWISE,
        Perturb(at_opset(14), None, note="above its max: HardSwish takes it"),
    ),
    "ort-biasgelu": Case(
        bias_gelu,
        {"BiasGelu": 1},
        "h",
        Perturb(set_const("bias", _w(1)), "not a vector over x's last axis", note="a constant"),
        Perturb(set_shape("x", None), "known rank"),
        NO_GATE,
        {"target": "ort"},
    ),
    **_arith_cases(),
    "add-constant-row": Case(
        _constant_row,
        {"Add": 1},
        "g",
        Perturb(set_attr("g", axis=1), "not over rows"),
        Perturb(set_shape("e", ["a", 4, 4]), "do not provably have one shape"),
        NO_GATE,
    ),
    "attention": Case(
        _standard_attention,
        {"MatMul": 3, "Add": 3, "Attention": 1, "Shape": 1, "Concat": 1, "Expand": 1},
        "probs",
        SOFTMAX_AXIS,
        Perturb(lambda p: at_opset(23)(SPLIT_INPUT.change(p)), "not provable", feeds=_attention_split_input),
        below(23),
        passes="shape-infer,fuse,dce",
    ),
    "swish": Case(
        exported_silu,
        {"Swish": 1},
        "val_176",
        "n/a: Sigmoid and Mul have no attributes, and any scalar alpha is a Swish",
        ELEMENTWISE,
        below(24),
    ),
    "ort-quickgelu": Case(
        lambda: exported_silu(20),
        {"QuickGelu": 1},
        "val_176",
        "n/a: Sigmoid and Mul have no attributes, and any scalar alpha is a QuickGelu",
        ELEMENTWISE,
        Perturb(at_opset(24), None, note="above its max: the standard Swish takes it"),
        {"target": "ort"},
    ),
    "ort-multihead-attention": Case(
        lambda: exported_encoder_attention(opset=20),
        {"MultiHeadAttention": 1, "IsNaN": 1, "Where": 1},
        "transpose_3",
        Perturb(set_attr("transpose_3", perm=[0, 1, 2, 3]), None, note="merge Transpose perm=[0, 1, 2, 3]"),
        Perturb(set_shape("val_102", None), "not a 2-D to 4-D tensor", note="mask of unknown rank"),
        NO_GATE,
        {"target": "ort"},
        passes="shape-infer,fuse,dce",
    ),
    BROADCAST_BIAS: Case(
        lambda: first_layer("levit_dynamo", BROADCAST_BIAS, BROADCAST_SETTINGS),
        {"MatMul": 1, "Reshape": 5, "BatchNormalization": 1, "Split": 1, "MultiHeadAttention": 1},
        "softmax",
        Perturb(set_attr("transpose", perm=[0, 1, 2, 3]), None, note="merge Transpose perm=[0, 1, 2, 3]"),
        Perturb(_bias_fed("index"), "not a 2-D to 4-D tensor", _levit_feeds("index"), "the bias fed, of unknown rank"),
        NO_GATE,
        BROADCAST_SETTINGS,
        lambda: fixture_inputs(first_layer("levit_dynamo", BROADCAST_BIAS, BROADCAST_SETTINGS)),
        passes="shape-infer,fuse,dce",
    ),
    "attention-4d": Case(
        exported_attention,
        {"Attention": 1},
        "val_156",
        Perturb(set_attr("val_156", axis=2), "not over the last axis", note="Softmax axis=2"),
        Perturb(set_shape("add_199", None), "not static", note="Q of unknown rank"),
        below(23),
        passes="shape-infer,fuse,dce",
    ),
    "attention-merged-heads": Case(
        exported_merged_attention,
        # the bias split back by heads (Shape, Concat, Reshape) and added to the mask
        {"Shape": 1, "Concat": 1, "Reshape": 1, "Add": 1, "Attention": 1},
        "val_94",
        Perturb(set_attr("val_94", axis=2), "not over the last axis", note="Softmax axis=2"),
        Perturb(set_shape("transpose", None), "Q or K^T is not provably merged", note="Q of unknown rank"),
        below(23),
        passes="shape-infer,fuse,dce",
    ),
    "ort-multihead-attention-merged": Case(
        lambda: exported_merged_attention("_unsafe_view_3", opset=20),
        # and Q, a graph input here, transposed and merged for the op
        {"Transpose": 1, "Reshape": 2, "Shape": 1, "Concat": 1, "Add": 1, "MultiHeadAttention": 1},
        "val_94",
        Perturb(set_attr("permute", perm=[0, 1, 2, 3]), None, note="merge Transpose perm=[0, 1, 2, 3]"),
        Perturb(set_shape("transpose", None), "Q or K^T is not provably merged", note="Q of unknown rank"),
        NO_GATE,
        {"target": "ort"},
        passes="shape-infer,fuse,dce",
    ),
    "attention-heads-3d": Case(
        exported_encoder_attention,
        {"Attention": 1},
        "transpose_3",
        Perturb(set_attr("transpose_3", perm=[0, 1, 2, 3]), None, note="merge Transpose perm=[0, 1, 2, 3]"),
        Perturb(set_shape("linear", None), "head split of Q is not provable", note="Q of unknown rank"),
        Perturb(at_opset(22), None, note="opset 22: no Attention to take the heads into"),
        passes="shape-infer,fuse,dce",
    ),
    "attention-kv-cache": Case(
        _cached_attention,
        {"Attention": 1},
        "n/a: the Concats are the rule's exported entries (the present outputs), and nothing else is interior",
        Perturb(
            set_attr("present_key", "present_value", axis=1),
            "not a 4-D cache joined along the sequence axis",
            note="Concats along the heads (axis=1)",
        ),
        Perturb(_unknown_rank("past_key", "k"), "not a 4-D cache", note="past and new K of unknown rank"),
        "n/a: the rule's root is an Attention, which no opset below 23 has",
        passes="shape-infer,fuse,dce",
    ),
    **{
        name: Case(
            build,
            {"Attention": 1, "Cast": 1},
            "probs",
            SOFTMAX_AXIS,
            SPLIT_INPUT,
            NO_GATE,
            {"target": "ort"},
            _ort_attention_feeds,
            "shape-infer,fuse,dce",
        )
        for name, build in (
            ("ort-attention", ort_attention),
            ("ort-attention-packed", lambda: ort_attention(packed=True)),
        )
    },
    "conv-bn": Case(
        conv_bn,
        {"Conv": 1},
        "c",
        Perturb(training, None, note="training_mode=1"),
        CONSTANTS_ONLY,
        NO_GATE,
    ),
    **{
        f"conv-{op.lower()}": Case(
            lambda op=op: conv_channel(_w(4), op),
            {"Conv": 1, "Transpose": 1},
            "c",
            # channels last no more: the operand would scale H, which is as long as C here
            Perturb(
                lambda p: set_attr("t", perm=[0, 1, 3, 2])(set_shape("x", [1, 3, 4, 4])(p)),
                "not per-channel",
                feeds=make_feeds,
            ),
            Perturb(set_shape("x", None), "output rank is unknown"),
            NO_GATE,
        )
        for op in ("Mul", "Add", "Sub")
    },
    "mul-conv": Case(
        lambda: conv_input_scale(_w(4, 1, 1)),
        {"Conv": 1},
        "m",
        Perturb(set_const("k", _w(4, 5, 1)), "not per input channel", note="the scale varies along H"),
        Perturb(set_shape("x", None), "the input's rank is unknown"),
        NO_GATE,
        {"fuse_late": True},
    ),
    "ort-fusedconv": Case(
        conv_act,
        {"FusedConv": 1},
        "c",
        "n/a: FusedConv takes the Conv's attributes as they are",
        ELEMENTWISE,
        NO_GATE,
        {"target": "ort"},
    ),
    "ort-fusedconv-sum": Case(
        residual_block,
        {"Conv": 1, "FusedConv": 1},
        "s",
        "n/a: FusedConv takes the Conv's attributes as they are",
        Perturb(set_shape("x", None), "not provably the Conv's"),
        NO_GATE,
        {"target": "ort"},
    ),
    "gemm-bn": Case(
        gemm_bn,
        {"Gemm": 1},
        "p",
        Perturb(training, None, note="training_mode=1"),
        Perturb(set_shape("a", None), "not 2-D"),
        NO_GATE,
    ),
    "pad-into-consumer": Case(
        lambda: padded("Conv", [0, 0, 1, 2, 0, 0, 2, 1]),
        {"Conv": 1},
        "p",
        Perturb(set_attr("p", mode="reflect"), "not a constant-mode Pad"),
        Perturb(set_shape("x", None), "the padded rank is unknown"),
        NO_GATE,
    ),
    "matmul-add-gemm": Case(
        lambda: matmul_add(["n", 3]),
        {"Gemm": 1},
        "p",
        NO_ATTR,
        Perturb(set_shape("a", None), "not 2-D"),
        NO_GATE,
    ),
    **{
        f"transpose-into-gemm-{which}": Case(
            lambda which=which: _transposed_gemm(which),
            {"Gemm": 1},
            "t",
            Perturb(set_attr("t", perm=[0, 1]), "not a 2-D swap"),
            Perturb(set_shape(which, None), "not a 2-D swap"),
            NO_GATE,
        )
        for which in ("a", "b")
    },
    **{
        f"gemm-{op.lower()}-scalar": Case(
            lambda op=op: _scaled_gemm(op),
            {"Gemm": 1},
            "g",
            Perturb(set_const("s", [2.0, 3.0, 4.0, 5.0]), "not a scalar", note="a constant"),
            CONSTANTS_ONLY,
            NO_GATE,
        )
        for op in ("Mul", "Div")
    },
    "ort-fusedgemm": Case(
        _gemm_relu,
        {"FusedGemm": 1},
        "g",
        NO_ATTR,
        ELEMENTWISE,
        NO_GATE,
        {"target": "ort", "enable": ["ort-fusedgemm"]},
    ),
    **{
        f"ort-fusedmatmul-{op.lower()}": Case(
            lambda op=op: scaled_matmul(op, transpose=False),
            {"FusedMatMul": 1},
            "p",
            Perturb(set_const("s", [2.0, 3.0, 4.0, 5.0, 6.0]), "not a scalar", note="a constant"),
            Perturb(set_shape("q", None), "rank is unknown"),
            NO_GATE,
            {"target": "ort"},
        )
        for op in ("Mul", "Div")
    },
    **{
        f"ort-transpose-into-matmul-{which}": Case(
            lambda which=which: _transposed_matmul(which),
            {"FusedMatMul": 1},
            "t",
            Perturb(set_attr("t", perm=[1, 0, 2]), "does not swap the last two dims"),
            Perturb(set_shape("q" if which == "a" else "k", None), "does not swap the last two dims"),
            NO_GATE,
            {"target": "ort"},
        )
        for which in ("a", "b")
    },
    **{
        name: Case(
            build,
            {"LayerNormalization": 1},
            "mean",
            Perturb(set_attr("mean", "var", axes=[1]), "trailing axes"),
            Perturb(set_shape("x", ["b", 3, "h"]), "normalized dims are not static"),
            below(17),
        )
        for name, build in (
            ("layernorm", layer_norm),
            ("layernorm-no-bias", truncated(layer_norm, "g")),
            ("layernorm-plain", truncated(layer_norm, "n")),
        )
    },
    **{
        name: Case(
            build,
            {"RMSNormalization": 1},
            "ms",
            Perturb(set_const("axes", [0]), "trailing axes", note="the axes input"),
            Perturb(set_shape("x", ["b", "h"]), "normalized dims are not static"),
            below(23),
        )
        for name, build in (("rmsnorm", _rmsnorm), ("rmsnorm-plain", truncated(_rmsnorm, "n")))
    },
    # --target ort, at an opset below RMSNormalization's: onnxruntime's SimplifiedLayerNormalization
    **{
        name: Case(
            lambda build=build: at_opset(18)(build()),
            {"SimplifiedLayerNormalization": 1},
            "ms",
            Perturb(set_const("axes", [0]), "trailing axes", note="the axes input"),
            Perturb(set_shape("x", ["b", "h"]), "normalized dims are not static"),
            NO_GATE,
            {"target": "ort"},
        )
        for name, build in (("ort-rmsnorm", _rmsnorm), ("ort-rmsnorm-plain", truncated(_rmsnorm, "n")))
    },
    "ort-rmsnorm-round-trip": Case(
        lambda: at_opset(18)(_rms_round_trip()),
        {"SimplifiedLayerNormalization": 1},
        "n",
        Perturb(set_const("eps", np.full(8, 1e-6)), "epsilon is not a scalar", note="a constant: eps per channel"),
        Perturb(set_shape("x", None), "no known float type and rank"),
        NO_GATE,
        {"target": "ort"},
    ),
    "rmsnorm-round-trip": Case(
        _rms_round_trip,
        {"RMSNormalization": 1},
        "n",
        Perturb(set_const("eps", np.full(8, 1e-6)), "epsilon is not a scalar", note="a constant: eps per channel"),
        Perturb(set_shape("x", None), "no known float type and rank"),
        below(23),
    ),
    **{
        name: Case(
            build,
            {"GroupNormalization": 1},
            "grouped",
            # the merge Reshape drops the batch axis: x's shape is no longer restored
            Perturb(set_attr("x_shape", start=1), "not provably back to x's shape", _one_sample, "Shape(x) start=1"),
            Perturb(set_shape("x", ["b", "c", "h", 5]), "the channel dim is not static"),
            below(21),
        )
        for name, build in (
            ("groupnorm", group_norm),
            ("groupnorm-no-bias", truncated(lambda: group_norm("decomposed"), "scaled")),
            # two dynamic dims: reshape-one-unknown cannot take the root, which would hide the near miss
            (
                "groupnorm-plain",
                truncated(lambda: set_shape("x", ["b", 6, "h", 5])(group_norm("decomposed")), "merged"),
            ),
        )
    },
    "rotary-embedding": Case(
        _rope_q(),
        {"RotaryEmbedding": 1},
        "q_neg",
        Perturb(lambda p: _rope_q(swapped=True)(), "not the two halves", note="the Slices' bounds swapped"),
        Perturb(set_shape("q", ["b", 2, "s", "d"]), "the rotated size is not static"),
        below(23),
        passes="shape-infer,fuse,dce",
    ),
    "ort-rotary-embedding": Case(
        lambda: at_opset(18)(_rope_q()()),
        {"RotaryEmbedding": 1},
        "q_neg",
        Perturb(
            lambda p: at_opset(18)(_rope_q(swapped=True)()), "not the two halves", note="the Slices' bounds swapped"
        ),
        Perturb(set_shape("q", ["b", 2, "s", "d"]), "the rotated size is not static"),
        NO_GATE,
        {"target": "ort"},
        passes="shape-infer,fuse,dce",
    ),
    "ort-embedlayernorm": Case(
        lambda: embed("row"),
        {"EmbedLayerNormalization": 1, "Cast": 1},
        "typed",
        Perturb(set_attr("y", axis=1), "not over the last axis"),
        Perturb(set_shape("input_ids", None), "not 2-D int32 / int64 of known shape"),
        NO_GATE,
        {"target": "ort", "enable": ["embed"]},
        passes="shape-infer,fuse,dce",
    ),
    **_lowering_cases(),
    "gemm-as-matmul": Case(
        projections,
        {"MatMul": 3},
        "n/a: one node, the Gemm (an Add reading its MatMul sibling stops it: test_fuse_shatter)",
        Perturb(lambda p: set_attr("q", "v", transA=1)(set_shape("x", [64, 64])(p)), "transA=1", make_feeds),
        Perturb(set_shape("x", None), None, note="x's depth, so no provable bare MatMul sibling"),
        NO_GATE,
    ),
    "kronecker-matmul": Case(
        lambda: kronecker(np.kron(_w(8, 6), _w(32, 48)), ["b", 5, 256]),
        {"Reshape": 2, "MatMul": 2},
        ONE_NODE,
        Perturb(nudged("w", (3, 5), 1e-3), None, note="a constant: one weight entry off the product"),
        Perturb(set_shape("x", None), "x has no known rank"),
        NO_GATE,
    ),
    **{
        name: Case(
            lambda stable=stable: _softmax(stable),
            {"Softmax": 1},
            "s",
            Perturb(set_attr("s", keepdims=0), "with keepdims"),
            Perturb(set_shape("x", None), "known float type and rank"),
            Perturb(lambda p, stable=stable: _softmax(stable, opset=12), "needs opset >= 13"),
        )
        for name, stable in (("softmax", True), ("softmax-unstable", False))
    },
    "ort-skiplayernorm": _skip_case("LayerNormalization", EXPORTED_SUM),
    "layernorm-residual-sum": RESIDUAL_SUM,
    "layernorm-tf": Case(
        keras_layer_norm,
        {"LayerNormalization": 1},
        "inv",
        Perturb(set_const("gamma", _w(3, 1)), "varies along axes that are not normalized", note="gamma per row"),
        Perturb(set_shape("x", None), "no known float type and rank"),
        below(17),
    ),
    "ort-skiprmsnorm": _skip_case("RMSNormalization", EXPORTED_SUM),
    "ort-skiprmsnorm-decomposed": _skip_case("decomposed", "ms"),
    "transpose-transpose": Case(
        _transposes,
        {"Relu": 1},
        "t",
        "n/a: any two perms compose",
        Perturb(lambda p: set_shape("x", None)(set_attr("t", "u", perm=None)(p)), "the rank is unknown"),
        NO_GATE,
    ),
    "transpose-identity": Case(
        _identity_transpose,
        {"Relu": 1},
        "n/a: one node",
        Perturb(set_attr("t", perm=[0, 2, 1]), "not the identity"),
        "n/a: the perm decides",
        NO_GATE,
    ),
    "reshape-chain": Case(
        _layouts("Reshape", [4, -1]),
        {"Reshape": 1},
        "f",
        Perturb(
            lambda proto: set_const("s", [0, -1])(set_shape("x", ["b", 3, 4])(proto)),
            "copies a dim (0) and has a -1 besides",
            note="a dynamic dim copied beside a -1",
        ),
        "n/a: the constant target decides",
        NO_GATE,
    ),
    "reshape-transpose": Case(
        _pooled_transpose,
        {"Relu": 1, "Reshape": 1},
        "t",
        Perturb(set_attr("t", perm=[3, 0, 1, 2]), "moves data", note="a perm moving data"),
        Perturb(set_shape("x", ["b", "h", 1, 8]), "moves data", note="a dim not provably 1"),
        NO_GATE,
    ),
    "layout-chain-static": Case(
        _layouts("Unsqueeze"),
        {"Reshape": 1},
        "f",
        NO_ATTR,
        Perturb(set_shape("x", ["b", 3, 4]), "not static"),
        NO_GATE,
    ),
    "unsqueeze-unsqueeze": Case(
        _unsqueezes,
        {"Unsqueeze": 1},
        "u",
        NO_ATTR,
        Perturb(set_shape("x", None), "the axes or the rank are unknown"),
        NO_GATE,
    ),
    "slice-slice": Case(
        _slices,
        {"Slice": 1},
        "s",
        Perturb(set_const("a2", [1]), "share an axis", note="the second Slice's axis the first's"),
        Perturb(set_shape("x", None), "a negative axis needs x's rank"),
        SLICE_INPUTS,
    ),
    "reshape-one-unknown": Case(
        lambda: computed_reshape([4]),
        {"Reshape": 1},
        "n/a: one node (the shape plumbing goes with it when nothing else reads it)",
        Perturb(set_attr("y", allowzero=1), "allowzero"),
        Perturb(set_shape("x", None), "not provable"),
        NO_GATE,
        passes="shape-infer,fuse,dce",
    ),
    "cast-chain": Case(
        _casts,
        {"Neg": 1},
        "c",
        Perturb(lambda p: _casts(middle=F16, source=TensorProto.FLOAT), "may lose values", feeds=make_feeds),
        "n/a: types only",
        NO_GATE,
    ),
    "cast-to-same-type": Case(
        _same_type_cast,
        {"Neg": 1},
        "n/a: one node",
        Perturb(lambda p: _same_type_cast(F16), "a real conversion"),
        "n/a: types only",
        NO_GATE,
    ),
    "tied-weight-gemm": Case(
        lambda: tied(["batch", "seq", 6]),
        {"Gather": 1, "Add": 1, "Flatten": 1, "Gemm": 1, "Shape": 1, "Concat": 1, "Reshape": 1},
        "wte_t",
        "n/a: a 2-D Transpose has one perm that swaps",
        Perturb(lambda p: set_shape("x", None)(set_shape("ids", None)(p)), "rank is not provable"),
        Perturb(at_opset(14), "needs opset 15", note="dynamic dims need Shape(end), opset 15"),
    ),
    "gather-before-cast": Case(
        _cast_table,
        {"Gather": 1, "Cast": 1},
        "tc",
        Perturb(set_attr("y", axis=1), "not over rows"),
        CONSTANTS_ONLY,
        "n/a: no opset gate (Gather and Cast exist at every opset the engine runs)",
    ),
    "gather-consecutive-rows": Case(
        _rows(cast=False),
        {"Shape": 1, "Slice": 1},
        "pos",
        Perturb(set_attr("y", axis=1), "not over rows"),
        CONSTANTS_ONLY,
        "n/a: below opset 10 Slice takes attributes, which the pattern does not match",
    ),
}


# -- cases on exporter-written graphs ------------------------------------------------------------------


@dataclass(frozen=True)
class At:
    """A perturbation of an exporter case, made at the values the rule's bindings name there (fuse_exported)."""

    change: Callable[[Found], Change]
    reason: str | None
    note: str
    cuts: tuple[str, ...] = ()  # bindings whose values become graph inputs (fed what the base computes)


def attr_at(binding: str, reason: str | None, **attrs: Any) -> At:
    """Set attributes on the node bound to ``binding``."""
    note = f"{binding} " + ", ".join(f"{k}={v}" for k, v in attrs.items())
    return At(lambda found: set_attr(found.names[binding], **attrs), reason, note)


def constant_at(binding: str, values: Callable[[np.ndarray], np.ndarray], reason: str | None, note: str) -> At:
    """Replace the constant bound to ``binding`` (an initializer or a Constant node's) by ``values`` of it."""

    def change(found: Found) -> Change:
        name = found.names[binding]
        return lambda proto: with_constant(proto, name, values(constant_of(proto, name)))

    return At(change, reason, f"the constant {binding}: {note}")


def untyped_at(bindings: tuple[str, ...], reason: str | None, undeclared: bool = False, why: str = "") -> At:
    """Cut the graph at the values bound to ``bindings``: graph inputs of unknown rank, fed what the base computes
    (``undeclared``: no shape the exporter declared is left either)."""
    note = f"{' and '.join(bindings)} of unknown rank, cut from what computed {'it' if len(bindings) == 1 else 'them'}"
    note += "; no declared shapes" if undeclared else ""
    note += f": {why}" if why else ""

    def change(found: Found) -> Change:
        return lambda proto: untyped_cut(proto, [found.names[b] for b in bindings], undeclared)

    return At(change, reason, note, bindings)


def target_opset(version: int, reason: str | None, why: str = "") -> Perturb:
    """The run's target opset (the export's own is older: the fuse pass converts it up first)."""
    note = f"--target-opset {version}" + (f": {why}" if why else "")
    return Perturb(_copy, reason, settings={"target_opset": version}, note=note)


@dataclass(frozen=True)
class Exported:
    """A rule's case on exporter-written graphs: each of ``fixtures`` cut after the rule's first match (the whole
    export where the rule's root is another rule's node), run at ``settings``; ``expected``: how many of these ops
    the fused graph holds; each perturbation made at the values the rule's bindings name (a string: why one does
    not apply). The interior value read elsewhere or made a graph output is the removed value nearest the root."""

    fixtures: tuple[str, ...]
    expected: dict[str, int]
    wrong: At | str
    unprovable: At | str
    gate: Perturb | str
    settings: dict[str, Any] = field(default_factory=dict)
    interior: str = ""  # "n/a: ..." where the match removes no value but its root's
    passes: str = "shape-infer,fuse,dce"


def _per_row(values: np.ndarray) -> np.ndarray:
    """A (1, 1, C) scale made to vary along the 6 rows of make_keras.py's (batch, 6, C) features."""
    rows = np.linspace(0.5, 1.5, 6, dtype=values.dtype).reshape(1, 6, 1)
    return (np.broadcast_to(values, (1, 6, values.shape[-1])) * rows).astype(values.dtype)


def _per_channel(values: np.ndarray) -> np.ndarray:
    return np.full(32, values.item(), values.dtype)  # the fixtures' hidden size (make.py's H)


def _per_row_of_channels(values: np.ndarray) -> np.ndarray:
    """A (C, 1, 1) scale made to vary along the 8 rows of make.py's poolformer maps too."""
    rows = np.linspace(0.5, 1.5, 8, dtype=values.dtype).reshape(1, 8, 1)
    return (values.reshape(-1, 1, 1) * rows).astype(values.dtype)


def _halves_swapped(found: Found) -> Change:
    """The rotation's two Slices read each other's bounds: x1 the second half, x2 the first."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = _copy(proto)
        slices = {n.output[0]: n for n in out.graph.node if n.output[0] in (found.names["x1"], found.names["x2"])}
        first, second = slices[found.names["x1"]], slices[found.names["x2"]]
        first.input[1:3], second.input[1:3] = list(second.input[1:3]), list(first.input[1:3])
        return out

    return change


def slice_start_at(binding: str, shift: int, reason: str, note: str) -> At:
    """The Slice bound to ``binding`` starts ``shift`` later, through a constant of its own (an exporter may share
    the start with other nodes)."""

    def change(found: Found) -> Change:
        def shifted(proto: onnx.ModelProto) -> onnx.ModelProto:
            out = _copy(proto)
            sliced = next(n for n in out.graph.node if n.output[0] == found.names[binding])
            start = constant_of(out, sliced.input[1]) + shift
            out.graph.initializer.append(numpy_helper.from_array(start, f"{binding}_shifted_start"))
            sliced.input[1] = f"{binding}_shifted_start"
            return out

        return shifted

    return At(change, reason, note)


EVEN_ODD_ONE_START = slice_start_at("x2", -1, "not the even and odd", "the odd entries start at 0")
REST_STARTS_LATE = slice_start_at("rest", 1, "the rotated part is not", "the rest starts one later")

ORT_DEFAULT_DOMAIN = "n/a: no opset gate (onnxruntime registers SimplifiedLayerNormalization at any opset)"

EXPORTED: dict[str, Exported | str] = {
    "swish": Exported(
        ("llama_dynamo", "llama_ts"),
        {"Swish": 1},
        "n/a: Sigmoid and Mul have no attributes and read no constant (any scalar alpha is a Swish)",
        "n/a: element-wise; the rule needs no shape",
        target_opset(23, "needs opset >= 24"),
        {"target_opset": 24},
    ),
    "ort-quickgelu": Exported(
        ("llama_dynamo", "llama_ts"),
        {"QuickGelu": 1},
        "n/a: Sigmoid and Mul have no attributes and read no constant (any scalar alpha is a QuickGelu)",
        "n/a: element-wise; the rule needs no shape",
        target_opset(24, None, "the standard Swish takes it"),
        {"target": "ort"},
    ),
    "attention-4d": Exported(
        ("gpt2_ts", "llama_dynamo"),
        {"Attention": 1},
        attr_at("softmax", "not over the last axis", axis=2),
        untyped_at(("v",), "not static"),
        target_opset(22, "needs opset >= 23"),
        {"target_opset": 23},
    ),
    **{
        name: Exported(
            ("bloom_dynamo", "bmm_attention_dynamo"),
            {op_type: 1},
            attr_at("softmax", "not over the last axis", axis=1),
            untyped_at(("v3",), "V or the scores are not provably merged"),
            gate,
            settings,
        )
        # BLOOM's Softmax on (batch, heads, S, T) and fairseq's on the merged scores, from the dynamo exporter, which
        # declares the symbolic shapes the rule proves its merges with; the TorchScript exports declare none, and
        # the cut here gives their Reshapes onnx's unrelated unk__ dims (test_fuse_exports runs them whole)
        for name, op_type, gate, settings in (
            ("attention-merged-heads", "Attention", target_opset(22, "needs opset >= 23"), {"target_opset": 23}),
            ("ort-multihead-attention-merged", "MultiHeadAttention", NO_GATE, {"target": "ort"}),
        )
    },
    "attention-heads-3d": Exported(
        ("bert_dynamo",),
        {"Attention": 1},
        attr_at("merge_t", None, perm=[0, 1, 2, 3]),
        untyped_at(("q",), "head split of Q is not provable"),
        target_opset(22, None, "no Attention to take the heads into"),
        {"target_opset": 23},
    ),
    "attention-kv-cache": Exported(
        ("llama_kv_ts", "llama_kv_dynamo"),
        {"Attention": 1},
        "n/a: the Concats' one attribute is the axis, and the export runs on no other (the repeat of the K / V heads"
        " fails); the case built here joins along the heads",
        untyped_at(("past_key", "past_value"), None, True, "attention-4d then writes no Attention to root at"),
        "n/a: the rule's root is an Attention, which no opset below 23 has",
        {"target_opset": 23},
        interior="n/a: the Concats are the rule's exported entries (the present outputs), and nothing else is interior",
    ),
    "ort-multihead-attention": Exported(
        ("bert_ts", "bert_dynamo"),
        {"MultiHeadAttention": 1},
        attr_at("softmax", "not over the last axis", axis=2),
        untyped_at(("v",), "not static"),
        NO_GATE,
        {"target": "ort"},
    ),
    BROADCAST_BIAS: Exported(
        ("levit_dynamo", "levit_ts"),
        {"MultiHeadAttention": 1},
        attr_at("softmax", "not over the last axis", axis=2),
        untyped_at(("merge_shape",), "not provably back to"),
        NO_GATE,
        BROADCAST_SETTINGS,
    ),
    "layernorm-residual-sum": Exported(
        ("gpt2_dynamo", "gpt2_ts"),
        {"Sum": 1, "LayerNormalization": 5},
        attr_at("ln", "last axis", axis=1),
        untyped_at(("skip",), "do not provably have one 3-D float shape"),
        NO_GATE,
    ),
    "layernorm-tf": Exported(
        ("keras_layernorm",),
        {"LayerNormalization": 1},
        constant_at("gamma", _per_row, "varies along axes that are not normalized", "gamma (1, 6, C), per row"),
        untyped_at(("x",), "no known float type and rank"),
        target_opset(16, None, "LayerNormalization came in 17; the rule is not tried"),
    ),
    # Late rules fire on static dims only, which no fixture has (their batch and sequence are dynamic): their CASES
    # are the bert_dynamo fixture's MLP as exported, its sequence fixed as a ViT's or a Whisper encoder's is.
    "matmul-add-gemm-projection": "n/a: its CASES entry is the exported bert_dynamo MLP at a static sequence",
    "reshape-through-elementwise": "n/a: its CASES entry is the exported bert_dynamo MLP at a static sequence",
    "unsqueeze-unsqueeze": Exported(
        ("mpt_dynamo",),
        {"Unsqueeze": 1},
        "n/a: the pattern reads no attribute (the axes are constant inputs)",
        untyped_at(("x",), "the axes or the rank are unknown", undeclared=True),
        NO_GATE,
        interior="n/a: the inner Unsqueeze (the causal mask's arange[None, None]) is exported: its other Unsqueeze "
        "reader keeps a copy; the hand-built case's reader and output perturbations stand",
    ),
    "matmul-add-gemm-projection-reshaped": Exported(
        ("bert_dynamo",),
        {"Gemm": 1},
        attr_at("reshape", "may copy a dim of the product", allowzero=0),
        untyped_at(("x",), "the product's rank is unknown", undeclared=True),
        NO_GATE,
        {"fuse_late": True},
    ),
    "reshape-through-elementwise-region": "n/a: its CASES entry is the exported bert_ts MLP at a static sequence",
    "mul-conv": Exported(
        ("poolformer_dynamo", "poolformer_ts"),
        {"Mul": 1, "Conv": 2},  # the second norm's gamma gone into the MLP's first Conv
        constant_at("c", _per_row_of_channels, "not per input channel", "gamma (C, 8, 1), varying along H"),
        untyped_at(("x",), "the input's rank is unknown"),
        NO_GATE,
        {"fuse_late": True},
    ),
    "ort-rmsnorm": Exported(
        ("llama_dynamo",),
        {"SimplifiedLayerNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        ORT_DEFAULT_DOMAIN,
        {"target": "ort"},
    ),
    "ort-rmsnorm-plain": Exported(
        ("llama_ts",),
        {"SimplifiedLayerNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        ORT_DEFAULT_DOMAIN,
        {"target": "ort"},
    ),
    "ort-rmsnorm-round-trip": Exported(
        ("llama_fp16_dynamo", "llama_fp16_ts"),
        {"SimplifiedLayerNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        ORT_DEFAULT_DOMAIN,
        {"target": "ort"},
    ),
    "rmsnorm-round-trip": Exported(
        ("llama_fp16_ts", "llama_fp16_dynamo"),
        {"RMSNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        target_opset(22, "needs opset >= 23"),
        {"target_opset": 23},
    ),
    "ort-rotary-embedding": Exported(
        ("llama_dynamo", "llama_ts"),
        {"RotaryEmbedding": 1},
        At(_halves_swapped, "not the two halves", "the two Slices' bounds swapped"),
        untyped_at(("x",), "not a 4-D float32 or float16 tensor"),
        NO_GATE,
        {"target": "ort"},
    ),
    **{
        f"{prefix}rotary-embedding-{suffix}": Exported(
            fixtures,
            {"RotaryEmbedding": 1},
            wrong,
            untyped_at(("x",), "not a 4-D float32 or float16 tensor"),
            gate,
            settings,
        )
        for prefix, gate, settings in (
            ("ort-", NO_GATE, {"target": "ort"}),
            ("", target_opset(22, "needs opset >= 23"), {"target_opset": 23}),
        )
        for suffix, fixtures, wrong in (
            ("interleaved", ("gptj_dynamo", "gptj_ts"), EVEN_ODD_ONE_START),
            ("partial", ("phi_dynamo", "phi_ts"), REST_STARTS_LATE),
            ("interleaved-partial", ("gptj_dynamo", "gptj_ts"), REST_STARTS_LATE),
        )
    },
    **{
        name: Exported(
            fixtures,
            {op_type: 1},
            constant_at("half", lambda v: v * 0.9, None, "0.45, not a GELU"),
            ELEMENTWISE,
            gate,
            settings,
        )
        for name, fixtures, op_type, gate, settings in (
            (
                "gelu-tanh",
                ("bloom_dynamo", "bloom_ts"),
                "Gelu",
                target_opset(19, "needs opset >= 20"),
                {"target_opset": 23},
            ),
            # the dynamo export is at opset 20, where the standard Gelu takes it
            (
                "ort-fastgelu",
                ("bloom_ts",),
                "FastGelu",
                target_opset(20, None, "standard Gelu takes it"),
                {"target": "ort"},
            ),
        )
    },
    "slice-slice": Exported(
        ("levit_dynamo", "levit_ts"),
        {"Slice": 1},
        constant_at("axes_outer", lambda axes: axes - 1, "share an axis", "the second Slice's axis the first's"),
        "n/a: the exporters write non-negative axes, which need no shape (the case built here has a negative one)",
        SLICE_INPUTS,
    ),
    "reshape-transpose": Exported(
        ("convnext_dynamo",),
        {"Transpose": 17},  # the export's 18, the head's gone
        attr_at("inner", "moves data", perm=[3, 0, 1, 2]),
        untyped_at(("x",), "the input's rank is unknown"),
        NO_GATE,
    ),
}

# The rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them gains an exporter
# case by moving to EXPORTED; a newer rule has its entry there (test_every_newer_rule_has_an_exporter_case).
BEFORE_EXPORTS = frozenset(
    {
        "add-add-constants",
        "add-constant-row",
        "add-sub-constants",
        "attention",
        "cast-chain",
        "cast-to-same-type",
        "conv-add",
        "conv-bn",
        "conv-mul",
        "conv-sub",
        "div-div-constants",
        "div-mul-constants",
        "gather-before-cast",
        "gather-consecutive-rows",
        "gelu-none",
        "gemm-as-matmul",
        "gemm-bn",
        "gemm-div-scalar",
        "gemm-mul-scalar",
        "groupnorm",
        "groupnorm-no-bias",
        "groupnorm-plain",
        "hardsigmoid",
        "hardswish",
        "hardswish-as-hardsigmoid",
        "kronecker-matmul",
        "layernorm",
        "layernorm-no-bias",
        "layernorm-plain",
        "layout-chain-static",
        "lower-attention",
        "lower-gelu",
        "lower-groupnorm",
        "lower-layernorm",
        "lower-rmsnorm",
        "lower-split",
        "matmul-add-gemm",
        "mul-div-constants",
        "mul-mul-constants",
        "ort-attention",
        "ort-attention-packed",
        "ort-biasgelu",
        "ort-embedlayernorm",
        "ort-fusedconv",
        "ort-fusedconv-sum",
        "ort-fusedgemm",
        "ort-fusedmatmul-div",
        "ort-fusedmatmul-mul",
        "ort-gelu",
        "ort-skiplayernorm",
        "ort-skiprmsnorm",
        "ort-skiprmsnorm-decomposed",
        "ort-transpose-into-matmul-a",
        "ort-transpose-into-matmul-b",
        "pad-into-consumer",
        "reshape-chain",
        "reshape-one-unknown",
        "rmsnorm",
        "rmsnorm-plain",
        "rotary-embedding",
        "softmax",
        "softmax-unstable",
        "sub-add-constants",
        "sub-sub-constants",
        "tied-weight-gemm",
        "transpose-identity",
        "transpose-into-gemm-a",
        "transpose-into-gemm-b",
        "transpose-transpose",
    }
)


@functools.cache
def exported_case(name: str, fixture: str) -> Case:
    """EXPORTED[name] as a Case: its values located on the fixture cut after the rule's first match."""
    spec = EXPORTED[name]
    assert isinstance(spec, Exported), spec
    base = first_layer(fixture, name, spec.settings)
    found = locate(base, name, spec.settings)

    def perturb(at: At | str) -> Perturb | str:
        if isinstance(at, str):
            return at
        if not at.cuts:
            return Perturb(at.change(found), at.reason, note=at.note)
        return Perturb(at.change(found), at.reason, cut_feeds(base, [found.names[b] for b in at.cuts]), at.note)

    return Case(
        lambda: first_layer(fixture, name, spec.settings),
        spec.expected,
        spec.interior or found.interior[0],
        perturb(spec.wrong),
        perturb(spec.unprovable),
        spec.gate,
        spec.settings,
        lambda: fixture_inputs(base),
        spec.passes,
    )


# -- late rules (the default pipeline's last simplify): the bert dynamo fixture's MLP, exported ---------


def _exported_mlp(
    until: str = "linear_5", seq: int | str = 6, fixture: str = "bert_dynamo", start: str = "layer_norm_1"
) -> onnx.ModelProto:
    """The first MLP of a bert fixture as written, MatMul + Add, GELU (the dynamo fixture's Gelu, the TorchScript
    one's erf formula), MatMul + Add (to ``until``), its input [batch, ``seq``, 32]: the export's sequence is
    dynamic, a ViT's is static."""
    # the TorchScript exporter writes no value_info, which the extractor needs
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(FIXTURES / f"{fixture}.onnx")))
    cut = onnx.utils.Extractor(proto).extract_model([start], [until])
    del cut.graph.value_info[:]  # the exporter's shapes, with the sequence dynamic
    for output in cut.graph.output:
        output.type.tensor_type.ClearField("shape")
    return set_shape(start, ["batch", seq, 32])(cut)


_TS_MLP = "/model/encoder/layer.0/"
_ERF_MLP = {
    "fixture": "bert_ts",
    "start": f"{_TS_MLP}attention/output/LayerNorm/LayerNormalization_output_0",
    "until": f"{_TS_MLP}output/dense/Add_output_0",
}


BOTH_DYNAMIC = set_shape("layer_norm_1", ["batch", "sequence", 32])
LATE = {"fuse_late": True}

CASES |= {
    "matmul-add-gemm-projection": Case(
        lambda: _exported_mlp("linear_4"),
        {"Reshape": 2, "Gemm": 1},
        "val_124",
        Perturb(
            set_const("model.encoder.layer.0.intermediate.dense.bias", _w(6, 64)),
            "not a vector over the last axis",
            note="bias [6, 64], a constant",
        ),
        Perturb(BOTH_DYNAMIC, "more than one dim of the product is not static", note="batch and sequence dynamic"),
        NO_GATE,
        LATE,
    ),
    "matmul-add-gemm-projection-reshaped": Case(
        lambda: split_projections(names=("q",)),
        {"Shape": 1, "Concat": 1, "Reshape": 2, "Gemm": 1},
        "q_biased",
        Perturb(set_attr("q", allowzero=0), "may copy a dim of the product", note="a computed target"),
        Perturb(set_shape("x", None), "the product's rank is unknown"),
        NO_GATE,
        LATE,
    ),
    "reshape-through-elementwise": Case(
        _exported_mlp,
        {"Reshape": 2, "Gemm": 2, "Gelu": 1},
        "gelu",
        "n/a: the pattern reads no attribute (the element-wise op keeps its own)",
        Perturb(BOTH_DYNAMIC, None, note="no projection Reshapes to take (batch and sequence dynamic)"),
        NO_GATE,
        LATE,
        passes="shape-infer,fuse,noop",  # noop drops the Reshape to the shape Gelu's input has
    ),
    "reshape-through-elementwise-region": Case(
        lambda: _exported_mlp(**_ERF_MLP),
        {"Reshape": 2, "Gemm": 2, "Constant": 3, "Div": 1, "Erf": 1, "Add": 1, "Mul": 2},
        f"{_TS_MLP}intermediate/intermediate_act_fn/Mul_1_output_0",
        "n/a: the pattern reads no attribute (the element-wise ops keep their own)",
        Perturb(
            lambda p: set_shape(_ERF_MLP["start"], ["batch", "sequence", 32])(p),
            None,
            note="no projection Reshapes to take (batch and sequence dynamic)",
        ),
        NO_GATE,
        LATE,
        passes="shape-infer,fuse,noop,dce",  # dce drops the element-wise ops the rewritten ones replace
    ),
}


# -- the tests --------------------------------------------------------------------------------------

KINDS = ("reader", "output", "attr", "shape", "opset")


def _feeds(case: Case, proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
    return case.feeds() if case.feeds is not None else make_feeds(proto)


def _run(case: Case, proto: onnx.ModelProto, perturb: Perturb) -> tuple[onnx.ModelProto, dict[str, Any]]:
    settings = {**case.settings, **(perturb.settings or {})}
    enable = settings.pop("enable", [])
    return fuse(proto, case.passes, enable=enable, **settings)


def _perturbation(case: Case, kind: str) -> Perturb | str:
    if kind in ("reader", "output"):
        if case.interior.startswith("n/a"):
            return case.interior
        how = with_reader if kind == "reader" else with_output
        return Perturb(lambda p: how(p, case.interior), "is also read by" if kind == "reader" else "graph output")
    return {"attr": case.wrong_attr, "shape": case.unprovable, "opset": case.low_opset}[kind]


def _exported_perturbation(spec: Exported, kind: str) -> At | Perturb | str:
    """The perturbation ``kind`` of an exporter case as declared (its values not yet located)."""
    if kind in ("reader", "output"):
        reason = "is also read by" if kind == "reader" else "graph output"
        return spec.interior or Perturb(_copy, reason, note="the removed value nearest the root")
    return {"attr": spec.wrong, "shape": spec.unprovable, "opset": spec.gate}[kind]


def _applicable() -> list[Any]:
    return [
        pytest.param(name, kind, id=f"{name}-{kind}")
        for name, case in CASES.items()
        for kind in KINDS
        if isinstance(_perturbation(case, kind), Perturb)
    ]


def _exporter_cases() -> list[Any]:
    return [
        pytest.param(name, fixture, id=f"{name}-{fixture}")
        for name, spec in EXPORTED.items()
        if isinstance(spec, Exported)
        for fixture in spec.fixtures
    ]


def _exported_applicable() -> list[Any]:
    return [
        pytest.param(name, fixture, kind, id=f"{name}-{fixture}-{kind}")
        for name, spec in EXPORTED.items()
        if isinstance(spec, Exported)
        for fixture in spec.fixtures
        for kind in KINDS
        if not isinstance(_exported_perturbation(spec, kind), str)
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_the_rule_fires_on_its_model(name: str) -> None:
    case = CASES[name]
    proto = case.build()
    settings = dict(case.settings)
    out = fires(proto, name, case.expected, passes=case.passes, **settings)
    assert_same_outputs(proto, out, _feeds(case, proto), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("name", "fixture"), _exporter_cases())
def test_the_rule_fires_on_its_export(name: str, fixture: str) -> None:
    """On the export cut after its first match, the rule fires; the fused ops are there, the outputs the same."""
    case = exported_case(name, fixture)
    proto = case.build()
    out, details = _run(case, proto, Perturb(_copy, None))
    assert details["applied"].get(name, 0) >= 1, details
    found = ops(out)
    assert {op: found[op] for op in case.expected} == case.expected, found
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert_same_outputs(proto, out, _feeds(case, proto), rtol=1e-4, atol=1e-4)


def _refuses(name: str, case: Case, kind: str) -> None:
    """The rule does not apply to ``case``'s model perturbed ``kind``: the outputs the same, the near miss said."""
    base = case.build()
    perturb = _perturbation(case, kind)
    assert isinstance(perturb, Perturb)
    proto = perturb.change(base)
    family = next(r.family for r in registered_rules() if r.name == name)
    if perturb.stops is not None:
        with pytest.raises(InputError, match=f"op {perturb.stops} blocks it"):
            _run(case, proto, perturb)
        found = lowering_misses(proto, int(case.settings["target_opset"]))
        assert any(perturb.reason in m for m in found), found
        return
    out, details = _run(case, proto, perturb)
    assert name not in details["applied"], details
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    feeds = perturb.feeds(proto) if perturb.feeds is not None else _feeds(case, base)
    assert_same_outputs(proto, out, feeds, rtol=1e-4, atol=1e-4)
    if perturb.reason is not None:
        found = details["near_misses"].get(family, [])
        assert any(perturb.reason in m for m in found), found


@pytest.mark.parametrize(("name", "kind"), _applicable())
def test_the_rule_refuses_the_perturbed_model(name: str, kind: str) -> None:
    _refuses(name, CASES[name], kind)


@pytest.mark.parametrize(("name", "fixture", "kind"), _exported_applicable())
def test_the_rule_refuses_the_perturbed_export(name: str, fixture: str, kind: str) -> None:
    _refuses(name, exported_case(name, fixture), kind)


def test_every_registered_rule_has_a_case() -> None:
    """A new rule needs a CASE: its model and its perturbations (or why one does not apply)."""
    assert sorted(r.name for r in registered_rules()) == sorted(CASES)


def test_every_newer_rule_has_an_exporter_case() -> None:
    """A rule newer than the exporter fixtures needs an EXPORTED entry too: its case on an exporter-written graph,
    or why there is none."""
    names = {r.name for r in registered_rules()}
    assert sorted(names - BEFORE_EXPORTS) == sorted(EXPORTED)
    assert not BEFORE_EXPORTS - names, "a rule gone: drop it from BEFORE_EXPORTS"


def test_a_mask_computed_from_the_cache_keeps_it() -> None:
    """A mask whose key length is read from the cache's Concat cannot feed the Attention that takes the Concat in
    (it would wait for its own output): the cache stays and the near miss says why."""
    proto = _cached_attention()
    nodes = proto.graph.node
    nodes.insert(2, node("Shape", ["present_key"], "keys", start=2, end=3))
    nodes.insert(3, node("Concat", ["rows", "keys"], "mask_shape", axis=0))
    true = helper.make_tensor("true", TensorProto.BOOL, [1], [True])
    nodes.insert(4, node("ConstantOfShape", ["mask_shape"], "mask", value=true))
    nodes[-1].input.append("mask")
    proto.graph.initializer.append(init("rows", np.array([2, 1, 3], np.int64)))
    details = refused(proto, "attention-kv-cache", passes="shape-infer,fuse,dce")
    assert any("computed from the cache's Concat" in m for m in details["near_misses"]["attention"]), details


def test_a_causal_attention_keeps_its_cache() -> None:
    """is_causal on the joined keys is aligned to them; with the past given apart, the diagonal would move by
    the past's length (onnx and onnxruntime align it bottom-right), so the Concat stays."""
    proto = set_attr("y", is_causal=1)(_cached_attention())
    details = refused(proto, "attention-kv-cache", passes="shape-infer,fuse,dce")
    assert any("is_causal" in m for m in details["near_misses"]["attention"]), details


@pytest.mark.parametrize(
    ("inner", "outer", "reason"),
    [(2.0, -2.0, "cap is not positive"), (None, None, "go through Sigmoid after MatMul(Q, K^T)")],
)
def test_a_score_mod_attention_cannot_express_is_a_near_miss(inner: Any, outer: Any, reason: str) -> None:
    """A tanh with a negative cap, or another op on the scores (a Sigmoid here), has no Attention attribute."""
    proto = softcapped(exported_attention(), 2.0, 2.0)
    if inner is None:
        tanh = next(n for n in proto.graph.node if n.op_type == "Tanh")
        tanh.op_type = "Sigmoid"
    else:
        proto = softcapped(exported_attention(), inner, outer)
    details = refused(proto, "attention-4d", passes="shape-infer,fuse,dce")
    assert any(reason in m for m in details["near_misses"]["attention"]), details


def test_multihead_attention_refuses_a_softcap() -> None:
    """onnxruntime's MultiHeadAttention has no softcap: the softcapped layer stays, and the near miss says why."""
    proto = softcapped(exported_encoder_attention(opset=20), 2.0, 2.0)
    details = refused(proto, "ort-multihead-attention", passes="shape-infer,fuse,dce", target="ort")
    assert any("tanh softcap" in m for m in details["near_misses"]["attention"]), details


def _levit_attention(bias: Callable[[np.ndarray], np.ndarray | None]) -> onnx.ModelProto:
    """The first attention of the dynamo levit fixture (V twice Q's and K's head size) with its constant
    (heads, S, T) bias replaced by ``bias`` of it (None: no bias added)."""
    proto = first_layer("levit_dynamo", BROADCAST_BIAS, BROADCAST_SETTINGS)
    values = bias(constant_of(proto, "index"))
    if values is not None:
        return with_constant(proto, "index", values)
    (add,) = [n for n in proto.graph.node if "index" in n.input]
    for reader in proto.graph.node:
        reader.input[:] = [add.input[0] if i == add.output[0] else i for i in reader.input]
    proto.graph.node.remove(add)
    return proto


def test_multihead_attention_takes_a_v_wider_than_q_and_k_in_3d() -> None:
    """onnxruntime wants 4-D K and V of one shape; with LeViT's V twice as wide, K and V go in 3-D (any
    v_hidden_size), by default where there is no bias."""
    proto = _levit_attention(lambda bias: None)
    expected = {"MatMul": 1, "Reshape": 5, "BatchNormalization": 1, "Split": 1, "MultiHeadAttention": 1}
    out = fires(proto, "ort-multihead-attention", expected, passes="shape-infer,fuse,dce", target="ort")
    (mha,) = [n for n in out.graph.node if n.op_type == "MultiHeadAttention"]
    producers = {o: n for n in out.graph.node for o in n.output}
    assert [producers[i].op_type for i in mha.input[:3]] == ["Reshape"] * 3


def test_multihead_attention_refuses_a_bias_that_grows_the_scores() -> None:
    """A bias of static batch 2 on scores of dynamic batch broadcasts a batch of 1 up to 2: not
    MultiHeadAttention's (batch or 1, heads or 1, S, T)."""
    proto = _levit_attention(lambda bias: np.stack([bias, bias + 1]))
    details = refused(proto, "ort-multihead-attention", passes="shape-infer,fuse,dce", target="ort")
    assert any("does not broadcast to (batch or 1" in m for m in details["near_misses"]["attention"]), details


@pytest.mark.parametrize(("fixture", "bias_from"), [("levit_dynamo", "initializer"), ("levit_ts", "Unsqueeze")])
def test_a_constant_bias_is_reshaped_and_a_computed_one_unsqueezed(fixture: str, bias_from: str) -> None:
    """The dynamo export's bias is a constant (heads, S, T), read only by its Add: stored again as (1, heads, S,
    T); TorchScript's is gathered from its table at run time: one Unsqueeze puts the 1 in front."""
    proto = first_layer(fixture, BROADCAST_BIAS, BROADCAST_SETTINGS)
    out, details = fuse(proto, "shape-infer,fuse,dce", enable=[BROADCAST_BIAS], target="ort")
    assert details["applied"][BROADCAST_BIAS] == 1, details
    (mha,) = [n for n in out.graph.node if n.op_type == "MultiHeadAttention"]
    initializers = {t.name: list(t.dims) for t in out.graph.initializer}
    producers = {o: n.op_type for n in out.graph.node for o in n.output}
    bias = mha.input[5]
    assert (producers.get(bias) or "initializer") == bias_from
    if bias_from == "initializer":
        assert initializers[bias] == [1, 2, 16, 16] and "index" not in initializers  # stored once
    assert_same_outputs(proto, out, fixture_inputs(proto), rtol=1e-4, atol=1e-4)


def test_a_float16_table_is_cast_after_the_slice() -> None:
    """bert_fp16_weights' position table: Gather(Cast(T16), Slice(0..N-1)) -> Cast(Slice(T16)),
    casting the rows read only; the float16 data is stored once, as it was."""
    proto = _rows(cast=True)()
    out = fires(proto, "gather-consecutive-rows", {"Shape": 1, "Slice": 1, "Cast": 1}, passes="shape-infer,fuse,dce")
    assert [n.op_type for n in out.graph.node] == ["Shape", "Slice", "Cast"]
    (table,) = [t for t in out.graph.initializer if t.data_type == F16]
    assert list(table.dims) == [1, 8, 8]
    _, details = fuse(with_reader(proto, "tc"))
    assert "gather-consecutive-rows" not in details["applied"]


def test_a_cast_table_is_looked_up_then_cast_and_a_short_one_stays() -> None:
    out = fires(_cast_table(), "gather-before-cast", {"Gather": 1, "Cast": 1})
    assert [n.op_type for n in out.graph.node] == ["Gather", "Cast"]  # the rows read are cast, not the table
    short = _cast_table(rows=16)
    out, details = fuse(short)
    assert "gather-before-cast" not in details["applied"]
    assert "fewer than 256 rows" in " ".join(details["near_misses"]["gather"])
    assert_same_outputs(short, out)


def test_positions_that_are_not_a_range_stay_a_gather() -> None:
    proto = set_const("positions", np.arange(8, dtype=np.int64)[::-1].reshape(1, 8))(_rows(cast=False)())
    out, details = fuse(proto)
    assert "gather-consecutive-rows" not in details["applied"]
    assert "not 0, 1, ..." in " ".join(details["near_misses"]["gather"])
    assert_same_outputs(proto, out)


def _cell(found: At | Perturb | str) -> str:
    if isinstance(found, str):
        return found
    cell = "near miss" if found.reason else "no match"
    cell += ", the conversion stops" if isinstance(found, Perturb) and found.stops else ""
    return f"{cell} ({found.note})" if found.note else cell


def coverage_matrix() -> str:
    """The rule x test-kind matrix as a Markdown table: each rule's case built here, then its case on an
    exporter-written graph (the graph column names the fixture) or why it has none."""
    lines = ["| rule | graph | fires, outputs kept | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 3) + "|"]
    for name, case in CASES.items():
        cells = [_cell(_perturbation(case, kind)) for kind in KINDS]
        lines.append(f"| {name} | built here | yes | " + " | ".join(cells) + " |")
        spec = EXPORTED.get(name)
        if isinstance(spec, Exported):
            cells = [_cell(_exported_perturbation(spec, kind)) for kind in KINDS]
            lines.extend(f"| {name} | export {f} | yes | " + " | ".join(cells) + " |" for f in spec.fixtures)
        elif spec is not None:
            lines.append(f"| {name} | export: {spec} |" + " |" * (len(KINDS) + 1))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(coverage_matrix() + "\n")


# -- masked_fill of the scores (MPT's Where(mask, finfo.min, scores + alibi)) ------------------------


def _mpt_with_fill(value: float) -> onnx.ModelProto:
    """The dynamo mpt fixture with the fill of its masked scores (Where(mask, fill, scores + alibi)) at ``value``."""
    proto = onnx.load(str(FIXTURES / "mpt_dynamo.onnx"))
    producer = {o: n for n in proto.graph.node for o in n.output}
    softmax = next(n for n in proto.graph.node if n.op_type == "Softmax")
    where = producer[softmax.input[0]]
    assert where.op_type == "Where"
    where.input[1] = "other_fill"
    proto.graph.initializer.append(init("other_fill", np.array(value, np.float32)))
    return proto


@pytest.mark.parametrize("fill", [-1e4, -np.inf], ids=["small", "-inf"])
def test_a_masked_fill_the_scores_do_not_round_back_to_stays(fill: float) -> None:
    """Added to the scores, a fill above -1e30 does not round back to itself (the masked entries would differ),
    and -inf gives NaN on a fully masked row where the fused op need not: the attention stays, a near miss says why."""
    details = refused(_mpt_with_fill(fill), "ort-multihead-attention", passes="shape-infer,fuse,dce", target="ort")
    assert any("c finite <= -1e30" in m for m in details["near_misses"]["attention"]), details
