"""The attention rules' table: Attention (opset 23) and onnxruntime's MultiHeadAttention and Attention. Each rule
fires on its model and refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the
exporter fixtures has its case on an export too. The family's own tests of the standard Attention (a KV cache, score
mods) and of heads merged with a bias follow its table; those of onnxruntime's ops at --target ort
(MultiHeadAttention, GroupQueryAttention on a KV cache, its Attention) are in test_attention_ort.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.ir.node import CONTRIB_DOMAIN as MS
from tests.numerics import assert_same_outputs, make_feeds
from tests.passes.fuse.table import (
    F16,
    LATE,
    NO_GATE,
    Case,
    Exported,
    Perturb,
    at_opset,
    attr_at,
    below,
    copied,
    set_attr,
    set_shape,
    table_tests,
    target_opset,
    untyped_at,
)
from tests.passes.fuse_exported import Change, constant_of, first_layer, fixture_inputs
from tests.passes.fuse_fixtures import (
    BROADCAST_BIAS,
    exported_attention,
    exported_encoder_attention,
    exported_merged_attention,
    softcapped,
)
from tests.passes.fuse_helpers import F, fuse, info, init, model, node, ops, refused
from tests.passes.fuse_models import (
    HIDDEN,
    masked_feeds,
    ort_attention,
)


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


# A float16 Attention on 4-D heads (4 query heads, 2 KV heads) with an additive float16 mask: what attention-4d
# writes on a float16 Llama export at opset 23.
HALF_HEADS = {"q": [1, 4, 16, 32], "k": [1, 2, 16, 32], "v": [1, 2, 16, 32], "mask": [16, 16]}


def float16_attention(elem_type: int = F16) -> onnx.ModelProto:
    return model(
        [node("Attention", list(HALF_HEADS), "y")],
        [info(name, shape, elem_type) for name, shape in HALF_HEADS.items()],
        [info("y", None, elem_type)],
        opset=23,
    )


def causal_feeds(scale: float) -> dict[str, np.ndarray]:
    """Q, K and V drawn at ``scale``, a causal mask of float16's lowest value."""
    rng = np.random.default_rng(0)
    feeds = {name: (rng.standard_normal(shape) * scale).astype(np.float16) for name, shape in HALF_HEADS.items()}
    feeds["mask"] = np.where(np.tril(np.ones(HALF_HEADS["mask"])) > 0, 0, np.finfo(np.float16).min)
    return {name: array.astype(np.float16) for name, array in feeds.items()}


# One decode step of a float16 com.microsoft attention op on a 7-token KV cache (4 query heads, 2 KV heads for GQA).
_CACHED = {
    "GroupQueryAttention": ({"q": [1, 1, 64], "k": [1, 1, 32], "v": [1, 1, 32]}, [1, 2, 7, 16], (3, 4)),
    "MultiHeadAttention": ({"q": [1, 1, 64], "k": [1, 1, 64], "v": [1, 1, 64]}, [1, 4, 7, 16], (6, 7)),
}


def cached_float16_attention(op_type: str, float16_cache: bool = False) -> onnx.ModelProto:
    """``op_type`` in float16 on a KV cache the model casts to float16 from its float32 inputs, its present cache
    cast back (onnxruntime's float16 converter with keep_io_types); ``float16_cache``: the cache is float16 itself."""
    projections, cache_shape, cache_at = _CACHED[op_type]
    cache_type = F16 if float16_cache else F
    nodes = [] if float16_cache else [node("Cast", [f"past_{n}"], f"past_{n}16", to=F16) for n in ("k", "v")]
    inputs: list[str] = [*projections] + [""] * (cache_at[0] - len(projections))
    inputs += [f"past_{n}" if float16_cache else f"past_{n}16" for n in ("k", "v")]
    extra = [info("seqlens_k", [1], TensorProto.INT32), info("total", [], TensorProto.INT32)]
    if op_type == "GroupQueryAttention":
        inputs += ["seqlens_k", "total"]
        attrs = {"num_heads": 4, "kv_num_heads": 2}
    else:
        extra, attrs = [], {"num_heads": 4}
    nodes.append(helper.make_node(op_type, inputs, ["y", "present_k16", "present_v16"], domain=MS, **attrs))
    nodes += [node("Cast", [f"present_{n}16"], f"present_{n}", to=F) for n in ("k", "v")]
    proto = model(
        nodes,
        [info(n, shape, F16) for n, shape in projections.items()]
        + [info(f"past_{n}", cache_shape, cache_type) for n in ("k", "v")]
        + extra,
        [info("y", None, F16), "present_k", "present_v"],
    )
    proto.opset_import.append(helper.make_opsetid(MS, 1))
    return proto


def cached_feeds(op_type: str, float16_cache: bool = False) -> dict[str, np.ndarray]:
    """Small values: the float16 cache's rounding the rule takes away stays within the table's 1e-4."""
    projections, cache_shape, _ = _CACHED[op_type]
    rng = np.random.default_rng(0)
    feeds = {n: (rng.standard_normal(shape) * 0.05).astype(np.float16) for n, shape in projections.items()}
    cache_dtype = np.float16 if float16_cache else np.float32
    feeds |= {f"past_{n}": (rng.standard_normal(cache_shape) * 0.05).astype(cache_dtype) for n in ("k", "v")}
    if op_type == "GroupQueryAttention":
        feeds |= {"seqlens_k": np.array([7], np.int32), "total": np.array(8, np.int32)}
    return feeds


def _unknown_rank(*names: str) -> Change:
    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        for name in names:
            proto = set_shape(name, None)(proto)
        return proto

    return change


def _ort_attention_feeds() -> Mapping[str, np.ndarray]:
    return masked_feeds()


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
        out = copied(proto)
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


# -- GroupQueryAttention: a grouped-query decoder layer with a KV cache, as HF's Llama exports write it ----------

RNG = np.random.default_rng(3)
GQA_HEADS, GQA_KV_HEADS, GQA_SIZE = 4, 2, 8
GQA_WIDTH = GQA_HEADS * GQA_SIZE


def _weights(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def decoder_layer(
    batch: int | str = 1,
    seq: int | str = "seq",
    fill: float = -np.inf,
    band: str = "past",
    guard: bool = True,
    kv_heads: int = GQA_KV_HEADS,
    past: int | str = "past",
    rotary: bool = False,
) -> onnx.ModelProto:
    """One attention layer of a Llama-style decoder with a KV cache (4 query heads, ``kv_heads`` of 8): Q, K, V
    projections of ``x`` (batch, ``seq``, 32), K and V joined to the past along the sequence (the present outputs),
    their heads repeated for the query heads (Unsqueeze, Expand, Reshape) where fewer, the scores masked by
    ``Where(band and attention_mask, 0, fill)`` with the causal band over the past (``band`` "past": key j <= past +
    query i; "none": no past offset; "mask": the padding alone), the IsNaN guard after the Softmax (``guard``),
    onnxruntime's RotaryEmbedding on the new keys at ``position_ids`` (``rotary``); a string dim is dynamic."""
    hidden = (batch, seq, GQA_WIDTH)
    kv = (batch, kv_heads, past, GQA_SIZE)
    nodes = [
        node("Shape", ["x"], "seq_1d", start=1, end=2),
        node("Squeeze", ["seq_1d", "zero_axis"], "seq_len"),
        node("Shape", ["past_key"], "past_1d", start=2, end=3),
        node("Squeeze", ["past_1d", "zero_axis"], "past_len"),
        node("Add", ["past_len", "seq_len"], "total_len"),
        node("Range", ["i0", "total_len", "i1"], "key_index"),
        node("Unsqueeze", ["key_index", "key_axes"], "keys"),
        node("Range", ["i0", "seq_len", "i1"], "query_index"),
        node("Add", ["query_index", "past_len" if band == "past" else "i0"], "positions_1d"),
        node("Unsqueeze", ["positions_1d", "query_axes"], "positions"),
        node("LessOrEqual", ["keys", "positions"], "band"),
        node("Cast", ["attention_mask"], "mask_bool", to=TensorProto.BOOL),
        node("Unsqueeze", ["mask_bool", "mask_axes"], "padding"),
        node("And", ["band", "padding"], "allowed"),
        node("Where", ["padding" if band == "mask" else "allowed", "f_zero", "fill"], "bias"),
    ]
    for name in ("q", "k", "v"):
        nodes += [
            node("MatMul", ["x", f"w{name}"], f"{name}_proj"),
            node("Reshape", [f"{name}_proj", f"{name}_split_shape"], f"{name}_split"),
            node("Transpose", [f"{name}_split"], f"{name}_heads", perm=[0, 2, 1, 3]),
        ]
    if rotary:
        nodes.append(node("RotaryEmbedding", ["k_heads", "position_ids", "cos", "sin"], "k_rotated", domain=MS))
    for name in ("key", "value"):
        new = "k_rotated" if rotary and name == "key" else f"{name[0]}_heads"
        nodes += [
            node("Concat", [f"past_{name}", new], f"present_{name}", axis=2),
            node("Unsqueeze", [f"present_{name}", "repeat_axis"], f"{name}_wide"),
            node("Expand", [f"{name}_wide", "repeat"], f"{name}_expanded"),
            node("Reshape", [f"{name}_expanded", "repeated_shape"], f"{name}_repeated"),
        ]
    probs = "probs_guarded" if guard else "probs"
    nodes += [
        node("Transpose", ["key_repeated"], "key_t", perm=[0, 1, 3, 2]),
        node("MatMul", ["q_heads", "key_t"], "qk"),
        node("Mul", ["qk", "scale"], "scores"),
        node("Add", ["scores", "bias"], "masked"),
        node("Softmax", ["masked"], "probs", axis=-1),
        node("IsNaN", ["probs"], "probs_nan"),
        node("Where", ["probs_nan", "f_zero", "probs"], "probs_guarded"),
        node("MatMul", [probs, "value_repeated"], "pv"),
        node("Transpose", ["pv"], "pv_t", perm=[0, 2, 1, 3]),
        node("Reshape", ["pv_t", "merge_shape"], "merged"),
        node("MatMul", ["merged", "wo"], "y"),
    ]
    if not guard:
        nodes = [n for n in nodes if n.output[0] not in ("probs_nan", "probs_guarded")]
    if kv_heads == GQA_HEADS:  # no repeat: the attention reads the caches
        repeat = {f"{n}_{step}" for n in ("key", "value") for step in ("wide", "expanded", "repeated")}
        nodes = [n for n in nodes if n.output[0] not in repeat]
        for found in nodes:
            found.input[:] = [f"present_{i.split('_')[0]}" if i.endswith("_repeated") else i for i in found.input]
    ints = {
        "zero_axis": [0],
        "i0": 0,
        "i1": 1,
        "key_axes": [0, 1, 2],
        "query_axes": [0, 1, 3],
        "mask_axes": [1, 2],
        "q_split_shape": [0, 0, GQA_HEADS, GQA_SIZE],
        "k_split_shape": [0, 0, kv_heads, GQA_SIZE],
        "v_split_shape": [0, 0, kv_heads, GQA_SIZE],
        "repeat_axis": [2],
        "repeat": [1, 1, GQA_HEADS // kv_heads, 1, 1],
        "repeated_shape": [0, GQA_HEADS, -1, GQA_SIZE],
        "merge_shape": [0, 0, GQA_WIDTH],
    }
    initializers = [init(name, np.array(values, np.int64)) for name, values in ints.items()]
    initializers += [
        init("f_zero", 0.0),
        init("fill", fill),
        init("scale", GQA_SIZE**-0.5),
        init("wq", _weights(GQA_WIDTH, GQA_WIDTH)),
        init("wk", _weights(GQA_WIDTH, kv_heads * GQA_SIZE)),
        init("wv", _weights(GQA_WIDTH, kv_heads * GQA_SIZE)),
        init("wo", _weights(GQA_WIDTH, GQA_WIDTH)),
    ]
    inputs = [
        info("x", list(hidden)),
        info("attention_mask", [batch, "total"], TensorProto.INT64),
        info("past_key", list(kv)),
        info("past_value", list(kv)),
    ]
    if rotary:
        angles = np.arange(_POSITIONS)[:, None] * 10000.0 ** (-np.arange(GQA_SIZE // 2) / (GQA_SIZE // 2))
        initializers += [init("cos", np.cos(angles).astype(np.float32)), init("sin", np.sin(angles).astype(np.float32))]
        inputs.append(info("position_ids", [batch, seq], TensorProto.INT64))
    proto = model(nodes, inputs, ["y", "present_key", "present_value"], initializers, opset=18)
    if rotary:
        proto.opset_import.append(helper.make_opsetid(MS, 1))
    return proto


_POSITIONS = 64  # the rotary caches' rows


def decoder_feeds(
    batch: int, seq: int, past: int, padded: int = 0, kv_heads: int = GQA_KV_HEADS
) -> dict[str, np.ndarray]:
    """Inputs of decoder_layer: ``seq`` new tokens after ``past`` cached ones, the last row's first ``padded``
    positions masked (left padding)."""
    rng = np.random.default_rng(seq * 100 + past)
    mask = np.ones((batch, past + seq), np.int64)
    mask[-1, :padded] = 0
    kv = (batch, kv_heads, past, GQA_SIZE)
    return {
        "x": rng.standard_normal((batch, seq, GQA_WIDTH)).astype(np.float32),
        "attention_mask": mask,
        "past_key": rng.standard_normal(kv).astype(np.float32),
        "past_value": rng.standard_normal(kv).astype(np.float32),
    }


def _band_without_past(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The decoder layer with its query positions not shifted by the past: Range(0, seq) + 0."""
    changed = copied(proto)
    (positions,) = [n for n in changed.graph.node if n.output[0] == "positions_1d"]
    positions.input[1] = "i0"
    return changed


GQA_ANY_LENGTH = "ort-group-query-attention-any-length"
GQA_ANY_SETTINGS: dict[str, Any] = {"target": "ort", "enable": [GQA_ANY_LENGTH]}
# what the decoder layer keeps around its GroupQueryAttention: the mask's plumbing, the projections (K and V go in
# as projected), seqlens_k and total_sequence_length from the shapes (Shape, Add, Cast, Sub, Expand, Reshape)
_GQA_OPS = {
    **{"Shape": 5, "Squeeze": 2, "Add": 3, "Range": 2, "Unsqueeze": 3, "LessOrEqual": 1, "Cast": 2, "And": 1},
    **{"Where": 2, "MatMul": 4, "Reshape": 1, "Concat": 1, "Expand": 2, "Sub": 1},
    **{"GroupQueryAttention": 1, "IsNaN": 1},
}

_GQA_PERTURBED = (
    Perturb(set_attr("probs", axis=2), None, note="Softmax axis=2: no MultiHeadAttention to start from"),
    Perturb(_band_without_past, "not provably the causal band over the past", note="the band not shifted by the past"),
)

CASES: dict[str, Case] = {
    "attention": Case(
        _standard_attention,
        {"MatMul": 3, "Add": 3, "Attention": 1, "Shape": 1, "Concat": 1, "Expand": 1},
        "probs",
        SOFTMAX_AXIS,
        Perturb(lambda p: at_opset(23)(SPLIT_INPUT.change(p)), "not provable", feeds=_attention_split_input),
        below(23),
        passes="shape-infer,fuse,dce",
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
    "ort-group-query-attention": Case(
        lambda: decoder_layer(batch="batch", seq=1),
        # seqlens_k and total_sequence_length from the shapes (Shape, Add, Cast, Sub, Expand, Reshape), K merged back
        _GQA_OPS,
        "key_repeated",
        *_GQA_PERTURBED,
        NO_GATE,
        {"target": "ort"},
        lambda: decoder_feeds(2, 1, 6, padded=3),
        passes="shape-infer,fuse,dce",
    ),
    GQA_ANY_LENGTH: Case(
        decoder_layer,
        _GQA_OPS,
        "key_repeated",
        *_GQA_PERTURBED,
        NO_GATE,
        GQA_ANY_SETTINGS,
        lambda: decoder_feeds(1, 4, 3, padded=2),
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
    "attention-float32": Case(
        float16_attention,
        {"Attention": 1, "Cast": 5, "Equal": 1, "Where": 1},
        "n/a: one node, the Attention itself",
        Perturb(
            lambda proto: float16_attention(F),
            None,
            feeds=make_feeds,
            note="the Attention in float32: nothing to compute in float32",
        ),
        "n/a: the rule needs element types only, which every input declares",
        "n/a: the rule's root is an Attention, which no opset below 23 has",
        settings=LATE,
        # small values: the float16 kernel's rounding inside stays within the table's 1e-4 (see test_a_float16_...)
        feeds=lambda: causal_feeds(0.05),
        passes="shape-infer,fuse,dce",
    ),
    **{
        name: Case(
            lambda op_type=op_type: cached_float16_attention(op_type),
            {op_type: 1, "Cast": 8},  # Q, K, V up, its 3 outputs down, the presents up again (the past's go)
            "n/a: one node, the attention itself",
            Perturb(
                lambda proto, op_type=op_type: cached_float16_attention(op_type, float16_cache=True),
                "a float16 KV cache",
                feeds=lambda proto, op_type=op_type: cached_feeds(op_type, float16_cache=True),
                note="the cache a float16 input: in float32 it would be converted whole at every step",
            ),
            "n/a: the rule needs element types only, which every input declares",
            "n/a: a com.microsoft op, no opset gate",
            settings={**LATE, "target": "ort"},
            feeds=lambda op_type=op_type: cached_feeds(op_type),
            passes="shape-infer,fuse,dce",
        )
        for name, op_type in (("mha-float32", "MultiHeadAttention"), ("gqa-float32", "GroupQueryAttention"))
    },
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
}

EXPORTED: dict[str, Exported | str] = {
    **dict.fromkeys(
        ("mha-float32", "gqa-float32"),
        "its root is an onnxruntime op no exporter writes; test_float32.py runs the whole pipeline at --target ort",
    ),
    "attention-float32": "its case is what attention-4d writes on a float16 export; test_float32.py runs the whole "
    "pipeline on the float16 Llama export (tests/fixtures/exports/llama_fp16_dynamo.onnx)",
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
    **{
        name: "n/a: the llama_kv fixtures have batch, sequence and past all dynamic (onnxruntime's kernel refuses "
        "batch > 1 with several new tokens and a past) and the dynamo one fills its mask with finfo.min; the case "
        "built here is HF's Llama layer with one new token or the batch static"
        for name in ("ort-group-query-attention", GQA_ANY_LENGTH)
    },
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
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "attention",
        "ort-attention",
        "ort-attention-packed",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


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


def _merged_attention(
    bias_shape: list[int | str], style: str, opset: int = 17, axis: int | None = -1
) -> onnx.ModelProto:
    """bmm attention on (batch * heads, S, d) with a 3-D bias on the merged scores: the Softmax on them (fairseq)
    or on their (batch, heads, S, S) split (BLOOM); batch 2, 4 heads, S 5, head size 8."""
    batch, heads, seq, size = 2, 4, 5, 8
    softmax = {} if axis is None else {"axis": axis}
    nodes = [node("Reshape", [n, "merged"], f"{n}3") for n in "qkv"]
    nodes += [
        node("Transpose", ["k3"], "kt", perm=[0, 2, 1]),
        node("MatMul", ["q3", "kt"], "qk"),
        node("Mul", ["qk", "scale"], "scaled"),
        node("Add", ["scaled", "bias"], "scores"),
    ]
    if style == "fairseq":
        nodes.append(node("Softmax", ["scores"], "p", **softmax))
    else:
        nodes += [
            node("Reshape", ["scores", "split"], "scores4"),
            node("Softmax", ["scores4"], "p4", **softmax),
            node("Reshape", ["p4", "merged_scores"], "p"),
        ]
    nodes += [
        node("MatMul", ["p", "v3"], "pv"),
        node("Reshape", ["pv", "heads"], "y4"),
        node("Transpose", ["y4"], "yt", perm=[0, 2, 1, 3]),
        node("Reshape", ["yt", "rows"], "y"),
    ]
    shapes = {
        "merged": [batch * heads, seq, size],
        "split": [batch, heads, seq, seq],
        "merged_scores": [batch * heads, seq, seq],
        "heads": [batch, heads, seq, size],
        "rows": [batch, seq, heads * size],
    }
    inits = [init(name, np.array(shape, np.int64)) for name, shape in shapes.items()] + [init("scale", 0.35)]
    inputs = [info(n, [batch, heads, seq, size]) for n in "qkv"] + [info("bias", bias_shape)]
    return model(nodes, inputs, ["y"], inits, opset=opset)


MERGED_TARGETS = [
    ({"target_opset": 23}, "attention-merged-heads", "Attention"),
    ({"target": "ort"}, "ort-multihead-attention-merged", "MultiHeadAttention"),
]


@pytest.mark.parametrize("style", ["fairseq", "bloom"])
@pytest.mark.parametrize(("settings", "rule", "fused"), MERGED_TARGETS)
@pytest.mark.parametrize("bias_shape", [[8, 1, 5], [1, 5, 5]])
def test_a_merged_bias_per_head_or_shared_by_all_fuses(
    bias_shape: list[int | str], settings: dict[str, Any], rule: str, fused: str, style: str
) -> None:
    # (1, S, T) is fairseq's causal mask unsqueezed at 0: one bias for every (batch, head)
    proto = _merged_attention(bias_shape, style)
    out, details = fuse(proto, **settings)
    assert details["applied"].get(rule) == 1 and dict(ops(out))[fused] == 1, details
    assert_same_outputs(proto, out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("settings", "rule", "fused"), MERGED_TARGETS)
def test_a_merged_bias_not_provably_per_head_stays(settings: dict[str, Any], rule: str, fused: str) -> None:
    _, details = fuse(_merged_attention(["n", 1, 5], "fairseq"), **settings)
    assert rule not in details["applied"]
    assert any("first dim" in m for m in details["near_misses"]["attention"]), details


@pytest.mark.parametrize(("settings", "rule", "fused"), MERGED_TARGETS)
def test_a_softmax_without_axis_below_opset_13_is_not_over_the_last_axis(
    settings: dict[str, Any], rule: str, fused: str
) -> None:
    # below opset 13 the axis defaults to 1 and the (8, 5, 5) scores are normalized over 5 * 5 values at once
    details = refused(_merged_attention([8, 1, 5], "fairseq", opset=11, axis=None), rule, **settings)
    assert any("not over the last axis" in m for m in details["near_misses"]["attention"]), details
    _fires_merged = _merged_attention([8, 1, 5], "fairseq", opset=11, axis=2)
    out, found = fuse(_fires_merged, **settings)
    assert found["applied"].get(rule) == 1
    assert_same_outputs(_fires_merged, out, rtol=1e-4, atol=1e-4)
