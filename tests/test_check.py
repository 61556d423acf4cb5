"""The numerics check: real onnxruntime runs of small models written to temporary files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.errors import InputError
from graphopt.numerics import CheckResult, check_models
from graphopt.numerics import compare as comparing
from graphopt.numerics.compare import Criterion, compare_output, projection_spread, relative_l2
from graphopt.numerics.inputs import read_spec
from graphopt.schemas import schema

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, int, list[int | str | None]]],
    outputs: list[tuple[str, int, list[int | str | None] | None]],
    initializers: dict[str, np.ndarray] | None = None,
    domains: tuple[str, ...] = (),
    opset: int = 17,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        [numpy_helper.from_array(a, n) for n, a in (initializers or {}).items()],
    )
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
    # onnxruntime 1.31 reads IR versions up to 13; onnx 1.23 would write 14.
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _save(tmp_path: Path, name: str, model: onnx.ModelProto) -> Path:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def _linear(weight: np.ndarray, bias: np.ndarray | None = None) -> onnx.ModelProto:
    """y[batch, n] = x[batch, k] @ weight (+ bias)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm" if bias is not None else "y"])]
    inits = {"w": weight}
    if bias is not None:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"]))
        inits["b"] = bias
    return _model(nodes, [("x", FLOAT, ["batch", weight.shape[0]])], [("y", FLOAT, ["batch", weight.shape[1]])], inits)


def _weight(seed: int = 0, shape: tuple[int, int] = (8, 4), scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _json(result: CheckResult) -> dict:
    data = result.as_dict()
    text = json.dumps(data, allow_nan=False)
    report = schema("report")
    jsonschema.validate(data, {"$schema": report["$schema"], "$defs": report["$defs"], "$ref": "#/$defs/numerics"})
    loaded: dict = json.loads(text)
    return loaded


def test_identical_models_pass(tmp_path: Path) -> None:
    a = _save(tmp_path, "a", _linear(_weight()))
    b = _save(tmp_path, "b", _linear(_weight()))
    result = check_models(a, b)
    assert result.status == "passed", result.reason
    assert len(result.bindings) == 3  # the two asked for, then the largest (batch 5)
    assert result.bindings[2].dims == {"batch": 5} and result.bindings[2].regimes[0] == "largest sizes"
    assert all(o.rel_l2 == 0.0 and o.cosine == pytest.approx(1.0) for bd in result.bindings for o in bd.outputs)


def test_changed_weight_fails_naming_the_output(tmp_path: Path) -> None:
    weight = _weight()
    changed = weight.copy()
    changed[3, 1] += 0.5
    result = check_models(_save(tmp_path, "a", _linear(weight)), _save(tmp_path, "b", _linear(changed)))
    assert result.status == "failed"
    assert result.reason is not None and "'y'" in result.reason and "rel L2" in result.reason
    assert not result.bindings[0].outputs[0].passed
    assert _json(result)["status"] == "failed"


def test_new_nan_fails_and_shared_nan_passes(tmp_path: Path) -> None:
    weight = _weight()
    bias = np.zeros(4, np.float32)
    nan_bias = bias.copy()
    nan_bias[2] = np.nan
    clean = _save(tmp_path, "clean", _linear(weight, bias))
    with_nan = _save(tmp_path, "nan", _linear(weight, nan_bias))
    result = check_models(clean, with_nan)
    assert result.status == "failed"
    assert result.reason is not None and "new NaN" in result.reason

    # The same NaN through a different graph (Add with its operands swapped) is a match.
    swapped = _linear(weight, nan_bias)
    swapped.graph.node[1].input[:] = ["b", "mm"]
    result = check_models(with_nan, _save(tmp_path, "swapped", swapped))
    assert result.status == "passed", result.reason
    assert all(np.isfinite(o.rel_l2) for bd in result.bindings for o in bd.outputs)

    # A NaN the optimized model lost is a change too.
    result = check_models(with_nan, clean)
    assert result.status == "failed" and "NaN in the original" in (result.reason or "")


def test_nonfinite_rules() -> None:
    crit = Criterion()
    a = np.array([1.0, np.inf, -np.inf, np.nan], np.float32)
    assert compare_output("y", a, a.copy(), crit).passed
    new_inf = np.array([1.0, np.inf, -np.inf, np.inf], np.float32)
    assert compare_output("y", new_inf, new_inf * np.array([np.inf, 1, 1, 1], np.float32), crit).reason.startswith(
        "new Inf"
    )
    flipped = np.array([1.0, -np.inf, -np.inf, np.nan], np.float32)
    assert "Inf in the original" in (compare_output("y", a, flipped, crit).reason or "")
    zeros = np.zeros(5, np.float32)
    same = compare_output("y", zeros, zeros, crit)
    assert same.passed and same.cosine == 1.0 and same.rel_l2 == 0.0
    assert not compare_output("y", zeros, zeros + 1e-3, crit).passed


def test_deep_net_noise_passes_rel_l2_where_allclose_fails(tmp_path: Path) -> None:
    # Large weights with a 1e-6 relative perturbation: the output moves by ~1e-6 of its norm,
    # but the many outputs that cancel to near zero move by far more than rtol 1e-5 of themselves.
    weight = _weight(1, (64, 64), scale=1000.0)
    noise = 1 + 1e-6 * np.random.default_rng(2).standard_normal(weight.shape)
    a = _save(tmp_path, "a", _linear(weight))
    b = _save(tmp_path, "b", _linear((weight * noise).astype(np.float32)))
    robust = check_models(a, b)
    assert robust.status == "passed", robust.reason
    assert all(o.rel_l2 < 1e-5 and o.max_rel > 1e-5 for bd in robust.bindings for o in bd.outputs)
    strict = check_models(a, b, rtol=1e-5)
    assert strict.status == "failed"
    assert strict.criterion["kind"] == "allclose" and strict.criterion["atol"] == 1e-8
    assert "exceed atol" in (strict.reason or "")


def _ids_model(offset: int, table_rows: int = 5) -> onnx.ModelProto:
    """Ids flattened, looked up in a small table, and the ids plus ``offset`` as an int output."""
    nodes = [
        helper.make_node("Reshape", ["ids", "flat"], ["ids_flat"]),
        helper.make_node("Gather", ["table", "ids_flat"], ["emb"]),
        helper.make_node("Add", ["ids", "offset"], ["shifted"]),
    ]
    inits = {
        "flat": np.array([-1], np.int64),
        "table": _weight(3, (table_rows, 4)),
        "offset": np.array(offset, np.int64),
    }
    return _model(
        nodes,
        [("ids", INT64, ["batch", "sequence"])],
        [("emb", FLOAT, None), ("shifted", INT64, ["batch", "sequence"])],
        inits,
    )


def test_integer_outputs_exact_and_ids_fit_the_table(tmp_path: Path) -> None:
    original = _save(tmp_path, "a", _ids_model(1))
    # Ids up to 99 would index past the 5-row table and onnxruntime would refuse every binding.
    same = check_models(original, _save(tmp_path, "b", _ids_model(1)))
    assert same.status == "passed", same.reason
    off_by_one = check_models(original, _save(tmp_path, "c", _ids_model(2)))
    assert off_by_one.status == "failed"
    shifted = off_by_one.bindings[0].outputs[1]
    assert shifted.name == "shifted" and shifted.max_abs == 1.0
    assert shifted.reason is not None and "values differ" in shifted.reason
    assert off_by_one.bindings[0].outputs[0].passed


def _two_input_model() -> onnx.ModelProto:
    """a[batch, seq] + b[batch, seq] (needs one binding for both), and c[height, width] summed."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["ab"]),
        helper.make_node("ReduceSum", ["c"], ["c_sum"], keepdims=0),
        helper.make_node("Add", ["ab", "c_sum"], ["y"]),
    ]
    return _model(
        nodes,
        [("a", FLOAT, ["batch", "seq"]), ("b", FLOAT, ["batch", "seq"]), ("c", FLOAT, ["height", "width"])],
        [("y", FLOAT, ["batch", "seq"])],
    )


def test_dynamic_dims_bound_by_name_at_two_bindings(tmp_path: Path) -> None:
    path = _save(tmp_path, "m", _two_input_model())
    result = check_models(path, path)
    assert result.status == "passed", result.reason
    assert [bd.dims for bd in result.bindings] == [
        {"batch": 3, "seq": 16, "height": 224, "width": 224},
        {"batch": 1, "seq": 128, "height": 192, "width": 320},
        {"batch": 5, "seq": 128, "height": 448, "width": 512},
    ]
    fixed = check_models(path, path, dims={"batch": 4})
    assert [bd.dims["batch"] for bd in fixed.bindings] == [4, 4, 4]
    assert fixed.bindings[0].dims["seq"] != fixed.bindings[1].dims["seq"]
    with pytest.raises(InputError, match="batchsize"):
        check_models(path, path, dims={"batchsize": 4})


def _reshape_by_3(hidden: bool) -> onnx.ModelProto:
    """Reshape to [-1, 3]: the dim must be a multiple of 3; ``hidden``: the target comes out of
    a Max, whose values the check does not follow."""
    nodes = [helper.make_node("Reshape", ["x", "target" if hidden else "shape"], ["y"])]
    if hidden:
        nodes.insert(0, helper.make_node("Max", ["shape", "shape"], ["target"]))
    return _model(nodes, [("x", FLOAT, ["items"])], [("y", FLOAT, [None, 3])], {"shape": np.array([-1, 3], np.int64)})


def test_binding_rejected_by_the_original_is_replaced(tmp_path: Path) -> None:
    # 16 fails, 24 runs, then the fallback 3 (the largest binding's 32 fails: a note).
    path = _save(tmp_path, "m", _reshape_by_3(hidden=True))
    result = check_models(path, path)
    assert result.status == "passed"
    assert [bd.dims for bd in result.bindings] == [{"items": 24}, {"items": 3}]
    assert result.reason is not None and "{items=16}" in result.reason
    assert "the original model failed: Reshape node" in result.reason
    assert "at the largest binding {items=32}" in result.reason


def test_the_factor_a_reshape_target_bakes_in_is_read(tmp_path: Path) -> None:
    # The same Reshape with its target stored: every binding a multiple of 3 (before: 16 failed).
    path = _save(tmp_path, "m", _reshape_by_3(hidden=False))
    result = check_models(path, path)
    assert result.status == "passed" and result.reason is None, result.reason
    assert [bd.dims for bd in result.bindings] == [{"items": 18}, {"items": 24}, {"items": 33}]


def test_two_names_for_one_dim_get_one_value(tmp_path: Path) -> None:
    # Distinct names get distinct values unless the graph shows them equal (the Add broadcasts them).
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [("a", FLOAT, ["batch", "seq"]), ("b", FLOAT, ["batch", "seq_mask"])],
        [("y", FLOAT, ["batch", "seq"])],
    )
    path = _save(tmp_path, "m", model)
    result = check_models(path, path)
    assert result.status == "passed", result.reason
    assert [bd.dims for bd in result.bindings] == [
        {"batch": 3, "seq": 16, "seq_mask": 16},
        {"batch": 1, "seq": 128, "seq_mask": 128},
        {"batch": 5, "seq": 128, "seq_mask": 128},
    ]
    assert result.reason is None


def test_unnamed_dims_share_a_value(tmp_path: Path) -> None:
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [("a", FLOAT, [None, 3]), ("b", FLOAT, [None, 3])],
        [("y", FLOAT, [None, 3])],
    )
    path = _save(tmp_path, "m", model)
    result = check_models(path, path)
    assert result.status == "passed", result.reason
    assert [bd.dims for bd in result.bindings] == [
        {"a[0]": 3, "b[0]": 3},
        {"a[0]": 1, "b[0]": 1},
        {"a[0]": 5, "b[0]": 5},
    ]


def test_npz_inputs_are_used_as_given(tmp_path: Path) -> None:
    path = _save(tmp_path, "m", _two_input_model())
    data = tmp_path / "inputs.npz"
    arrays = {"a": np.ones((2, 5), np.float32), "b": np.ones((2, 5), np.float32), "c": np.ones((7, 4), np.float32)}
    np.savez(data, **arrays)
    result = check_models(path, path, inputs=data)
    assert result.status == "passed", result.reason
    assert [bd.dims for bd in result.bindings] == [{"batch": 2, "seq": 5, "height": 7, "width": 4}]

    np.savez(data, a=arrays["a"], b=arrays["b"])
    with pytest.raises(InputError, match="missing c"):
        check_models(path, path, inputs=data)
    np.savez(data, **{**arrays, "c": np.ones((7, 4), np.float64)})
    with pytest.raises(InputError, match="float64"):
        check_models(path, path, inputs=data)


def test_model_onnxruntime_cannot_run_is_not_checked(tmp_path: Path) -> None:
    custom = _model(
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
        [("x", FLOAT, [2])],
        [("y", FLOAT, [2])],
        domains=("com.example",),
    )
    path = _save(tmp_path, "custom", custom)
    result = check_models(path, path)
    assert result.status == "not checked"
    assert result.reason is not None and "cannot load the original" in result.reason and "\n" not in result.reason
    assert _json(result)["status"] == "not checked"


def test_optimized_model_that_onnxruntime_rejects_fails(tmp_path: Path) -> None:
    original = _save(tmp_path, "a", _linear(_weight()))
    broken = _linear(_weight())
    broken.graph.node[0].input[1] = "w_missing"
    result = check_models(original, _save(tmp_path, "b", broken))
    assert result.status == "failed"
    assert result.reason is not None and "cannot load the optimized" in result.reason


def test_shape_dtype_and_input_mismatches_fail(tmp_path: Path) -> None:
    identity = _model([helper.make_node("Identity", ["x"], ["y"])], [("x", FLOAT, [2, 3])], [("y", FLOAT, None)])
    doubled = _model(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=1)], [("x", FLOAT, [2, 3])], [("y", FLOAT, None)]
    )
    as_double = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.DOUBLE)],
        [("x", FLOAT, [2, 3])],
        [("y", TensorProto.DOUBLE, None)],
    )
    renamed = _model([helper.make_node("Identity", ["z"], ["y"])], [("z", FLOAT, [2, 3])], [("y", FLOAT, None)])
    a = _save(tmp_path, "a", identity)
    shape = check_models(a, _save(tmp_path, "b", doubled))
    assert shape.status == "failed" and "shape (2, 3) != (2, 6)" in (shape.reason or "")
    assert _json(shape)["bindings"][0]["outputs"][0]["rel_l2"] == "nan"
    dtype = check_models(a, _save(tmp_path, "c", as_double))
    assert dtype.status == "failed" and "dtype float32 != float64" in (dtype.reason or "")
    inputs = check_models(a, _save(tmp_path, "d", renamed))
    assert inputs.status == "failed" and inputs.reason is not None and inputs.reason.startswith("inputs differ")
    assert inputs.bindings == []


def test_external_data_loads_from_beside_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inline = _save(tmp_path, "inline", _linear(_weight(), np.ones(4, np.float32)))
    folder = tmp_path / "external"
    folder.mkdir()
    external = folder / "model.onnx"
    onnx.save(
        _linear(_weight(), np.ones(4, np.float32)),
        str(external),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.data",
        size_threshold=0,
    )
    assert (folder / "model.data").is_file()
    monkeypatch.chdir(tmp_path)
    result = check_models(inline, external)
    assert result.status == "passed", result.reason


def test_timeout_is_not_checked(tmp_path: Path) -> None:
    path = _save(tmp_path, "m", _linear(_weight()))
    result = check_models(path, path, timeout=1e-9)
    assert result.status == "not checked"
    assert "timed out" in (result.reason or "")


def test_bert_small_against_itself(corpus_dir: Path) -> None:
    path = corpus_dir / "bert_small.onnx"
    started = time.perf_counter()
    result = check_models(path, path)
    seconds = time.perf_counter() - started
    assert result.status == "passed", result.reason
    assert len(result.bindings) == 2  # the largest (batch 5 at the 512 positions) would take over 0.5 s
    assert result.reason == (
        "the largest binding {batch=5, sequence=512} not run: "
        "the original's runs at the smaller ones predict over 0.5 s"
    )
    assert result.bindings[0].dims != result.bindings[1].dims
    assert {o.name for o in result.bindings[0].outputs} == {"last_hidden_state", "pooler_output"}
    assert seconds < 30, f"bert_small check took {seconds:.1f} s"


def test_optimized_model_that_froze_a_dynamic_dim_fails(tmp_path: Path) -> None:
    original = _save(tmp_path, "a", _linear(_weight()))
    frozen = _linear(_weight())
    frozen.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    result = check_models(original, _save(tmp_path, "b", frozen))
    assert result.status == "failed"
    assert result.reason is not None and "optimized model failed to run at {batch=3}" in result.reason
    assert result.bindings == []


def test_a_rewrite_that_confuses_two_dims_fails(tmp_path: Path) -> None:
    # The output is the size of dim `width`; the "optimized" model reads `height` instead.
    def size_of(axis: int) -> onnx.ModelProto:
        return _model(
            [helper.make_node("Shape", ["x"], ["y"], start=axis, end=axis + 1)],
            [("x", FLOAT, ["height", "width"])],
            [("y", INT64, [1])],
        )

    result = check_models(_save(tmp_path, "a", size_of(1)), _save(tmp_path, "b", size_of(0)))
    assert result.status == "failed"
    assert result.reason is not None and "values differ" in result.reason


def test_bert_small_fused_by_onnxruntime(corpus_dir: Path, tmp_path: Path) -> None:
    # onnxruntime's own fusions (LayerNorm, GELU, attention) as a stand-in optimizer: outputs
    # move by ~1e-6 relative L2, which passes, while element-wise rtol 1e-5 raises a false alarm.
    import onnxruntime as ort

    original = corpus_dir / "bert_small.onnx"
    fused = tmp_path / "bert_fused.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(fused)
    ort.InferenceSession(str(original), options, providers=["CPUExecutionProvider"])
    robust = check_models(original, fused)
    assert robust.status == "passed", robust.reason
    assert check_models(original, fused, atol=0.0, rtol=1e-5).status == "failed"


# -- tolerance by precision ----------------------------------------------------------------


def _typed_linear(weight: np.ndarray, elem_type: int) -> onnx.ModelProto:
    """y = Identity(x) @ weight, all in one element type."""
    nodes = [helper.make_node("Identity", ["x"], ["i"]), helper.make_node("MatMul", ["i", "w"], ["y"])]
    rows, cols = weight.shape
    return _model(nodes, [("x", elem_type, ["batch", rows])], [("y", elem_type, ["batch", cols])], {"w": weight})


def test_float16_rounding_noise_passes_at_float16_tolerance(tmp_path: Path) -> None:
    # One float16 ulp on 5% of the weights: the output moves by ~1.8e-4 relative L2, what
    # onnxruntime's own float16 accumulation does between runs, and over float32's 1e-4.
    weight = (np.random.default_rng(0).standard_normal((64, 32)) / 8).astype(np.float16)
    nudged = weight.copy()
    where = np.random.default_rng(1).random(weight.shape) < 0.05
    nudged[where] = np.nextafter(weight[where], np.float16(np.inf))
    result = check_models(
        _save(tmp_path, "a", _typed_linear(weight, TensorProto.FLOAT16)),
        _save(tmp_path, "b", _typed_linear(nudged, TensorProto.FLOAT16)),
    )
    assert result.status == "passed", result.reason
    outputs = [o for b in result.bindings for o in b.outputs]
    assert all(1e-4 < o.rel_l2 <= 2.5e-4 for o in outputs)
    assert all(o.precision == "float16" and o.limits and o.limits["rel_l2_max"] == 2.0**-11 for o in outputs)
    assert _json(result)["bindings"][0]["outputs"][0]["precision"] == "float16"


def test_float16_weights_cast_to_float32_keep_float32_tolerance(tmp_path: Path) -> None:
    weight = _weight().astype(np.float16)
    nodes = [helper.make_node("Cast", ["w16"], ["w"], to=FLOAT), helper.make_node("MatMul", ["x", "w"], ["y"])]
    model = _model(nodes, [("x", FLOAT, ["batch", 8])], [("y", FLOAT, ["batch", 4])], {"w16": weight})
    path = _save(tmp_path, "a", model)
    assert read_spec(path).paths["y"].precision == "float32"


@pytest.mark.parametrize(("elem_type", "error"), [(FLOAT, 1e-3), (TensorProto.FLOAT16, 1e-2)])
def test_a_real_error_still_fails(tmp_path: Path, elem_type: int, error: float) -> None:
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    weight = _weight(0, (64, 32), scale=1 / 8).astype(dtype)
    result = check_models(
        _save(tmp_path, "a", _typed_linear(weight, elem_type)),
        _save(tmp_path, "b", _typed_linear((weight * (1 + error)).astype(dtype), elem_type)),
    )
    assert result.status == "failed"
    assert "rel L2" in (result.reason or "") and "floor" in (result.reason or "")


def _detection_map(sigmoid_of_negated: bool) -> onnx.ModelProto:
    """A probability map ~1e-6 everywhere, as ppocr_v4_det's: Sigmoid of very negative logits,
    or the same through 1 - Sigmoid(-z), which rounds at 1 and moves every value by up to 1 eps."""
    nodes = [helper.make_node("Mul", ["x", "scale"], ["s"]), helper.make_node("Sub", ["s", "shift"], ["z"])]
    if sigmoid_of_negated:
        nodes += [
            helper.make_node("Neg", ["z"], ["nz"]),
            helper.make_node("Sigmoid", ["nz"], ["p"]),
            helper.make_node("Sub", ["one", "p"], ["y"]),
        ]
    else:
        nodes.append(helper.make_node("Sigmoid", ["z"], ["y"]))
    inits = {
        "scale": np.array(0.5, np.float32),
        "shift": np.array(14.0, np.float32),
        "one": np.array(1.0, np.float32),
    }
    return _model(nodes, [("x", FLOAT, ["batch", 64])], [("y", FLOAT, ["batch", 64])], inits)


def test_tiny_outputs_pass_within_the_absolute_floor(tmp_path: Path) -> None:
    result = check_models(_save(tmp_path, "a", _detection_map(False)), _save(tmp_path, "b", _detection_map(True)))
    assert result.status == "passed", result.reason
    outputs = result.bindings[0].outputs  # at unit scale: at scale 10 the map is no longer tiny
    assert all(o.rel_l2 > 1e-3 for o in outputs)  # the old criterion called this broken
    assert all(o.limits and o.max_abs <= o.limits["abs_floor"] == 4 * 2.0**-23 for o in outputs)
    # Doubling the map is a real change, floor or not.
    doubled = _detection_map(False)
    doubled.graph.node[-1].output[0] = "half"
    doubled.graph.node.append(helper.make_node("Add", ["half", "half"], ["y"]))
    assert check_models(tmp_path / "a.onnx", _save(tmp_path, "c", doubled)).status == "failed"


def test_p99_of_the_absolute_error_is_reported(tmp_path: Path) -> None:
    weight = _weight()
    changed = weight.copy()
    changed[3, 1] += 0.5
    result = _json(check_models(_save(tmp_path, "a", _linear(weight)), _save(tmp_path, "b", _linear(changed))))
    output = result["bindings"][0]["outputs"][0]
    assert 0 < output["p99_abs"] <= output["max_abs"]
    assert {"max_abs", "max_rel", "rel_l2", "cosine", "p99_abs"} <= set(output)


# -- nondeterministic models ---------------------------------------------------------------


def _dropout_model() -> onnx.ModelProto:
    """'noisy' is training-mode Dropout (new mask every run), 'clean' a Relu of the same input."""
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "training"], ["noisy"]),
        helper.make_node("Relu", ["x"], ["clean"]),
    ]
    inits = {"ratio": np.array(0.5, np.float32), "training": np.array(True)}
    return _model(nodes, [("x", FLOAT, ["batch", 64])], [("noisy", FLOAT, None), ("clean", FLOAT, None)], inits)


def test_nondeterministic_outputs_are_not_checked_the_rest_is(tmp_path: Path) -> None:
    path = _save(tmp_path, "a", _dropout_model())
    result = check_models(path, path)
    assert result.status == "passed", result.reason
    assert "output 'noisy' not checked: nondeterministic (op Dropout)" in (result.reason or "")
    for binding in _json(result)["bindings"]:
        noisy, clean = binding["outputs"]
        assert noisy["passed"] is None and "nondeterministic" in noisy["reason"]
        assert clean["passed"] is True
    broken = _dropout_model()
    broken.graph.node[1].op_type = "Abs"
    assert check_models(path, _save(tmp_path, "b", broken)).status == "failed"


def test_a_model_that_is_only_random_is_not_checked(tmp_path: Path) -> None:
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["r"]), helper.make_node("Add", ["x", "r"], ["y"])]
    path = _save(tmp_path, "a", _model(nodes, [("x", FLOAT, ["batch", 8])], [("y", FLOAT, None)]))
    result = check_models(path, path)
    assert result.status == "not checked"
    assert "nondeterministic (op RandomNormalLike)" in (result.reason or "")


# -- the same through the command line -----------------------------------------------------


def test_cli_never_exits_1_for_a_nondeterministic_model(tmp_path: Path) -> None:
    from tests.cli_helpers import invoke

    source = _save(tmp_path, "dropout", _dropout_model())
    run = invoke("run", source, "-o", tmp_path / "out.onnx", "--json")
    assert run.exit_code == 0, run.stderr
    numerics = json.loads(run.stdout)["numerics"]
    assert numerics["status"] == "passed"
    assert "output 'noisy' not checked: nondeterministic (op Dropout)" in numerics["reason"]
    assert "output noisy: not checked: nondeterministic" in " ".join(run.stderr.split())
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["y"])]
    random_only = _save(tmp_path, "random", _model(nodes, [("x", FLOAT, ["batch", 8])], [("y", FLOAT, None)]))
    check = invoke("check", random_only, random_only)
    assert check.exit_code == 0
    assert "graphopt: warning:" in check.stderr and "nondeterministic (op RandomUniformLike)" in check.stderr


def test_cli_check_tolerance_follows_precision(tmp_path: Path) -> None:
    from tests.cli_helpers import invoke

    weight = (np.random.default_rng(0).standard_normal((64, 32)) / 8).astype(np.float16)
    nudged = weight.copy()
    where = np.random.default_rng(1).random(weight.shape) < 0.05
    nudged[where] = np.nextafter(weight[where], np.float16(np.inf))
    half = _save(tmp_path, "half", _typed_linear(weight, TensorProto.FLOAT16))
    assert (
        invoke("check", half, _save(tmp_path, "half_nudged", _typed_linear(nudged, TensorProto.FLOAT16))).exit_code == 0
    )
    detection = _save(tmp_path, "map", _detection_map(False))
    assert invoke("check", detection, _save(tmp_path, "map_reordered", _detection_map(True))).exit_code == 0
    single = _save(tmp_path, "single", _typed_linear(_weight(0, (64, 32)), FLOAT))
    off = _save(tmp_path, "off", _typed_linear(_weight(0, (64, 32)) * np.float32(1.001), FLOAT))
    result = invoke("check", single, off)
    assert result.exit_code == 1 and "numerics failed" in result.stderr


def _relative_l2_in_float64(a: np.ndarray, b: np.ndarray) -> float:
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    finite = np.isfinite(x) & np.isfinite(y)
    x, y = x[finite], y[finite]
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


@pytest.mark.parametrize(
    ("dtype", "magnitude"),
    [(np.float32, 1e-30), (np.float32, 1.0), (np.float32, 1e30)] + [(np.float16, m) for m in (1e-3, 1.0, 1e3)],
)
def test_relative_l2_is_the_float64_distance(dtype: type, magnitude: float) -> None:
    rng = np.random.default_rng(5)
    a = (magnitude * rng.standard_normal(4096)).astype(dtype)
    b = (a * (1 + 1e-3 * rng.standard_normal(4096))).astype(dtype)
    assert comparing._relative_l2_in_float32(a, b) is not None  # the float32 path, not the float64 one
    assert relative_l2(a, b) == pytest.approx(_relative_l2_in_float64(a, b), rel=1e-6)


def test_relative_l2_leaves_out_what_is_not_finite_and_a_difference_beyond_float32() -> None:
    a = np.array([1.0, np.nan, 2.0, np.inf, 3.0], np.float32)
    b = np.array([1.5, np.nan, 2.0, 1.0, 3.0], np.float32)
    assert relative_l2(a, b) == pytest.approx(_relative_l2_in_float64(a, b), rel=1e-12)
    huge = np.array([3e38, -3e38, 1.0], np.float32)
    assert relative_l2(huge, -huge) == pytest.approx(2.0, rel=1e-12)
    assert relative_l2(np.zeros(3, np.float32), np.zeros(3, np.float32)) == 0.0


@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30])
def test_projection_spread_is_the_float64_figure(magnitude: float) -> None:
    rng = np.random.default_rng(6)
    truth = (magnitude * rng.standard_normal(4096)).astype(np.float32)
    before = (truth * (1 + 1e-2 * rng.standard_normal(4096))).astype(np.float32)
    after = (before * (1 + 1e-3 * rng.standard_normal(4096))).astype(np.float32)
    t, a, b = (x.astype(np.float64) / magnitude for x in (truth, before, after))
    expected = np.linalg.norm((a - t) * (b - a)) / (np.linalg.norm(a - t) * np.linalg.norm(t))
    assert comparing._projection_spread_in_float32(truth, before, after) is not None
    assert projection_spread(truth, before, after) == pytest.approx(expected, rel=1e-5)
    with_nan = truth.copy()
    with_nan[0] = np.nan
    keep = slice(1, None)
    assert projection_spread(with_nan, before, after) == pytest.approx(
        projection_spread(truth[keep], before[keep], after[keep]), rel=1e-6
    )


def test_a_float32_output_is_judged_by_the_figures_of_its_float64_values() -> None:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((6, 500)).astype(np.float32)
    a[0, :3] = 0.0  # max_rel is as large as the type holds there, on both paths
    b = (a + 3e-4 * rng.standard_normal(a.shape)).astype(np.float32)
    fast = compare_output("y", a, b, Criterion(), "float32")
    general = compare_output("y", a.astype(np.float64), b.astype(np.float64), Criterion(), "float32")
    for figure in ("rel_l2", "cosine", "max_abs", "p99_abs"):
        assert getattr(fast, figure) == pytest.approx(getattr(general, figure), rel=1e-6), figure
    assert fast.max_rel > 1e30 and general.max_rel > 1e30
    assert fast.passed is general.passed is False and fast.reason == general.reason


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]),  # an all-zero output: the float64 path
        ([1.0, 2.0, 3.0], [1.0, np.nan, 3.0]),  # a new NaN
        ([1.0, 2.0, 3.0], [1.0, 2.0, np.inf]),  # a new Inf
        ([3e38, 1.0, 1.0], [-3e38, 1.0, 1.0]),  # a difference beyond float32
        ([2.0**-22 + 2.0**-45, 1e-9], [-(2.0**-22), 1e-9]),  # max abs above the floor by less than float32 rounds
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_float_output_gets_the_float64_paths_verdict(a: list[float], b: list[float], dtype: type) -> None:
    with np.errstate(over="ignore"):
        x, y = np.array(a, dtype), np.array(b, dtype)
    precision = np.dtype(dtype).name  # the limits the float16 output gets, given to its float64 copy too
    fast = compare_output("y", x, y, Criterion(), precision)
    general = compare_output("y", x.astype(np.float64), y.astype(np.float64), Criterion(), precision)
    assert (fast.passed, fast.reason) == (general.passed, general.reason)
    assert fast.max_abs == general.max_abs
