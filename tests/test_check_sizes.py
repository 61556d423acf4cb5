"""The check's sizes: what a model's first ops need (lengths.py), the largest binding, custom ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphopt
from graphopt.numerics import check as check_module
from graphopt.numerics import check_models
from tests.cli_helpers import diagnostics, error_lines, invoke, one_line_error
from tests.test_check import _model, _save

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def _weight(*shape: int) -> np.ndarray:
    return (np.random.default_rng(sum(shape)).standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


# -- the smallest sizes the first ops take -------------------------------------------------------


def _vad(samples: str | None = "samples") -> onnx.ModelProto:
    """A voice-activity detector: audio [batch, samples], a state [2, batch, 128] and a sample
    rate; the audio padded by reflection (64 each side), then framed by a Conv of 512 samples
    every 128: it needs 384 samples at least."""
    nodes = [
        helper.make_node("Unsqueeze", ["input", "one"], ["audio"]),
        helper.make_node("Pad", ["audio", "pads"], ["padded"], mode="reflect"),
        helper.make_node("Conv", ["padded", "frames"], ["spectrum"], strides=[128]),
        helper.make_node("Abs", ["spectrum"], ["magnitude"]),
        helper.make_node("ReduceMean", ["magnitude", "time"], ["features"], keepdims=0),
        helper.make_node("MatMul", ["features", "w1"], ["hidden"]),
        helper.make_node("Gather", ["state", "zero"], ["previous"], axis=0),
        helper.make_node("Add", ["hidden", "previous"], ["mixed"]),
        helper.make_node("Tanh", ["mixed"], ["h"]),
        helper.make_node("Unsqueeze", ["h", "first"], ["h3"]),
        helper.make_node("Concat", ["h3", "h3"], ["stateN"], axis=0),
        helper.make_node("MatMul", ["h", "w2"], ["logit"]),
        helper.make_node("Cast", ["sr"], ["rate"], to=FLOAT),
        helper.make_node("Mul", ["rate", "tiny"], ["bias"]),
        helper.make_node("Add", ["logit", "bias"], ["score"]),
        helper.make_node("Sigmoid", ["score"], ["output"]),
    ]
    inits = {
        "one": np.array([1]),
        "first": np.array([0]),
        "time": np.array([2]),
        "zero": np.array(0),
        "pads": np.array([0, 0, 64, 0, 0, 64]),
        "frames": _weight(258, 1, 512),
        "w1": _weight(258, 128),
        "w2": _weight(128, 1),
        "tiny": np.array(1e-4, np.float32),
    }
    inputs = [("input", FLOAT, ["batch", samples]), ("state", FLOAT, [2, "batch", 128]), ("sr", INT64, [])]
    outputs: list[tuple[str, int, list[int | str | None] | None]] = [
        ("output", FLOAT, ["batch", 1]),
        ("stateN", FLOAT, [2, "batch", 128]),
    ]
    return _model(nodes, inputs, outputs, inits, opset=18)


def test_an_audio_model_with_a_reflect_pad_of_64_is_checked_without_options(tmp_path: Path) -> None:
    # Before: "not checked: the original model failed at all 6 bindings tried: Pad node: Pad
    # reflect: pre-pad (64) exceeds maximum allowed (15)".
    path = _save(tmp_path, "vad", _vad())
    result = invoke("check", path, path)
    assert result.exit_code == 0, result.stderr
    assert diagnostics(result)[0].startswith("numerics: passed"), result.stderr
    checked = check_models(path, path)
    assert [b.dims["samples"] for b in checked.bindings] == [399, 511, 511]  # 384 + 16 - 1, 384 + 128 - 1
    assert checked.attempts == [] and checked.reason is None


def test_an_unnamed_samples_dim_gets_its_smallest_size_too(tmp_path: Path) -> None:
    path = _save(tmp_path, "vad", _vad(samples=None))
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert all(b.dims["input[1]"] >= 384 for b in result.bindings)


def test_a_frame_slice_sets_the_smallest_length(tmp_path: Path) -> None:
    # An STFT-style front end that cuts a frame of 400 samples and projects it: below 400 the
    # MatMul refuses (before: all 6 bindings failed).
    nodes = [
        helper.make_node("Slice", ["audio", "start", "end", "axis"], ["frame"]),
        helper.make_node("MatMul", ["frame", "w"], ["y"]),
    ]
    inits = {"start": np.array([0]), "end": np.array([400]), "axis": np.array([1]), "w": _weight(400, 8)}
    path = _save(tmp_path, "m", _model(nodes, [("audio", FLOAT, ["batch", "time"])], [("y", FLOAT, None)], inits))
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert [b.dims["time"] for b in result.bindings] == [415, 527, 527]


def test_an_stft_takes_one_frame_at_least(tmp_path: Path) -> None:
    # Frames of 400 (the window's length) every 160 samples (before: all 6 bindings failed,
    # "STFT node: Ensure that the dft size is smaller than the signal").
    nodes = [
        helper.make_node("Unsqueeze", ["audio", "last"], ["signal"]),
        helper.make_node("STFT", ["signal", "step", "window"], ["spectrum"], onesided=1),
    ]
    inits = {"last": np.array([-1]), "step": np.array(160), "window": np.hanning(400).astype(np.float32)}
    model = _model(nodes, [("audio", FLOAT, ["batch", "samples"])], [("spectrum", FLOAT, None)], inits)
    path = _save(tmp_path, "m", model)
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert [b.dims["samples"] for b in result.bindings] == [415, 527, 527]


def _decoder() -> onnx.ModelProto:
    """A decoder whose exporter traced it at 7 tokens and baked 4 heads of 16 and the 7 into a
    Reshape target: it runs where batch x sequence is a multiple of 7."""
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["embedded"]),
        helper.make_node("MatMul", ["embedded", "wq"], ["q"]),
        helper.make_node("Reshape", ["q", "heads"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q4", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "q4"], ["context"]),
        helper.make_node("Reshape", ["context", "flat"], ["logits"]),
    ]
    inits = {
        "embedding": _weight(50, 64),
        "wq": _weight(64, 64),
        "heads": np.array([-1, 4, 7, 16]),
        "flat": np.array([-1, 64]),
    }
    return _model(nodes, [("input_ids", INT64, ["batch", "sequence"])], [("logits", FLOAT, None)], inits)


def test_a_head_count_baked_into_a_reshape_target_sets_the_sequence_lengths(tmp_path: Path) -> None:
    # Before: "not checked: the original model failed at all 6 bindings tried: Reshape node: The
    # input tensor cannot be reshaped to the requested shape".
    path = _save(tmp_path, "decoder", _decoder())
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert [b.dims for b in result.bindings] == [
        {"batch": 3, "sequence": 21},
        {"batch": 1, "sequence": 133},
        {"batch": 5, "sequence": 133},
    ]


def test_a_reshape_target_built_from_the_input_shape_is_read(tmp_path: Path) -> None:
    # Reshape to [batch, sequence * 2, -1] with 24 features: what Shape gives cancels, 2 does
    # not (24 / 2 is whole): nothing asked. [batch, 5, -1]: sequence x 24 a multiple of 5.
    def model(middle: list[str]) -> onnx.ModelProto:
        nodes = [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero"], ["batch"]),
            helper.make_node("Unsqueeze", ["batch", "axis"], ["batch1"]),
            helper.make_node("Concat", ["batch1", *middle, "minus_one"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ]
        inits = {"zero": np.array(0), "axis": np.array([0]), "minus_one": np.array([-1]), "five": np.array([5])}
        inits["two"] = np.array([2])
        return _model(nodes, [("x", FLOAT, ["batch", "sequence", 24])], [("y", FLOAT, None)], inits)

    five = check_models(path := _save(tmp_path, "five", model(["five"])), path)
    assert five.status == "passed" and five.reason is None, five.reason
    assert [b.dims["sequence"] for b in five.bindings] == [20, 130, 130]
    two = check_models(path := _save(tmp_path, "two", model(["two"])), path)
    assert [b.dims["sequence"] for b in two.bindings] == [16, 128, 128]


def test_a_reshape_target_given_as_constant_ints_is_read(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Constant", [], ["target"], value_ints=[-1, 7]),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    path = _save(tmp_path, "m", _model(nodes, [("x", FLOAT, ["batch", "items"])], [("y", FLOAT, None)], {}))
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert [b.dims["items"] for b in result.bindings] == [21, 28, 35]  # 16, 24 and 32 rounded up to 7s


# -- the largest binding ----------------------------------------------------------------------


def _positions(wrong_from: int | None = None) -> onnx.ModelProto:
    """Token embeddings plus positions 0..n-1 read from a 2,048-row table; ``wrong_from``: the
    table's rows from there on moved (a mutant only those positions show)."""
    table = np.random.default_rng(1).standard_normal((2048, 16)).astype(np.float32)
    if wrong_from is not None:
        table[wrong_from:] += 0.5
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["n"]),
        helper.make_node("Range", ["zero", "n", "one"], ["positions"]),
        helper.make_node("Gather", ["words", "input_ids"], ["tokens"]),
        helper.make_node("Gather", ["table", "positions"], ["placed"]),
        helper.make_node("Add", ["tokens", "placed"], ["hidden"]),
    ]
    inits = {"one": np.array(1), "zero": np.array(0), "words": _weight(100, 16), "table": table}
    inputs: list[tuple[str, int, list[int | str | None]]] = [("input_ids", INT64, ["batch", "sequence"])]
    return _model(nodes, inputs, [("hidden", FLOAT, ["batch", "sequence", 16])], inits)


def test_a_position_table_wrong_past_row_600_is_caught_at_the_largest_binding(tmp_path: Path) -> None:
    # Before: "passed" (the long sequence stops at 128).
    original = _save(tmp_path, "a", _positions())
    mutant = _save(tmp_path, "b", _positions(wrong_from=600))
    result = invoke("check", original, mutant)
    assert result.exit_code == 1
    (line,) = error_lines(result)
    assert "numerics failed: output 'hidden' at {batch=5, sequence=2048} (largest sizes, long sequence 2048" in line
    same = check_models(original, original)
    assert same.status == "passed" and same.reason is None, same.reason
    assert same.bindings[2].dims == {"batch": 5, "sequence": 2048}


def _wrong_above(threshold: int, axis: int, image: bool) -> onnx.ModelProto:
    """y = f(x) + 1 where ``x``'s dim ``axis`` is over ``threshold`` (a mutant wrong only past
    a size); ``image``: x[batch, 3, height, width] through a Conv, else x[batch, 4]."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "axis"], ["size"]),
        helper.make_node("Greater", ["size", "threshold"], ["over"]),
        helper.make_node("Cast", ["over"], ["shift"], to=FLOAT),
        helper.make_node("Conv" if image else "Relu", ["x", "kernel"] if image else ["x"], ["f"]),
        helper.make_node("Add", ["f", "shift"], ["y"]),
    ]
    inits = {"axis": np.array(axis), "threshold": np.array(threshold)}
    if image:
        inits["kernel"] = _weight(2, 3, 3, 3)
    shape: list[int | str | None] = ["batch", 3, "height", "width"] if image else ["batch", 4]
    return _model(nodes, [("x", FLOAT, shape)], [("y", FLOAT, None)], inits)


@pytest.mark.parametrize(
    ("axis", "threshold", "image", "where"),
    [
        (0, 4, False, "{batch=5} (largest sizes"),  # batches above 4
        (3, 400, True, "{batch=5, height=448, width=512} (largest sizes, images 448 x 512"),  # crops above 400 px
    ],
)
def test_a_mutant_wrong_only_past_the_first_two_bindings_sizes_is_caught(
    tmp_path: Path, axis: int, threshold: int, image: bool, where: str
) -> None:
    # Before: "passed" (batches of 3 and 1, images up to 320 px).
    original = _save(tmp_path, "a", _wrong_above(10**6, axis, image))
    result = check_models(original, _save(tmp_path, "b", _wrong_above(threshold, axis, image)))
    assert result.status == "failed" and result.reason is not None
    assert result.reason.startswith(f"output 'y' at {where}"), result.reason
    assert [b.passed for b in result.bindings] == [True, True, False]


def test_the_largest_binding_is_skipped_with_a_note_when_it_would_take_too_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check_module, "LARGEST_SECONDS", 1e-9)
    original = _save(tmp_path, "a", _positions())
    result = check_models(original, _save(tmp_path, "b", _positions(wrong_from=600)))
    assert result.status == "passed" and len(result.bindings) == 2
    assert result.reason is not None
    assert result.reason == (
        "the largest binding {batch=5, sequence=2048} not run: "
        "the original's runs at the smaller ones predict over 1e-09 s"
    )


def test_a_run_at_the_largest_binding_past_its_stop_is_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check_module, "LARGEST_STOP_SECONDS", 0.0)
    path = _save(tmp_path, "a", _positions())
    result = check_models(path, path)
    assert result.status == "passed" and len(result.bindings) == 2
    assert result.reason == "the original model timed out at the largest binding {batch=5, sequence=2048}"


def test_no_largest_binding_where_the_dims_are_all_fixed(tmp_path: Path) -> None:
    path = _save(tmp_path, "a", _positions())
    fixed = check_models(path, path, dims={"batch": 2, "sequence": 4})
    assert fixed.status == "passed" and fixed.reason is None, fixed.reason
    assert [b.dims for b in fixed.bindings] == [{"batch": 2, "sequence": 4}] * 2


# -- custom ops -------------------------------------------------------------------------------


def _custom_op_model() -> onnx.ModelProto:
    """x -> NegPos (onnxruntime-extensions' ai.onnx.contrib op: the negative and positive parts)."""
    nodes = [helper.make_node("NegPos", ["x"], ["negative", "positive"], domain="ai.onnx.contrib")]
    outputs: list[tuple[str, int, list[int | str | None] | None]] = [
        ("negative", FLOAT, ["batch", 4]),
        ("positive", FLOAT, ["batch", 4]),
    ]
    return _model(nodes, [("x", FLOAT, ["batch", 4])], outputs, {}, domains=("ai.onnx.contrib",))


def test_a_custom_op_model_is_checked_with_its_library_and_not_checked_without(tmp_path: Path) -> None:
    extensions = pytest.importorskip("onnxruntime_extensions")
    library = extensions.get_library_path()
    path = _save(tmp_path, "m", _custom_op_model())
    without = invoke("check", path, path)
    assert without.exit_code == 0
    assert (
        without.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "is not a registered function/op; register the library of its ai.onnx.contrib ops with "
            "--custom-op-library PATH"
        )
    ), without.stderr
    required = invoke("run", path, "-o", tmp_path / "out.onnx", "--require-check")
    assert required.exit_code == 1 and "--custom-op-library PATH" in required.stderr
    assert not (tmp_path / "out.onnx").exists()
    checked = invoke("check", path, path, "--custom-op-library", library)
    assert checked.exit_code == 0 and diagnostics(checked)[0].startswith("numerics: passed"), checked.stderr
    written = invoke("run", path, "-o", tmp_path / "out.onnx", "--require-check", "--custom-op-library", library)
    assert written.exit_code == 0, written.stderr
    assert (tmp_path / "out.onnx").exists()
    assert graphopt.check(path, path, custom_op_libraries=[library]).status == "passed"


def test_a_file_that_is_no_custom_op_library_is_bad_input(tmp_path: Path) -> None:
    path = _save(tmp_path, "m", _custom_op_model())
    fake = tmp_path / "libfake.so"
    fake.write_text("not a library")
    line = one_line_error(invoke("check", path, path, "--custom-op-library", fake))
    assert line.startswith(f"graphopt: error: --custom-op-library {fake}: onnxruntime cannot register it: ")


# -- what a "not checked" line says to do -----------------------------------------------------


def test_not_checked_names_the_unnamed_dim_to_give(tmp_path: Path) -> None:
    # A Reshape whose target the check cannot read (it comes out of a Max): no binding runs;
    # the line names the dim that decides, the unnamed one before the batch.
    nodes = [
        helper.make_node("Max", ["target", "target"], ["shape"]),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = {"target": np.array([-1, 4, 7])}
    path = _save(tmp_path, "m", _model(nodes, [("x", FLOAT, ["batch", None, 4])], [("y", FLOAT, None)], inits))
    result = check_models(path, path)
    assert result.status == "not checked"
    assert result.reason is not None
    assert result.reason.endswith(
        "; bind the dims with --dim 'x[1]=N' --dim batch=N or give inputs with --inputs data.npz"
    )
