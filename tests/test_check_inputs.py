"""The check's inputs: bindings solved from the graph, input regimes, every element type, random ops.

Each wrong-model pair is a model and a copy that differs from it only where one regime
reaches: the check must call the pair "failed", at the binding that carries that regime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.errors import InputError
from graphopt.numerics import CheckResult, check_models
from graphopt.numerics.inputs import bind_dims, make_inputs, read_spec
from tests import node_suite
from tests.cli_helpers import invoke
from tests.test_check import _model, _save

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
Shape = list[int | str | None]


def _failed_at(result: CheckResult, regime: str) -> None:
    """``result`` failed, and the first binding that failed carries ``regime``."""
    assert result.status == "failed", result.reason
    failing = [b for b in result.bindings if not b.passed]
    assert failing and any(regime in r for r in failing[0].regimes), [b.regimes for b in failing]
    assert regime in (result.reason or "")


# -- the four wrong-model pairs ----------------------------------------------------------------


def _encoder(ignore_mask: bool = False, bad_rows: int | None = None, bad_after: int | None = None) -> onnx.ModelProto:
    """Sum over the sequence of mask * embedding(ids) + a position table's rows: a tiny masked encoder.

    ``ignore_mask``: the mask is not applied; ``bad_rows``: the embedding rows from there on
    are corrupted; ``bad_after``: the position rows from there on are.
    """
    rng = np.random.default_rng(0)
    table = rng.standard_normal((1000, 4)).astype(np.float32)
    positions = rng.standard_normal((512, 4)).astype(np.float32)
    if bad_rows is not None:
        table[bad_rows:] += 1.0
    if bad_after is not None:
        positions[bad_after:] += 1.0
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["embedded"]),
        helper.make_node("Shape", ["input_ids"], ["length"], start=1, end=2),
        helper.make_node("Squeeze", ["length"], ["length0"]),
        helper.make_node("Range", ["zero", "length0", "one"], ["steps"]),
        helper.make_node("Gather", ["positions", "steps"], ["placed"]),
        helper.make_node("Add", ["embedded", "placed"], ["hidden"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"]),
        helper.make_node("Mul", ["hidden", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["hidden" if ignore_mask else "masked", "seq_axis"], ["y"], keepdims=0),
    ]
    inits = {
        "table": table,
        "positions": positions,
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "last": np.array([-1], np.int64),
        "seq_axis": np.array([1], np.int64),
    }
    return _model(
        nodes,
        [("input_ids", INT64, ["batch", "sequence"]), ("attention_mask", INT64, ["batch", "sequence"])],
        [("y", FLOAT, ["batch", 4])],
        inits,
    )


def test_a_model_that_ignores_the_mask_fails_on_padded_masks(tmp_path: Path) -> None:
    result = check_models(_save(tmp_path, "a", _encoder()), _save(tmp_path, "b", _encoder(ignore_mask=True)))
    _failed_at(result, "padded masks")


def test_corrupt_embedding_rows_past_100_fail_on_ids_over_the_table(tmp_path: Path) -> None:
    result = check_models(_save(tmp_path, "a", _encoder()), _save(tmp_path, "b", _encoder(bad_rows=100)))
    _failed_at(result, "ids over the whole table")


def _quantized_table(proto: onnx.ModelProto, domain: str = "") -> onnx.ModelProto:
    """``proto`` with its embedding table stored as int8 and read through DequantizeLinear (a QDQ model; of
    ``domain``: onnxruntime's own, com.microsoft, in 16-bit QDQ models)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    index = next(i for i, t in enumerate(out.graph.initializer) if t.name == "table")
    table = numpy_helper.to_array(out.graph.initializer[index])
    scale = np.float32(np.abs(table).max() / 127)
    quantized = np.clip(np.round(table / scale), -127, 127).astype(np.int8)
    out.graph.initializer[index].CopyFrom(numpy_helper.from_array(quantized, "table_quantized"))
    out.graph.initializer.append(numpy_helper.from_array(np.array(scale, np.float32), "table_scale"))
    dequantize = helper.make_node("DequantizeLinear", ["table_quantized", "table_scale"], ["table"], domain=domain)
    out.graph.node.insert(0, dequantize)
    if domain:
        out.opset_import.append(helper.make_opsetid(domain, 1))
    return out


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
def test_corrupt_rows_of_a_quantized_embedding_fail_on_ids_over_the_table(tmp_path: Path, domain: str) -> None:
    """A QDQ model's embedding is Gather(DequantizeLinear(int8 table), ids): the ids still spread over the table.
    Read through onnxruntime's own DequantizeLinear (a 16-bit QDQ Llama), the ids were a small index, all 0, and
    the check passed fusions that moved the logits by 7.5x their norm."""
    original, corrupt = (_quantized_table(_encoder(bad_rows=rows), domain) for rows in (None, 100))
    result = check_models(_save(tmp_path, "a", original), _save(tmp_path, "b", corrupt))
    _failed_at(result, "ids over the whole table")


def _block_quantized_table(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with its embedding table stored as 4-bit blocks, read by onnxruntime's GatherBlockQuantized (the
    4-bit quantizer's embeddings, with Gather among its ops)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    index = next(i for i, t in enumerate(out.graph.initializer) if t.name == "table")
    table = numpy_helper.to_array(out.graph.initializer[index])
    scale = (np.abs(table).max(axis=1, keepdims=True) / 7).astype(np.float32)
    quantized = np.clip(np.round(table / scale), -8, 7).astype(np.int8)  # int4's zero point is 0
    del out.graph.initializer[index]
    out.graph.initializer.extend(
        [
            helper.make_tensor("table_q4", TensorProto.INT4, list(table.shape), quantized.ravel().tolist()),
            numpy_helper.from_array(scale, "table_scales"),
        ]
    )
    gather = next(node for node in out.graph.node if node.op_type == "Gather" and node.input[0] == "table")
    gather.CopyFrom(
        helper.make_node(
            "GatherBlockQuantized",
            ["table_q4", "input_ids", "table_scales"],
            list(gather.output),
            domain="com.microsoft",
            block_size=16,
        )
    )
    out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return out


def test_corrupt_rows_of_a_block_quantized_embedding_fail_on_ids_over_the_table(tmp_path: Path) -> None:
    """Read through GatherBlockQuantized, the ids were a small index (0 to 99 of 8000 rows on bert_ts quantized to
    4 bits with its embeddings), and rows past 100 were never read."""
    original, corrupt = (_block_quantized_table(_encoder(bad_rows=rows)) for rows in (None, 100))
    result = check_models(_save(tmp_path, "a", original), _save(tmp_path, "b", corrupt))
    _failed_at(result, "ids over the whole table")


def _unreached(scale: float, second: str | None = None) -> onnx.ModelProto:
    """y = Relu(-|x|) * scale: 0 at every input, whatever ``scale`` (a wrong rewrite the inputs cannot show), and
    a second output z: ``"reached"`` x * scale, which every input reaches; ``"argmax"`` y's ArgMax (0 everywhere
    too, an integer); ``"nan"`` y / 0 * 0 (NaN everywhere)."""
    nodes = [
        helper.make_node("Abs", ["x"], ["magnitude"]),
        helper.make_node("Neg", ["magnitude"], ["negative"]),
        helper.make_node("Relu", ["negative"], ["zero"]),
        helper.make_node("Mul", ["zero", "scale"], ["y"]),
    ]
    seconds = {
        "reached": ([helper.make_node("Mul", ["x", "scale"], ["z"])], FLOAT),
        "argmax": ([helper.make_node("ArgMax", ["y"], ["z"], axis=1)], INT64),
        "nan": (
            [helper.make_node("Div", ["y", "nothing"], ["inf"]), helper.make_node("Mul", ["inf", "nothing"], ["z"])],
            FLOAT,
        ),
    }
    outputs: list[tuple[str, int, list[int | str | None] | None]] = [("y", FLOAT, ["batch", 4])]
    if second is not None:
        more, element = seconds[second]
        nodes += more
        outputs.append(("z", element, None))
    constants = {"scale": np.array(scale, np.float32), "nothing": np.array(0.0, np.float32)}
    return _model(nodes, [("x", FLOAT, ["batch", 4])], outputs, constants)


@pytest.mark.parametrize("second", [None, "argmax", "nan"])
def test_a_check_whose_outputs_hold_one_value_everywhere_is_not_checked(tmp_path: Path, second: str | None) -> None:
    """The 16-bit QDQ Llama's logits were 0 at every binding (its ids all 0), before and after a wrong fusion:
    "passed" proved nothing. The check says so, and --require-check refuses it; also where another output is
    computed from the constant one (an ArgMax), or is NaN everywhere (nothing compared there)."""
    original, wrong = _save(tmp_path, "a", _unreached(1.0, second)), _save(tmp_path, "b", _unreached(2.0, second))
    result = check_models(original, wrong)
    assert result.status == "not checked", result.reason
    assert "every output compared holds one value at every element of every binding ('y': 0" in (result.reason or "")
    assert "--inputs" in (result.reason or "")
    assert "numerics not checked" in invoke("check", original, wrong).output
    assert invoke("check", original, wrong, "--require-check").exit_code == 1


def test_one_output_holding_one_value_everywhere_is_a_note(tmp_path: Path) -> None:
    original = _save(tmp_path, "a", _unreached(1.0, "reached"))
    result = check_models(original, original)
    assert result.status == "passed", result.reason
    assert "output 'y' is 0 at every element of every binding" in (result.reason or "")
    assert "'z'" not in (result.reason or "")
    assert "note: output 'y' is 0" in invoke("check", original, original).output


def test_a_model_wrong_past_position_17_fails_on_the_long_sequence(tmp_path: Path) -> None:
    result = check_models(_save(tmp_path, "a", _encoder()), _save(tmp_path, "b", _encoder(bad_after=17)))
    _failed_at(result, "long sequence 128")


def _detector(wrong_above: int | None = None) -> onnx.ModelProto:
    """Two strided convs, the coarse map upsampled and concatenated with the fine one (a detector's neck).

    ``wrong_above``: the output is off wherever the image is larger than that many pixels.
    """
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["images", "w1"], ["fine"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["fine", "w2"], ["coarse"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["coarse", "", "up"], ["upsampled"], mode="nearest"),
        helper.make_node("Concat", ["fine", "upsampled"], ["neck"], axis=1),
        helper.make_node("ReduceMean", ["neck", "spatial_axes"], ["y0"], keepdims=0),
    ]
    inits = {
        "w1": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "w2": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
        "up": np.array([1, 1, 2, 2], np.float32),
        "spatial_axes": np.array([2, 3], np.int64),
    }
    if wrong_above is None:
        nodes[-1].output[0] = "y"
    else:  # y = y0 + (height > wrong_above)
        nodes += [
            helper.make_node("Shape", ["images"], ["h"], start=2, end=3),
            helper.make_node("Greater", ["h", "limit"], ["big"]),
            helper.make_node("Cast", ["big"], ["bigf"], to=FLOAT),
            helper.make_node("Add", ["y0", "bigf"], ["y"]),
        ]
        inits["limit"] = np.array([wrong_above], np.int64)
    return _model(nodes, [("images", FLOAT, [None, 3, "height", "width"])], [("y", FLOAT, [None, 8])], inits, opset=18)


def test_a_model_wrong_on_images_over_8_px_fails_on_realistic_images(tmp_path: Path) -> None:
    result = check_models(_save(tmp_path, "a", _detector()), _save(tmp_path, "b", _detector(wrong_above=8)))
    _failed_at(result, "images 224 x 224")


def test_a_detector_neck_runs_at_sizes_every_stride_divides(tmp_path: Path) -> None:
    path = _save(tmp_path, "m", _detector())
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert [b.dims for b in result.bindings] == [
        {"images[0]": 3, "height": 224, "width": 224},
        {"images[0]": 1, "height": 192, "width": 320},
        {"images[0]": 5, "height": 448, "width": 512},
    ]
    assert result.bindings[1].regimes == ["images 192 x 320", "floats at scale 10"]


# -- bindings solved from the graph --------------------------------------------------------------


def _decoder(mask_dim: str = "total_sequence") -> onnx.ModelProto:
    """keys = past ++ new along the sequence, times the mask over past + new: runs only when they agree."""
    nodes = [
        helper.make_node("Concat", ["past_key", "new_key"], ["keys"], axis=1),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"]),
        helper.make_node("Mul", ["keys", "mask3"], ["y"]),
        helper.make_node("Cast", ["position_ids"], ["positions"], to=FLOAT),
    ]
    return _model(
        nodes,
        [
            ("new_key", FLOAT, ["batch", "sequence", 4]),
            ("attention_mask", INT64, ["batch", mask_dim]),
            ("position_ids", INT64, ["batch", "sequence"]),
            ("past_key", FLOAT, ["batch", "past_sequence", 4]),
        ],
        [("y", FLOAT, ["batch", mask_dim, 4]), ("positions", FLOAT, ["batch", "sequence"])],
        {"last": np.array([-1], np.int64)},
    )


@pytest.mark.parametrize("mask_dim", ["total_sequence", "s53"])
def test_a_kv_cache_decoder_runs_with_past_plus_sequence_equal_to_total(tmp_path: Path, mask_dim: str) -> None:
    path = _save(tmp_path, "m", _decoder(mask_dim))
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    for binding in result.bindings:
        assert binding.dims[mask_dim] == binding.dims["past_sequence"] + binding.dims["sequence"]
    # The largest binding: a batch of 5, a prompt of 64 after a cache of 64.
    assert [b.dims[mask_dim] for b in result.bindings] == [24, 128, 128]
    assert [result.bindings[2].dims[k] for k in ("batch", "sequence")] == [5, 64]
    spec = read_spec(path)
    binding = bind_dims(spec, 0, {})
    positions = make_inputs(spec, binding, np.random.default_rng(0))["position_ids"]
    assert (positions == 8 + np.arange(16)).all()  # after the cache of 8
    assert "positions after the cache" in binding.regimes


def _vad() -> onnx.ModelProto:
    """A silero-vad-like model: audio[?, ?], state[2, ?, 8] and a scalar rate, no dim named."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Unsqueeze", ["input", "one_axis"], ["audio3"]),
        helper.make_node("Conv", ["audio3", "stft"], ["frames"], strides=[4]),
        helper.make_node("ReduceMean", ["frames", "time_axis"], ["features"], keepdims=0),
        helper.make_node("Gather", ["state", "zero"], ["h"], axis=0),
        helper.make_node("Add", ["features", "h"], ["mixed"]),
        helper.make_node("Cast", ["sr"], ["srf"], to=FLOAT),
        helper.make_node("Mul", ["mixed", "srf"], ["output"]),
    ]
    inits = {
        "one_axis": np.array([1], np.int64),
        "stft": rng.standard_normal((8, 1, 8)).astype(np.float32),
        "time_axis": np.array([2], np.int64),
        "zero": np.array(0, np.int64),
    }
    return _model(
        nodes,
        [("input", FLOAT, [None, None]), ("state", FLOAT, [2, None, 8]), ("sr", INT64, [])],
        [("output", FLOAT, [None, 8])],
        inits,
        opset=18,
    )


def test_a_vad_model_with_unnamed_dims_runs_and_every_dim_is_addressable(tmp_path: Path) -> None:
    path = _save(tmp_path, "vad", _vad())
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert result.bindings[0].dims["state[1]"] == result.bindings[0].dims["input[0]"]
    fixed = check_models(path, path, dims={"input[1]": 512})
    assert [b.dims["input[1]"] for b in fixed.bindings] == [512, 512, 512]
    with pytest.raises(InputError, match=r"it has: input\[0\], input\[1\], state\[1\]"):
        check_models(path, path, dims={"samples": 4})
    cli = invoke("check", path, path, "--dim", "input[1]=512", "--json")
    assert cli.exit_code == 0, cli.stderr


# -- operands that set shapes, counts and indices ------------------------------------------------


def test_operands_get_small_valid_values(tmp_path: Path) -> None:
    # Repeats, shapes, k, limits and indices as graph inputs: drawn as ids up to 99 they asked
    # for gigabytes (node test test_tile) or indexed out of range.
    nodes = [
        helper.make_node("Tile", ["x", "repeats"], ["tiled"]),
        helper.make_node("Reshape", ["x", "shape"], ["reshaped"]),
        helper.make_node("Expand", ["x", "expand_to"], ["expanded"]),
        helper.make_node("TopK", ["x", "k"], ["top", "top_index"]),
        helper.make_node("Range", ["start", "limit", "delta"], ["steps"]),
        helper.make_node("GatherElements", ["x", "index"], ["picked"], axis=1),
    ]
    shape_input = [
        ("x", FLOAT, [2, 3, 4, 5, 6, 7]),
        ("repeats", INT64, [6]),
        ("shape", INT64, [3]),
        ("expand_to", INT64, [6]),
        ("k", INT64, [1]),
        ("start", INT64, []),
        ("limit", INT64, []),
        ("delta", INT64, []),
        ("index", INT64, [2, 3, 4, 5, 6, 7]),
    ]
    outputs = ["tiled", "reshaped", "expanded", "top", "top_index", "steps", "picked"]
    model = _model(nodes, shape_input, [(n, INT64 if n in ("top_index", "steps") else FLOAT, None) for n in outputs])
    path = _save(tmp_path, "m", model)
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert "small shape, count and index operands" in result.bindings[0].regimes


# -- every element type onnxruntime takes --------------------------------------------------------

# Each type with the opset at which onnxruntime implements Cast from it (and Identity, for those
# it can hand back), and whether it can hand it back.
_SMALL_TYPES = {
    "BFLOAT16": (21, True),
    "FLOAT8E4M3FN": (21, True),
    "FLOAT8E4M3FNUZ": (21, True),
    "FLOAT8E5M2": (21, True),
    "FLOAT8E5M2FNUZ": (21, True),
    "FLOAT8E8M0": (24, False),
    "INT4": (21, False),
    "UINT4": (21, False),
    "INT2": (25, False),
    "UINT2": (25, False),
}


def _cast_model(elem_type: int, opset: int, returned: bool, factor: float) -> onnx.ModelProto:
    """In: the small type; out: its float32 value times ``factor`` (and the input itself, if ``returned``)."""
    nodes = [
        helper.make_node("Cast", ["x"], ["wide0"], to=FLOAT),
        helper.make_node("Mul", ["wide0", "factor"], ["wide"]),
    ]
    outputs: list[tuple[str, int, Shape | None]] = [("wide", FLOAT, None)]
    if returned:
        nodes.append(helper.make_node("Identity", ["x"], ["same"]))
        outputs.append(("same", elem_type, None))
    factor_init = {"factor": np.array(factor, np.float32)}
    model = _model(nodes, [("x", elem_type, ["batch", 5])], outputs, factor_init, opset=opset)
    model.ir_version = 11
    return model


@pytest.mark.parametrize("type_name", list(_SMALL_TYPES))
def test_every_small_element_type_is_generated_and_compared(tmp_path: Path, type_name: str) -> None:
    elem_type = getattr(TensorProto, type_name)
    opset, returned = _SMALL_TYPES[type_name]
    path = _save(tmp_path, "m", _cast_model(elem_type, opset, returned, 1.0))
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert len(result.bindings) == 3
    changed = _save(tmp_path, "c", _cast_model(elem_type, opset, returned, -1.0))
    assert check_models(path, changed).status == "failed"


# -- nondeterminism from the graph ---------------------------------------------------------------


def _tiny_dropout() -> onnx.ModelProto:
    """'noisy': a training-mode Dropout over a 2x1 tensor (two runs agree by chance a quarter of the
    time); 'clean': the same input doubled."""
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "training"], ["noisy"]),
        helper.make_node("Add", ["x", "x"], ["clean"]),
    ]
    inits = {"ratio": np.array(0.5, np.float32), "training": np.array(True)}
    return _model(nodes, [("x", FLOAT, [2, 1])], [("noisy", FLOAT, None), ("clean", FLOAT, None)], inits)


def test_a_training_dropout_is_not_checked_in_200_runs_out_of_200(tmp_path: Path) -> None:
    path = _save(tmp_path, "m", _tiny_dropout())
    for seed in range(200):
        result = check_models(path, path, seed=seed)
        assert result.status == "passed", (seed, result.reason)
        noisy, clean = result.bindings[0].outputs
        assert noisy.passed is None and noisy.reason == "not checked: nondeterministic (op Dropout)"
        assert clean.passed is True


def test_an_inference_dropout_is_checked(tmp_path: Path) -> None:
    model = _tiny_dropout()
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(False), "training"))
    path = _save(tmp_path, "m", model)
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None
    assert all(o.passed for o in result.bindings[0].outputs)


# -- the generated data, input by input -----------------------------------------------------------


def test_generated_inputs(tmp_path: Path) -> None:
    table = np.zeros((300, 4), np.float32)
    model = _model(
        [
            helper.make_node("Gather", ["table", "input_ids"], ["y"]),
            helper.make_node("Gather", ["types", "token_type_ids"], ["z"]),
        ],
        [
            ("input_ids", INT64, ["batch", "sequence"]),
            ("token_type_ids", INT64, ["batch", "sequence"]),
            ("attention_mask", INT64, ["batch", "sequence"]),
            ("flags", TensorProto.BOOL, ["batch"]),
            ("pixels", TensorProto.FLOAT16, ["batch", 3]),
        ],
        [("y", FLOAT, None), ("z", FLOAT, None)],
        {"table": table, "types": table[:2]},
    )
    spec = read_spec(_save(tmp_path, "m", model))
    binding = bind_dims(spec, 0, {})
    feeds = make_inputs(spec, binding, np.random.default_rng(0))
    assert binding.dims == {"batch": 3, "sequence": 16}
    ids = feeds["input_ids"]
    assert ids.min() == 0 and ids.max() == 299 and len(np.unique(ids)) > 30
    assert set(np.unique(feeds["token_type_ids"])) == {0, 1}
    mask = feeds["attention_mask"]
    assert mask.dtype == np.int64
    assert mask[0].tolist() == [1] * 12 + [0] * 4 and mask[1].tolist() == [0] * 4 + [1] * 12 and mask[2].all()
    assert feeds["flags"].dtype == np.bool_ and feeds["pixels"].dtype == np.float16
    long = bind_dims(spec, 1, {})
    assert long.dims == {"batch": 1, "sequence": 128}
    assert long.regimes == ["long sequence 128", "full masks", "ids over the whole table", "floats at scale 10"]
    assert abs(make_inputs(spec, long, np.random.default_rng(0))["pixels"]).max() > 5


def _small_typed(model: onnx.ModelProto) -> bool:
    small = {getattr(TensorProto, name) for name in _SMALL_TYPES} | {TensorProto.FLOAT4E2M1}
    values = [*model.graph.input, *model.graph.output]
    return any(v.type.tensor_type.elem_type in small for v in values)


@pytest.mark.slow
def test_node_suite_models_with_small_types_are_checked_or_say_why(tmp_path: Path) -> None:
    # 110 of them ended in "internal error: AssertionError: no generator for bfloat16" (exit 3).
    path = tmp_path / "m.onnx"
    statuses: dict[str, list[str]] = {"passed": [], "not checked": [], "failed": []}
    for case in node_suite.cases():
        if not _small_typed(case.model):
            continue
        onnx.save(case.model, str(path))
        result = check_models(path, path)
        statuses[result.status].append(f"{case.name}: {result.reason}")
    print({status: len(names) for status, names in statuses.items()})
    assert not statuses["failed"], statuses["failed"][:5]
    assert len(statuses["passed"]) >= 60, statuses["not checked"][:10]
    # What stays unchecked is what onnxruntime cannot load or run, never a type the check lacks.
    assert not [r for r in statuses["not checked"] if "cannot generate" in r or "Numpy_type" in r]


def test_random_numbers_the_graph_cannot_show_are_caught_by_two_runs(tmp_path: Path) -> None:
    # A model-local function draws them: only two runs of the original can tell.
    noise = helper.make_function(
        "local",
        "Noise",
        ["x"],
        ["y"],
        [helper.make_node("RandomUniformLike", ["x"], ["y"])],
        [helper.make_opsetid("", 18)],
    )
    model = _model(
        [helper.make_node("Noise", ["x"], ["noisy"], domain="local"), helper.make_node("Relu", ["x"], ["clean"])],
        [("x", FLOAT, ["batch", 64])],
        [("noisy", FLOAT, None), ("clean", FLOAT, None)],
    )
    model.functions.append(noise)
    model.opset_import.append(helper.make_opsetid("local", 1))
    path = _save(tmp_path, "m", model)
    result = check_models(path, path)
    assert result.status == "passed", result.reason
    noisy, clean = result.bindings[0].outputs
    assert noisy.reason == "not checked: nondeterministic (the original model disagrees with itself)"
    assert clean.passed is True


def test_a_malformed_graph_is_onnxruntime_s_to_refuse_not_the_input_synthesis(tmp_path: Path) -> None:
    # A truncated stored tensor and a Transpose whose perm names axes x lacks: reading the
    # graph for the bindings must not crash on either (exit 3); onnxruntime refuses the model.
    truncated = onnx.TensorProto(name="axes", data_type=INT64, dims=[1], raw_data=b"abc")
    for nodes in (
        [helper.make_node("Unsqueeze", ["x", "axes"], ["y"])],
        [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 1, 2, 3])],
    ):
        model = _model(nodes, [("x", FLOAT, ["batch", 3])], [("y", FLOAT, None)])
        model.graph.initializer.append(truncated)
        path = _save(tmp_path, "m", model)
        result = check_models(path, path)
        assert result.status == "not checked", result.reason
        assert "onnxruntime cannot load the original model" in (result.reason or "")


def test_the_long_sequence_stops_at_the_limit_the_metadata_names(tmp_path: Path) -> None:
    model = _decoder()
    helper.set_model_props(model, {"max_position_embeddings": "64"})
    path = _save(tmp_path, "m", model)
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert [b.dims["total_sequence"] for b in result.bindings] == [24, 64, 64]
    assert result.bindings[1].regimes[0] == "long sequence 64: a cache of 63 + 1 new"


# -- sequence and optional inputs ----------------------------------------------------------------


def _sequence_model(position: bool = True) -> onnx.ModelProto:
    """The tensors of a sequence input, with an optional input's tensor inserted at ``position``
    (or, ``position`` False, appended), concatenated."""
    element = helper.make_tensor_type_proto(FLOAT, ["batch", 4])
    inputs = [
        helper.make_value_info("pieces", helper.make_sequence_type_proto(element)),
        helper.make_value_info("extra", helper.make_optional_type_proto(element)),
        helper.make_tensor_value_info("position", INT64, []),
    ]
    nodes = [
        helper.make_node("OptionalGetElement", ["extra"], ["inserted"]),
        helper.make_node("SequenceInsert", ["pieces", "inserted", "position" if position else ""], ["longer"]),
        helper.make_node("ConcatFromSequence", ["longer"], ["y"], axis=0),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_sequence_and_optional_inputs_are_generated_and_compared(tmp_path: Path) -> None:
    path = _save(tmp_path, "m", _sequence_model())
    spec = read_spec(path)
    feeds = make_inputs(spec, bind_dims(spec, 0, {}), np.random.default_rng(0))
    pieces = feeds["pieces"]
    assert isinstance(pieces, list) and len(pieces) == 3 and all(p.shape == (3, 4) for p in pieces)
    assert np.asarray(feeds["extra"]).shape == (3, 4) and feeds["position"].tolist() == 0
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    appended = _save(tmp_path, "b", _sequence_model(position=False))
    assert check_models(path, appended).status == "failed"


_SEQUENCE_CASES = [
    "test_identity_sequence",
    "test_identity_opt",
    "test_loop13_seq",
    "test_loop16_seq_none",
    "test_optional_get_element_optional_tensor",
    "test_optional_get_element_optional_sequence",
    "test_optional_get_element_sequence",
    "test_optional_has_element_tensor_input",
    "test_optional_has_element_optional_input",
    "test_optional_has_element_empty_optional_input",
    "test_sequence_map_identity_1_sequence",
    "test_sequence_map_identity_1_sequence_expanded",
    "test_sequence_map_identity_2_sequences",
    "test_sequence_map_identity_2_sequences_expanded",
    "test_sequence_map_identity_1_sequence_1_tensor",
    "test_sequence_map_identity_1_sequence_1_tensor_expanded",
    "test_sequence_map_add_2_sequences",
    "test_sequence_map_add_2_sequences_expanded",
    "test_sequence_map_add_1_sequence_1_tensor",
    "test_sequence_map_add_1_sequence_1_tensor_expanded",
    "test_sequence_map_extract_shapes",
    "test_sequence_map_extract_shapes_expanded",
    "test_sequence_insert_at_back",
    "test_sequence_insert_at_front",
]


def _node_case_statuses(tmp_path: Path, names: list[str]) -> dict[str, str]:
    """Each named node test checked against itself: "passed", or the reason it was not (and
    whether onnxruntime runs the original on the node test's own inputs)."""
    wanted = set(names)
    found: dict[str, str] = {}
    path = tmp_path / "m.onnx"
    for case in node_suite.cases():
        if case.name in wanted:
            onnx.save(case.model, str(path))
            result = check_models(path, path)
            found[case.name] = "passed" if result.status == "passed" else f"{result.status}: {result.reason}"
            if result.status == "not checked" and "failed at" in (result.reason or ""):
                loaded = node_suite.session(path)
                try:
                    loaded.run(None, node_suite.feeds(case, loaded)[0])
                except Exception:
                    found[case.name] += " (onnxruntime fails on the node test's own inputs too)"
    assert set(found) == wanted, wanted - set(found)
    return found


def _only_onnxruntime_limits(statuses: dict[str, str]) -> None:
    """Every case passed, or onnxruntime cannot run its original: it cannot load it (an op it
    does not implement), or fails on the node test's own inputs as well."""
    limits = ("onnxruntime cannot load the original", "onnxruntime fails on the node test's own inputs")
    wrong = {
        name: status
        for name, status in statuses.items()
        if status != "passed" and not any(limit in status for limit in limits)
    }
    assert not wrong, "\n".join(f"{name}: {status}" for name, status in wrong.items())


@pytest.mark.slow  # the whole node suite: 14 s of the default suite's work
def test_node_suite_models_with_sequence_or_optional_inputs_are_checked(tmp_path: Path) -> None:
    # All 24 were "not checked: ... has type seq(tensor(float)), which the check cannot generate".
    _only_onnxruntime_limits(_node_case_statuses(tmp_path, _SEQUENCE_CASES))


# Node tests whose graph inputs set lengths, sizes and indices that the op checks against other
# inputs: each was "not checked: the original model failed at all 6 bindings tried" (an
# AffineGrid size whose N is not theta's, a nonpad_kv_seqlen past the keys, a Col2Im
# image_shape no block count fits, a MaxUnpool index past the output, Resize sizes that scale the
# batch, split sizes that overrun an empty axis, a TensorScatter write past the cache), and
# AffineGrid's expanded function, whose size a Split inside an If takes apart into N, C and the grid.
_OPERAND_CASES = [
    *(f"test_affine_grid_{d}{a}{e}" for d in ("2d", "3d") for a in ("", "_align_corners") for e in ("", "_expanded")),
    "test_attention_4d_diff_heads_mask4d_padded_kv",
    "test_attention_4d_gqa_causal_nonpad_decode",
    "test_attention_4d_gqa_causal_nonpad_decode_fp16",
    "test_attention_4d_causal_nonpad_continued_prefill",
    "test_attention_4d_causal_nonpad_attn_mask_composition",
    "test_attention_4d_causal_nonpad_batch_prefill",
    "test_col2im",
    "test_col2im_strides",
    "test_col2im_pads",
    "test_col2im_dilations",
    "test_col2im_5d",
    "test_maxunpool_export_without_output_shape",
    "test_maxunpool_export_with_output_shape",
    "test_resize_upsample_sizes_cubic",
    "test_resize_downsample_sizes_cubic",
    "test_resize_downsample_sizes_linear_pytorch_half_pixel",
    "test_resize_downsample_sizes_linear_antialias",
    "test_resize_downsample_sizes_cubic_antialias",
    "test_split_zero_size_splits_opset13",
    "test_split_zero_size_splits_opset18",
    "test_tensorscatter",
    "test_tensorscatter_3d",
]


@pytest.mark.slow  # the node suite: 25 s of the default suite's work, 20 of them onnx generating its cases
def test_node_suite_operands_that_other_inputs_constrain_get_values_that_fit(tmp_path: Path) -> None:
    _only_onnxruntime_limits(_node_case_statuses(tmp_path, _OPERAND_CASES))


def test_the_ids_of_an_embed_layer_normalization_fall_in_its_tables(tmp_path: Path) -> None:
    """onnxruntime's fused embedding (com.microsoft EmbedLayerNormalization) reads input ids from
    its word table and segment ids from its segment table: ids past them fail the original."""
    rng = np.random.default_rng(0)
    hidden = 8
    inits = {
        "word": rng.standard_normal((50, hidden)).astype(np.float32),
        "position": rng.standard_normal((64, hidden)).astype(np.float32),
        "segment": rng.standard_normal((2, hidden)).astype(np.float32),
        "gamma": np.ones(hidden, np.float32),
        "beta": np.zeros(hidden, np.float32),
    }
    node = helper.make_node(
        "EmbedLayerNormalization",
        ["input_ids", "segment_ids", "word", "position", "segment", "gamma", "beta"],
        ["y", "mask_index"],
        domain="com.microsoft",
        epsilon=1e-5,
    )
    ids = [(name, TensorProto.INT32, ["batch", "sequence"]) for name in ("input_ids", "segment_ids")]
    outputs = [("y", TensorProto.FLOAT, None), ("mask_index", TensorProto.INT32, None)]
    path = _save(tmp_path, "m", _model([node], ids, outputs, inits, domains=("com.microsoft",)))
    result = check_models(path, path)
    assert result.status == "passed", result.reason


@pytest.mark.parametrize(
    ("batch", "new", "past", "rotary_rows"),
    [(2, 5, 0, None), (2, 1, 8, None), (1, 5, 8, None), (2, 1, 8, 9), (2, 1, 8, 8), (2, 5, 12, 12), (2, 5, 12, None)],
    ids=[
        "prompt",
        "decode",
        "prompt-after-past",
        "rotary-covers-all",
        "decode-into-buffer",
        "prompt-into-buffer",
        "batched-prompt-into-buffer",
    ],
)
def test_a_group_query_attention_gets_a_total_length_and_key_lengths_it_accepts(
    tmp_path: Path, batch: int, new: int, past: int, rotary_rows: int | None
) -> None:
    """onnxruntime's GroupQueryAttention (com.microsoft) takes total_sequence_length (past keys plus
    new ones, or within a buffer its rotary cache sizes) and seqlens_k (that total less one, per
    batch row): other values fail the original. Shapes as onnxruntime's test_gqa_cpu.py builds them."""
    heads, kv_heads, size = 4, 2, 16
    names = ["query", "key", "value", "past_key" if past else "", "past_value" if past else ""]
    names += ["seqlens_k", "total_sequence_length"] + (["cos", "sin"] if rotary_rows else [])
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        do_rotary=int(rotary_rows is not None),
    )
    inputs: list[tuple[str, int, Shape]] = [
        ("query", FLOAT, [batch, new, heads * size]),
        ("key", FLOAT, [batch, new, kv_heads * size]),
        ("value", FLOAT, [batch, new, kv_heads * size]),
        ("seqlens_k", TensorProto.INT32, [batch]),
        ("total_sequence_length", TensorProto.INT32, [1]),
    ]
    inputs += [(name, FLOAT, [batch, kv_heads, past, size]) for name in ("past_key", "past_value") if past]
    inputs += [(name, FLOAT, [rotary_rows, size // 2]) for name in ("cos", "sin") if rotary_rows]
    outputs = [(name, FLOAT, None) for name in ("output", "present_key", "present_value")]
    path = _save(tmp_path, "gqa", _model([node], inputs, outputs, domains=("com.microsoft",)))
    result = check_models(path, path)
    assert result.status == "passed", result.reason
