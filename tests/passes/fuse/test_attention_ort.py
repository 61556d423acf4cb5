"""The attention family's tests of onnxruntime's ops at --target ort: MultiHeadAttention (a softcap, LeViT's V wider
than Q and K and its bias, masked fills, Swin's windows), where --target ort writes the standard Attention instead,
GroupQueryAttention on a KV cache (its rules, refusals and run-time gate), and the com.microsoft Attention on the
whole layer. The family's table and its builders are in test_attention.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest

from graphopt.ir.node import CONTRIB_DOMAIN as MS
from tests.numerics import assert_same_outputs
from tests.passes.fuse.table import as_float16, assert_no_further, at_opset, quantized
from tests.passes.fuse.test_attention import (
    BROADCAST_SETTINGS,
    GQA_ANY_LENGTH,
    GQA_HEADS,
    decoder_feeds,
    decoder_layer,
)
from tests.passes.fuse_exported import constant_of, first_layer, fixture_inputs, with_constant
from tests.passes.fuse_fixtures import BROADCAST_BIAS, FIXTURES, exported_encoder_attention, softcapped
from tests.passes.fuse_helpers import fires, fires_ort, fuse, init, ops, refused
from tests.passes.fuse_models import HEADS, HIDDEN, SIZE, WINDOW, masked_feeds, ort_attention
from tests.precision_models import VARIANTS

# -- MultiHeadAttention, and where --target ort writes the standard Attention ---------------------------------


def test_multihead_attention_refuses_a_softcap() -> None:
    """onnxruntime's MultiHeadAttention has no softcap: the softcapped layer stays, and the near miss says why."""
    proto = softcapped(exported_encoder_attention(opset=20), 2.0, 2.0)
    details = refused(proto, "ort-multihead-attention", passes="shape-infer,fuse,dce", target="ort")
    assert any("tanh softcap" in m for m in details["near_misses"]["attention"]), details


def _float16_encoder_attention(opset: int) -> onnx.ModelProto:
    return as_float16(exported_encoder_attention(opset))


@pytest.mark.parametrize(
    ("build", "opset", "written"),
    [
        (exported_encoder_attention, 23, ("", "Attention")),
        (exported_encoder_attention, 20, (MS, "MultiHeadAttention")),
        # MultiHeadAttention takes float16 itself; the standard Attention computes it between Casts to float32
        (_float16_encoder_attention, 23, (MS, "MultiHeadAttention")),
        # GroupQueryAttention is made from the MultiHeadAttention on a cache
        (lambda opset: at_opset(opset)(decoder_layer(seq=1)), 23, (MS, "GroupQueryAttention")),
    ],
    ids=["float32", "float32-opset-20", "float16", "kv-cache"],
)
def test_target_ort_writes_the_standard_attention_where_onnxruntime_runs_it_faster(
    build: Callable[[int], onnx.ModelProto], opset: int, written: tuple[str, str]
) -> None:
    """onnxruntime runs opset 23's Attention faster than its MultiHeadAttention on float32 without a cache: at
    --target ort an opset-23 model gets Attention there, and the MultiHeadAttention rule says why."""
    proto = build(opset)
    out, details = fuse(proto, passes="shape-infer,fuse,dce", target="ort", target_opset=opset)
    attention = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
    assert [(n.domain, n.op_type) for n in out.graph.node if n.op_type in attention] == [written], details
    feeds = decoder_feeds(1, 1, 3, 2) if written[1] == "GroupQueryAttention" else None
    tolerance = 1e-2 if "float16" in build.__name__ else 1e-4
    assert_same_outputs(proto, out, feeds, rtol=tolerance, atol=tolerance)
    standard_said = any("has Attention" in m for m in details["near_misses"].get("attention", []))
    assert standard_said == (written[1] == "Attention"), details


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


# -- GroupQueryAttention on a KV cache ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layer", "steps", "rule"),
    [
        # one new token: a left-padded batch of 2, a first token
        ({"batch": "batch", "seq": 1}, [(2, 1, 6, 3), (3, 1, 0, 0)], "ort-group-query-attention"),
        # batch 1, any length: a prompt after a past, a decode step, a first prompt whose left padding masks queries
        ({}, [(1, 4, 3, 2), (1, 1, 6, 2), (1, 3, 0, 2)], GQA_ANY_LENGTH),
        # as many kv heads as query heads: no repeat
        ({"kv_heads": GQA_HEADS}, [(1, 4, 3, 2, GQA_HEADS), (1, 1, 6, 2, GQA_HEADS)], GQA_ANY_LENGTH),
    ],
    ids=["decode", "batch-1", "no-grouping"],
)
def test_group_query_attention_on_a_cache(layer: dict[str, Any], steps: list[tuple[int, ...]], rule: str) -> None:
    """The grouped-query decoder layer becomes one GroupQueryAttention whose present outputs are the graph's, equal
    to the export's in onnxruntime at prompt and decode shapes, left padding included."""
    proto = decoder_layer(**layer)
    out, details = fuse(proto, "shape-infer,fuse,dce", enable=[GQA_ANY_LENGTH], target="ort")
    assert details["applied"].get(rule) == 1, details
    assert ops(out)["GroupQueryAttention"] == 1 and "MultiHeadAttention" not in ops(out)
    (gqa,) = [n for n in out.graph.node if n.op_type == "GroupQueryAttention"]
    assert list(gqa.output[1:]) == ["present_key", "present_value"]
    for step in steps:
        assert_same_outputs(proto, out, decoder_feeds(*step), rtol=1e-4, atol=1e-4)


_LOWEST = float(np.finfo(np.float32).min)


@pytest.mark.parametrize(
    ("layer", "step", "reason"),
    [
        ({"seq": 3, "fill": _LOWEST}, (1, 3, 2, 1), "the mask's fill is finite and the new tokens are not one"),
        ({"seq": 1, "fill": -1e4}, (1, 1, 2, 1), "neither -inf nor finite <= -1e+30"),
        ({"band": "none"}, (1, 3, 2, 1), "not provably the causal band over the past"),
        ({"band": "mask"}, (1, 3, 2, 1), "not provably the causal band over the past"),
        ({"guard": False}, (1, 3, 2, 1), "is not zeroed after it"),
        ({"batch": 2, "seq": 3, "past": 4}, (2, 3, 4, 1), "refuses batch > 1 with several new tokens and a past"),
        ({"seq": 40}, (1, 40, 2, 1), "a static count above 32"),
    ],
    ids=[
        "finite-fill-prompt",
        "fill-above-1e30",
        "band-without-past",
        "padding-only",
        "no-nan-guard",
        "batch-2-prompt",
        "long-prompt",
    ],
)
def test_group_query_attention_refusals(layer: dict[str, Any], step: tuple[int, ...], reason: str) -> None:
    """What GroupQueryAttention would compute otherwise, at every shape the graph takes: a finite fill past one new
    token (a fully masked query weighs every key in the export, the keys up to its own in the kernel), a fill the
    kernel's float32 scores do not vanish next to, a causal band not shifted by the past or none (the kernel's is),
    NaN not zeroed after the attention, the static shapes the CPU kernel refuses, and a static prompt longer than 32
    (slower: the any-length rule's, off by default). MultiHeadAttention stays."""
    proto = decoder_layer(**layer)
    out, details = fuse(proto, "shape-infer,fuse,dce", target="ort")
    assert "ort-group-query-attention" not in details["applied"], details
    assert details["applied"].get("ort-multihead-attention") == 1, details
    assert any(reason in m for m in details["near_misses"]["attention"]), details
    assert_same_outputs(proto, out, decoder_feeds(*step), rtol=1e-4, atol=1e-4)


def _positions(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with position_ids after the past: each row's tokens numbered from the cache's length on."""
    batch, seq = feeds["x"].shape[:2]
    past = feeds["past_key"].shape[2]
    return {**feeds, "position_ids": np.broadcast_to(np.arange(past, past + seq), (batch, seq)).copy()}


def _all_ops(proto: onnx.ModelProto) -> dict[str, int]:
    """Op counts with the If branches'."""
    found: dict[str, int] = {}

    def walk(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            found[n.op_type] = found.get(n.op_type, 0) + 1
            for attr in n.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)

    walk(proto.graph)
    return found


@pytest.mark.parametrize(
    ("layer", "rule"),
    [
        ({"batch": "batch"}, "ort-group-query-attention"),
        ({"batch": "batch", "fill": _LOWEST}, "ort-group-query-attention"),
        ({"batch": "batch"}, GQA_ANY_LENGTH),
        ({"batch": "batch", "rotary": True}, "ort-group-query-attention"),
    ],
    ids=["inf-fill", "finite-fill", "any-length", "rotary"],
)
def test_group_query_attention_gated_at_run_time(layer: dict[str, Any], rule: str) -> None:
    """Batch, new tokens and past all dynamic (an export serving prompts and decode steps): an If on the dims runs
    GroupQueryAttention where its kernel computes the export's attention (one new token; with a -inf fill also up to
    32 after no past or in a batch of 1) and the MultiHeadAttention on the Concat caches elsewhere, the present
    outputs the If's. Equal to the export in onnxruntime on both branches: left-padded decode steps and prompts, a
    prompt after a past in a batch (which the kernel refuses), a long prompt, a decode step whose row is all masked."""
    proto = decoder_layer(**layer)
    out, details = fuse(
        proto, "shape-infer,fuse,dce", enable=[GQA_ANY_LENGTH] if rule == GQA_ANY_LENGTH else [], target="ort"
    )
    assert details["applied"].get(rule) == 1, details
    assert "MultiHeadAttention" not in ops(out) and ops(out)["If"] == 1
    assert {k: _all_ops(out)[k] for k in ("GroupQueryAttention", "MultiHeadAttention")} == {
        "GroupQueryAttention": 1,
        "MultiHeadAttention": 1,
    }
    (gate,) = [n for n in out.graph.node if n.op_type == "If"]
    assert list(gate.output[1:]) == ["present_key", "present_value"]
    # GroupQueryAttention reads the projections: K's and V's head splits are made in the other branch only
    # (and K's rotary on the projection, as ort-rotary-embedding-3d writes it)
    branches = {attr.name: [n.op_type for n in attr.g.node] for attr in gate.attribute}
    rotary = ["RotaryEmbedding"] if layer.get("rotary") else []
    assert branches["then_branch"] == [*rotary, "GroupQueryAttention"] and "Transpose" not in ops(out)
    assert branches["else_branch"].count("Transpose") == 2
    assert branches["else_branch"].count("RotaryEmbedding") == len(rotary)
    steps = [(2, 1, 6, 3), (3, 1, 0, 0), (2, 4, 0, 2), (1, 5, 3, 2), (2, 3, 4, 1), (1, 40, 0, 0), (2, 1, 5, 6)]
    for step in steps:
        feeds = decoder_feeds(*step)
        assert_same_outputs(proto, out, _positions(feeds) if layer.get("rotary") else feeds, rtol=1e-4, atol=1e-4)


# -- the whole layer (fuse_models.ort_attention): onnxruntime's Attention (com.microsoft), Swin's windows -----


@pytest.mark.parametrize(("packed", "fp16"), [(False, False), (True, False), (False, True)])
def test_attention_layer_becomes_one_contrib_attention(packed: bool, fp16: bool) -> None:
    rule = "ort-attention-packed" if packed else "ort-attention"
    expected = {"Attention": 1, "Cast": 2 if fp16 else 1}
    proto = ort_attention(packed=packed, fp16=fp16)
    out = fires_ort(proto, rule, expected, passes="shape-infer,fuse,dce")
    assert_same_outputs(proto, out, masked_feeds(), rtol=1e-4, atol=1e-4)  # a mask with zeros
    attention = next(n for n in out.graph.node if n.op_type == "Attention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert attrs["num_heads"] == HEADS and attrs["mask_filter_value"] == pytest.approx(-10000.0)


def test_an_additive_mask_becomes_the_attention_bias() -> None:
    out = fires_ort(ort_attention(mask="bias"), "ort-attention", {"Attention": 1, "Shape": 1, "Concat": 1, "Expand": 1})
    assert len(next(n for n in out.graph.node if n.op_type == "Attention").input) == 6


def test_attention_refusals() -> None:
    refused(ort_attention(extra="output"), "ort-attention", target="ort")
    split_input = ort_attention(extra="split-input")
    feeds = {**masked_feeds(), "split_shape": np.array([0, 0, HEADS, SIZE], np.int64)}
    out, details = fuse(split_input, target="ort")
    assert "ort-attention" not in details["applied"]
    assert "not provable" in " ".join(details["near_misses"]["attention"])
    assert_same_outputs(split_input, out, feeds)
    out, details = fuse(ort_attention(), target="onnx")
    assert "ort-attention" not in details["applied"]


@pytest.mark.parametrize(("windows", "fused"), [(4, True), (32, False)])
def test_windowed_attention_with_a_bias_stays_unfused_over_many_batch_head_pairs(windows: int, fused: bool) -> None:
    # Swin's windows make the attention's batch windows * batch; with a bias onnxruntime's CPU
    # MultiHeadAttention ran 64 and more (batch, head) pairs per image slower than the written form.
    proto = ort_attention(windows=windows)
    out, details = fuse(proto, "shape-infer,fuse,dce", target="ort")
    fused_ops = ops(out)["MultiHeadAttention"] + ops(out)["Attention"]
    assert fused_ops == (1 if fused else 0) and ("Softmax" in ops(out)) != fused
    if not fused:
        assert any(
            "64 (batch, head) pairs per sample with a mask or bias" in m for m in details["near_misses"]["attention"]
        ), details
    x = np.random.default_rng(0).standard_normal((2, windows, WINDOW, HIDDEN)).astype(np.float32)
    assert_same_outputs(proto, out, {"x_windows": x}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["float16", "QDQ int8"])
def test_windowed_attention_over_many_pairs_fuses_in_float16_and_through_qdq(precision: str) -> None:
    # There the written form's products are float16 or integer MatMuls, which onnxruntime ran slower than its
    # MultiHeadAttention on Swin's exports (float16 0.841 and 0.831 of the variant's time as written, 0.832 and
    # 0.790 fused; QDQ 0.714 and 0.922 as written, 0.633 and 0.793 fused).
    proto = ort_attention(windows=32)
    x = np.random.default_rng(0).standard_normal((2, 32, WINDOW, HIDDEN)).astype(np.float32)
    if precision == "float16":
        model = as_float16(proto)
        out, details = fuse(model, "shape-infer,fuse,dce", target="ort")
    else:
        model = quantized(proto)
        out, details = fuse(model, "shape-infer,fuse,dce", target="ort", fuse_through_qdq=True)
    assert_no_further(proto, model, out, {"x_windows": x})
    assert ops(out)["MultiHeadAttention"] == 1 and "Softmax" not in ops(out), details["near_misses"]


@pytest.mark.parametrize("precision", ["dynamic int8", "int4"])
def test_windowed_attention_over_many_pairs_stays_unfused_where_only_the_projections_are_integer(
    precision: str,
) -> None:
    # Quantized weights (MatMulInteger, MatMulNBits) leave the attention's products float32 MatMuls, which ran as
    # fast as onnxruntime's MultiHeadAttention or faster on Swin's exports (dynamic int8 0.949 and 0.980 of the
    # variant's time as written, 1.002 and 0.994 fused; int4 0.989 and 0.963 as written, 1.017 and 0.988 fused).
    proto = VARIANTS[precision](ort_attention(windows=32))
    assert {"MatMulInteger", "MatMulNBits"} & set(ops(proto))
    out, details = fuse(proto, "shape-infer,fuse,dce", target="ort")
    assert ops(out)["MultiHeadAttention"] + ops(out)["Attention"] == 0 and "Softmax" in ops(out)
    assert any(
        "64 (batch, head) pairs per sample with a mask or bias" in m for m in details["near_misses"]["attention"]
    ), details["near_misses"]
    x = np.random.default_rng(0).standard_normal((2, 32, WINDOW, HIDDEN)).astype(np.float32)
    assert_same_outputs(proto, out, {"x_windows": x}, rtol=1e-4, atol=1e-4)
