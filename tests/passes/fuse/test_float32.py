"""The float16 ops computed in float32 (attention-float32, rmsnorm-float32; graphopt/passes/fuse/rules/_float32.py)
through the whole pipeline: what onnxruntime computes from the output, what the rules refuse and why."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from graphopt.numerics.reference import float_reference
from tests.cli_helpers import invoke
from tests.numerics import run_ort
from tests.passes.fuse.table import F16, LATE
from tests.passes.fuse.test_attention import (
    HALF_HEADS,
    cached_feeds,
    cached_float16_attention,
    causal_feeds,
    float16_attention,
)
from tests.passes.fuse_exported import fixture_inputs
from tests.passes.fuse_fixtures import FIXTURES
from tests.passes.fuse_helpers import fuse, info, model, node, refused


def _attention_exactly(feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """Attention on ``feeds`` in float64: the K and V heads repeated to Q's, the mask added to the scaled scores."""
    q, k, v, mask = (feeds[name].astype(np.float64) for name in HALF_HEADS)
    repeat = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, repeat, axis=1), np.repeat(v, repeat, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]) + mask
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def test_a_float16_attention_computes_in_float32(tmp_path: Path) -> None:
    """onnxruntime's float16 Attention kernel rounds inside (4.6x float16's own rounding of the result here); the
    chain it replaced ran in float32 behind the Casts onnxruntime inserts. The default pipeline's output computes
    it in float32: no further from the exact result than float16's rounding of it."""
    source, target = tmp_path / "half.onnx", tmp_path / "out.onnx"
    onnx.save(float16_attention(), source)
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 0, result.output
    assert "numerics: passed" in result.output
    written = onnx.load(target)
    attention = next(n for n in written.graph.node if n.op_type == "Attention")
    producers = {out: n for n in written.graph.node for out in n.output}
    assert [producers[name].op_type for name in attention.input] == ["Cast", "Cast", "Cast", "Where"]
    feeds = causal_feeds(3.0)
    exact = _attention_exactly(feeds)
    rounding = np.linalg.norm(exact.astype(np.float16) - exact)
    found = run_ort(target, feeds)["y"].astype(np.float64)
    assert np.linalg.norm(found - exact) <= 1.01 * rounding


def test_a_float16_attention_stays_float16_where_the_rule_is_off(tmp_path: Path) -> None:
    """For a runtime with float16 kernels of its own: --fuse-disable attention-float32 keeps the op as it is."""
    source, target = tmp_path / "half.onnx", tmp_path / "out.onnx"
    onnx.save(float16_attention(), source)
    result = invoke("run", source, "-o", target, "--fuse-disable", "attention-float32")
    assert result.exit_code == 0, result.output
    assert [n.op_type for n in onnx.load(target).graph.node] == ["Attention"]


def _assert_no_further_from_float32(source: Path, target: Path) -> None:
    """``target``'s logits are no further from ``source`` computed in float32 (the check's float reference) than
    ``source``'s own, as onnxruntime runs them (1% slack)."""
    original = onnx.load(source)
    reference = float_reference(original)
    assert reference is not None
    feeds = fixture_inputs(original)
    truth = run_ort(reference, feeds)["logits"].astype(np.float64)

    def error(model: onnx.ModelProto | Path) -> float:
        return float(np.linalg.norm(run_ort(model, feeds)["logits"].astype(np.float64) - truth))

    assert error(target) <= 1.01 * error(original)


def _fused_reading_float32(tmp_path: Path, op_types: tuple[str, ...], *flags: str) -> list[str]:
    """The op types of the float16 Llama export's ``op_types`` nodes after ``graphopt run`` with ``flags``, each
    reading float32: a Cast to float32, or another of them (through a Transpose or Reshape) whose result stays
    float32 (the islands family); the output no further from the export computed in float32 than the export
    itself."""
    source, target = FIXTURES / "llama_fp16_dynamo.onnx", tmp_path / "out.onnx"
    result = invoke("run", source, "-o", target, *flags)
    assert result.exit_code == 0, result.output
    assert "numerics: passed" in result.output
    written = onnx.load(target)
    producers = {out: n for n in written.graph.node for out in n.output}
    computed = [n for n in written.graph.node if n.op_type in op_types]
    for fused in computed:
        producer = producers[fused.input[0]]
        while producer.op_type in ("Transpose", "Reshape"):
            producer = producers[producer.input[0]]
        widened = producer.op_type == "Cast" and producer.attribute[0].i == TensorProto.FLOAT
        assert widened or producer.op_type in op_types, fused.name
    _assert_no_further_from_float32(source, target)
    return [n.op_type for n in computed]


def test_a_float16_llama_layer_computes_its_norms_attention_and_rotary_in_float32(tmp_path: Path) -> None:
    """The float16 Llama export at --target-opset 23: its fused RMSNormalizations, RotaryEmbeddings and Attention
    read float32, and the output is no further from the export computed in float32 (the check's float reference)
    than the export itself, as onnxruntime runs it."""
    fused = ("RMSNormalization", "RotaryEmbedding", "Attention")
    computed = _fused_reading_float32(tmp_path, fused, "--target-opset", "23")
    assert Counter(computed) == {"RMSNormalization": 3, "RotaryEmbedding": 2, "Attention": 1}
    # the islands rules: the query and key pass from the RotaryEmbeddings to the Attention in float32
    written = onnx.load(tmp_path / "out.onnx")
    producers = {out: n for n in written.graph.node for out in n.output}
    (attention,) = [n for n in written.graph.node if n.op_type == "Attention"]
    assert [producers[name].op_type for name in attention.input[:2]] == ["RotaryEmbedding"] * 2
    # 7.47e-4 for both; with the float16 ops (--fuse-disable attention-float32 and rmsnorm-float32) 8.34e-4


def test_a_float16_llama_layer_computes_its_norms_in_float32_for_onnxruntime(tmp_path: Path) -> None:
    """At --target ort the float16 Llama export's norms are onnxruntime's SimplifiedLayerNormalization, whose float16
    kernel rounds its input and result where the chain it replaced passed float32 on (qwen3's float16 exports at
    --target ort: 1.046 of the variant's error to the float32 export). They read Casts to float32, and the output is
    no further from the export computed in float32 than the export itself."""
    assert _fused_reading_float32(tmp_path, ("SimplifiedLayerNormalization",), "--target", "ort")


def test_a_float16_llama_layer_computes_its_softmax_in_float32(tmp_path: Path) -> None:
    """From opset 13 onnxruntime's CPU provider has no float16 Softmax kernel: it ran the op's function body, 2.7x
    the float32 kernel's time. Below opset 23 (no Attention op) the default pipeline writes the float16 Llama
    export's Softmax in float32 between Casts, and the output is no further from the export computed in float32
    than the export itself. (The TorchScript export's Softmax is float32 already: HF's eager attention upcasts it.)"""
    source, target = FIXTURES / "llama_fp16_dynamo.onnx", tmp_path / "out.onnx"
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 0, result.output
    assert "numerics: passed" in result.output
    written = onnx.load(target)
    producers = {out: n for n in written.graph.node for out in n.output}
    (softmax,) = [n for n in written.graph.node if n.op_type == "Softmax"]
    readers = [n for n in written.graph.node if softmax.output[0] in n.input]
    assert producers[softmax.input[0]].op_type == "Cast" and [n.op_type for n in readers] == ["Cast"]
    _assert_no_further_from_float32(source, target)


def _cached_float16_attention() -> onnx.ModelProto:
    """A float16 decode step's Attention on a KV cache (past_key / past_value in, present out)."""
    shapes = {
        "q": [1, 2, 1, 8],
        "k": [1, 2, 1, 8],
        "v": [1, 2, 1, 8],
        "past_key": [1, 2, 5, 8],
        "past_value": [1, 2, 5, 8],
    }
    return model(
        [node("Attention", ["q", "k", "v", "", "past_key", "past_value"], ["y", "present_key", "present_value"])],
        [info(name, shape, F16) for name, shape in shapes.items()],
        [info(name, None, F16) for name in ("y", "present_key", "present_value")],
        opset=23,
    )


def test_a_float16_attention_on_a_kv_cache_stays_float16() -> None:
    """In float32 the cache would be converted whole at every decode step (9.88 ms against 3.70 ms at 4096 tokens)."""
    details = refused(_cached_float16_attention(), "attention-float32", passes="shape-infer,fuse,dce", **LATE)
    assert any("a float16 KV cache" in miss for miss in details["near_misses"]["attention"]), details


def test_a_fully_masked_query_of_a_float16_attention_keeps_its_zeros(tmp_path: Path) -> None:
    """onnxruntime's Attention reads a mask entry of its type's lowest value as -inf: a query whose keys are all
    masked gets zeros. Float16's lowest is an ordinary number in float32, so the widened mask maps it to float32's
    lowest, and the query keeps its zeros."""
    source, target = tmp_path / "half.onnx", tmp_path / "out.onnx"
    onnx.save(float16_attention(), source)
    feeds = causal_feeds(1.0)
    feeds["mask"][0, :] = np.finfo(np.float16).min  # the first query sees no key
    data = tmp_path / "inputs.npz"
    np.savez(data, **feeds)
    result = invoke("run", source, "-o", target, "--inputs", data)
    assert result.exit_code == 0, result.output
    assert "Cast" in Counter(n.op_type for n in onnx.load(target).graph.node)
    original, written = run_ort(source, feeds)["y"], run_ort(target, feeds)["y"]
    assert not original[:, :, 0].any()
    assert not written[:, :, 0].any()
    np.testing.assert_allclose(written.astype(np.float32), original.astype(np.float32), atol=2e-2)


def test_outputs_nothing_reads_are_not_cast_back() -> None:
    """An Attention's present outputs that nothing reads (no past: the present is K and V themselves) take no Cast."""
    proto = model(
        [node("Attention", ["q", "k", "v"], ["y", "present_key", "present_value"])],
        [info(name, HALF_HEADS[name], F16) for name in ("q", "k", "v")],
        [info("y", None, F16)],
        opset=23,
    )
    out, details = fuse(proto, passes="shape-infer,fuse,dce", **LATE)
    assert details["applied"].get("attention-float32") == 1, details
    assert Counter(n.op_type for n in out.graph.node) == {"Cast": 4, "Attention": 1}


def test_a_kv_cache_kept_in_float32_outside_is_read_in_float32(tmp_path: Path) -> None:
    """A float16 model with float32 inputs and outputs (onnxruntime's converter, keep_io_types) casts its cache to
    float16: the float32 Attention reads the float32 cache itself, and the model's Cast to float16 goes, so no
    conversion of the cache is added."""
    proto = _cached_float16_attention()
    graph = proto.graph
    for name in ("past_key", "past_value"):
        graph.node.insert(0, node("Cast", [f"{name}_float32"], name, to=TensorProto.FLOAT16))
        index = next(i for i, v in enumerate(graph.input) if v.name == name)
        graph.input[index].CopyFrom(info(f"{name}_float32", [1, 2, 5, 8]))
    source, target = tmp_path / "cached.onnx", tmp_path / "out.onnx"
    onnx.save(proto, source)
    result = invoke("run", source, "-o", target)
    assert result.exit_code == 0, result.output
    assert "numerics: passed" in result.output
    written = onnx.load(target)
    attention = next(n for n in written.graph.node if n.op_type == "Attention")
    assert list(attention.input[4:6]) == ["past_key_float32", "past_value_float32"]
    assert not any(n.op_type == "Cast" and n.input[0].endswith("_float32") for n in written.graph.node)
    assert invoke("run", target, "--check-optimized").exit_code == 0


def test_an_attention_nothing_reads_is_left_to_dce() -> None:
    """A float16 Attention whose outputs nothing reads (dead before dce runs) is no match: nothing to cast back."""
    proto = model(
        [node("Attention", ["q", "k", "v"], "y"), node("Identity", ["q"], "out")],
        [info(name, HALF_HEADS[name], F16) for name in ("q", "k", "v")],
        [info("out", None, F16)],
        opset=23,
    )
    _, details = fuse(proto, **LATE)
    assert "attention-float32" not in details["applied"], details
    assert any("nothing reads" in miss for miss in details["near_misses"].get("attention", [])), details


def test_a_grouped_query_attention_at_target_ort_reads_its_float32_cache(tmp_path: Path) -> None:
    """onnxruntime's float16 GroupQueryAttention reads the KV cache rounded to float16 where the model casts it
    from float32: at --target ort the op computes in float32 on the float32 cache itself, and lands nearer the
    model computed in float32 (llama_kv_ts_fp16: 1.012 -> 0.926 of the variant's error to the float32 export)."""
    source, target = tmp_path / "half.onnx", tmp_path / "out.onnx"
    original = cached_float16_attention("GroupQueryAttention")
    onnx.save(original, source)
    feeds = cached_feeds("GroupQueryAttention")
    data = tmp_path / "inputs.npz"
    np.savez(data, **feeds)
    result = invoke("run", source, "-o", target, "--target", "ort", "--inputs", data)
    assert result.exit_code == 0, result.output
    assert "numerics: passed" in result.output
    written = onnx.load(target)
    attention = next(n for n in written.graph.node if n.op_type == "GroupQueryAttention")
    assert list(attention.input[3:5]) == ["past_k", "past_v"]  # the float32 inputs, no Cast between
    reference = float_reference(original)
    assert reference is not None
    truth = run_ort(reference, feeds)

    def error(model: onnx.ModelProto | Path) -> float:
        found = run_ort(model, feeds)
        return sum(float(np.linalg.norm(found[k].astype(np.float64) - truth[k])) for k in ("y",))

    assert error(target) < 0.9 * error(original)
