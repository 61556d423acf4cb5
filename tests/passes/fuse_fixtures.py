"""The exporter fixtures (tests/fixtures/exports, made by its make.py): where they are, the inputs to feed them,
and cuts of their attention and SiLU as written, shared by the export tests and the rule table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

FIXTURES = Path(__file__).parent.parent / "fixtures" / "exports"
EXPORTERS = ("dynamo", "ts")
PAST, KV_HEADS, HEAD_SIZE, IMAGE = 3, 2, 8, 64
KERAS_FEATURES = (6, 16)  # make_keras.py's static sequence and width
LEVIT_TOKENS = (16, 32)  # make.py's levit: a 4x4 grid of 32 channels
LATENTS = (4, 16, 12)  # make.py's unet: its static latent channels, height and width


def fixture_feeds(proto: onnx.ModelProto, batch: int, seq: int, pad: str) -> dict[str, np.ndarray]:
    """Inputs at one binding (a text model's ids at ``seq`` tokens, an image model's pixels); the last row's mask
    has 2 zeros at its ``pad`` end ("tail" or "head")."""
    rng = np.random.default_rng(batch * 100 + seq)
    names = [i.name for i in proto.graph.input]
    total = seq + PAST if "past_key" in names else seq
    past = next((i.type.tensor_type.shape.dim for i in proto.graph.input if i.name == "past_key"), None)
    heads, size = (past[1].dim_value, past[3].dim_value) if past is not None else (KV_HEADS, HEAD_SIZE)
    mask = np.ones((batch, total), np.int64)
    if batch > 1:
        mask[-1, -2:] = 0 if pad == "tail" else 1
        mask[-1, :2] = 0 if pad == "head" else 1
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(1, 64, (batch, seq)),
        "attention_mask": mask,
        "position_ids": np.broadcast_to(np.arange(PAST, PAST + seq), (batch, seq)).copy(),
        "past_key": rng.standard_normal((batch, heads, PAST, size)).astype(np.float32),
        "past_value": rng.standard_normal((batch, heads, PAST, size)).astype(np.float32),
        "pixel_values": rng.standard_normal((batch, 3, IMAGE, IMAGE)).astype(np.float32),
        "features": rng.standard_normal((batch, *KERAS_FEATURES)).astype(np.float32),
        "x": rng.standard_normal((batch, *LEVIT_TOKENS)).astype(np.float32),
        "sample": rng.standard_normal((batch, *LATENTS)).astype(np.float32),
        "timestep": rng.uniform(0, 1000, batch).astype(np.float32),
        "encoder_hidden_states": rng.standard_normal((batch, seq, 32)).astype(np.float32),
    }
    return {name: feeds[name] for name in names}


BROADCAST_BIAS = "ort-multihead-attention-broadcast-bias"


def exported_attention() -> onnx.ModelProto:
    """The attention of the dynamo llama fixture, as written (opset 23): rotated Q (4 heads) and K (2 heads),
    V, the float mask; the repeat of the K / V heads, K^T as Reshape / Transpose / Reshape, sqrt(scale) on Q
    and on K^T, the mask Add, Softmax, the IsNaN guard and the product with V."""
    proto = onnx.load(str(FIXTURES / "llama_dynamo.onnx"))
    inputs = ["input_ids", "add_199", "add_235", "transpose_2", "val_153"]
    cut = onnx.utils.Extractor(proto).extract_model(inputs, ["scaled_dot_product_attention"])
    del cut.opset_import[:]
    cut.opset_import.append(onnx.helper.make_opsetid("", 23))
    return cut


def exported_merged_attention(until: str = "view_4", opset: int = 23) -> onnx.ModelProto:
    """The first attention of the dynamo bloom fixture, as written (at ``opset``): Q, K, V (batch, heads, seq, d)
    merged to (batch * heads, seq, d), the scaled 3-D scores plus the merged ALiBi bias, split by heads for the
    float mask and Softmax, merged for the product with V and split back (``view_4``), then merged (``until``
    "_unsafe_view_3"). Batch 2, sequence 6: the inputs' dims are static, so that generated feeds fit together."""
    proto = onnx.load(str(FIXTURES / "bloom_dynamo.onnx"))
    dims = {"input_ids": [2, 6], "view": [8, 1, 6], "where": [2, 1, 6, 6]}
    inputs = ["input_ids", "transpose", "transpose_1", "transpose_2", "view", "where"]
    cut = onnx.utils.Extractor(proto).extract_model(inputs, [until])
    del cut.graph.value_info[:]  # the exporter's, with batch and sequence dynamic
    for value in cut.graph.input:
        shape = value.type.tensor_type.shape
        shape.ClearField("dim")
        for dim in dims.get(value.name, [2, 4, 6, 8]):
            shape.dim.add().dim_value = dim
    for value in cut.graph.output:
        value.type.tensor_type.ClearField("shape")
    del cut.opset_import[:]
    cut.opset_import.append(onnx.helper.make_opsetid("", opset))
    return cut


def softcapped(proto: onnx.ModelProto, inner: float, outer: float) -> onnx.ModelProto:
    """``proto`` (an exported attention) with Gemma 2's score softcap written in as transformers does, between the
    scores and the mask: ``Mul(Tanh(Div(scores, inner)), outer)`` (a softcap where inner = outer > 0)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    matmuls = {o for n in out.graph.node if n.op_type == "MatMul" for o in n.output}
    add = next(n for n in out.graph.node if n.op_type == "Add" and n.input[0] in matmuls)
    scores, add.input[0] = add.input[0], "capped"
    at = list(out.graph.node).index(add)
    for offset, made in enumerate(
        [
            onnx.helper.make_node("Div", [scores, "cap_in"], ["scores_in"]),
            onnx.helper.make_node("Tanh", ["scores_in"], ["tanh"]),
            onnx.helper.make_node("Mul", ["tanh", "cap_out"], ["capped"]),
        ]
    ):
        out.graph.node.insert(at + offset, made)
    for name, value in (("cap_in", inner), ("cap_out", outer)):
        out.graph.initializer.append(onnx.numpy_helper.from_array(np.array(value, np.float32), name))
    return out


def exported_encoder_attention(opset: int = 23) -> onnx.ModelProto:
    """The first attention of the dynamo bert fixture, as written (at ``opset``), from its Q, K, V projections and
    float mask to the merged heads: the head splits, SDPA (sqrt(scale) on Q and K^T, K^T as Reshape / Transpose /
    Reshape, IsNaN guard) and the merge."""
    proto = onnx.load(str(FIXTURES / "bert_dynamo.onnx"))
    inputs = ["input_ids", "linear", "linear_1", "linear_2", "val_102"]
    cut = onnx.utils.Extractor(proto).extract_model(inputs, ["view_4"])
    del cut.opset_import[:]
    cut.opset_import.append(onnx.helper.make_opsetid("", opset))
    return cut


def exported_silu(opset: int = 24) -> onnx.ModelProto:
    """The SiLU of the dynamo llama fixture's MLP as written, x * Sigmoid(x), at ``opset``."""
    proto = onnx.load(str(FIXTURES / "llama_dynamo.onnx"))
    cut = onnx.utils.Extractor(proto).extract_model(["linear_4"], ["silu"])
    del cut.opset_import[:]
    cut.opset_import.append(onnx.helper.make_opsetid("", opset))
    return cut
