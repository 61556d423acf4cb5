"""Bad input through the command line: exit 2, one line on stderr, no traceback, nothing written.

Each builder in builders.BAD_INPUTS is a way users really break a model (a truncated
download, a PNG with the wrong extension, an op at an opset where it does not exist, a
hand-edited JSON graph). The valid-but-unusual models (custom ops, zero-sized tensors,
NaN weights, dims too large to feed) must optimize instead, without allocating what they
declare.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import Result

from tests.cli_helpers import diagnostics, invoke
from tests.reliability import builders

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path below ``folder`` with its content: what "nothing was written" compares."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def assert_one_line_error(result: Result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stderr, result.exception)
    lines = diagnostics(result)
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    assert "Traceback" not in result.stderr and not result.stdout
    return lines[0]


# `{}` has no graphopt format marker: `run` skips it with a note, as any JSON that is not a
# graphopt graph (a config.json), named or found in a folder (tests/test_cli_logs.py).
RUN_REJECTS = sorted(set(builders.BAD_INPUTS) - {"json: empty object"})


@pytest.mark.parametrize("case", RUN_REJECTS)
def test_run_rejects_bad_input_and_writes_nothing(tmp_path: Path, case: str) -> None:
    source = builders.BAD_INPUTS[case](tmp_path)
    before = snapshot(tmp_path)
    result = invoke("run", source, "-o", tmp_path / "out" / "model.opt.onnx", "--report", tmp_path / "report.json")
    line = assert_one_line_error(result)
    assert source.name in line  # names the file
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case", RUN_REJECTS)
def test_check_optimized_rejects_bad_input(tmp_path: Path, case: str) -> None:
    source = builders.BAD_INPUTS[case](tmp_path)
    before = snapshot(tmp_path)
    assert_one_line_error(invoke("run", source, "--check-optimized"))
    assert snapshot(tmp_path) == before


SPOT_CHECKS = [
    "truncated protobuf",
    "png named .onnx",
    "directory named .onnx",
    "missing external data",
    "opset 99",
    "cycle",
    "node reads its own output",
    "external data is a symlink",
    "external data length disagrees with the shape",
    "node name not UTF-8",
    "duplicate node outputs",
    "declared dim of 2**62",
    "json: node without op",
    "json: unparsable type",
]


@pytest.mark.parametrize("case", SPOT_CHECKS)
def test_inspect_convert_validate_reject_bad_input(tmp_path: Path, case: str) -> None:
    source = builders.BAD_INPUTS[case](tmp_path)
    before = snapshot(tmp_path)
    assert_one_line_error(invoke("inspect", source))
    assert_one_line_error(invoke("inspect", source, "--json"))
    assert_one_line_error(invoke("convert", source, tmp_path / "converted.json"))
    assert_one_line_error(invoke("convert", source, tmp_path / "converted.onnx"))
    assert_one_line_error(invoke("validate", source))
    assert snapshot(tmp_path) == before


def test_batch_run_reports_each_bad_model_and_writes_only_good_ones(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    for i, case in enumerate(["truncated protobuf", "cycle", "opset 99", "json: unknown key"]):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        built = builders.BAD_INPUTS[case](folder)
        built.rename(models / f"bad{i}{built.suffix}")
    builders.write(builders.base_model(), models, "good.onnx")
    out = tmp_path / "out"
    result = invoke("run", models, "-o", out, "--json", "-q")
    assert result.exit_code == 2
    rows = json.loads(result.stdout)["models"]
    assert sorted(row.get("exit_code", 0) for row in rows) == [0, 2, 2, 2, 2]
    assert sorted(p.name for p in out.iterdir()) == ["good.onnx"]


# -- valid but unusual: optimize, exit 0 ---------------------------------------------------


def run_json(tmp_path: Path, proto: onnx.ModelProto) -> tuple[dict, onnx.ModelProto]:
    source = builders.write(proto, tmp_path)
    out = tmp_path / "out.onnx"
    result = invoke("run", source, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), onnx.load(str(out))


@pytest.mark.parametrize("make", [builders.custom_domain_op, builders.custom_default_domain_op])
def test_custom_ops_survive_and_the_rest_is_optimized(tmp_path: Path, make: object) -> None:
    original = make()  # type: ignore[operator]
    report, optimized = run_json(tmp_path, original)
    custom = [n for n in optimized.graph.node if n.op_type in ("Mystery", "MyLegacyOp")]
    assert len(custom) == 1
    (before,) = [n for n in original.graph.node if n.op_type == custom[0].op_type]
    assert custom[0].domain == before.domain and list(custom[0].attribute) == list(before.attribute)
    assert [o.name for o in optimized.graph.output] == ["z"]
    ops = [n.op_type for n in optimized.graph.node]
    assert "Identity" not in ops and ops.count("Relu") == 1  # noop and cse still ran around it
    assert report["numerics"]["status"] == "not checked"
    assert "onnxruntime cannot load" in report["numerics"]["reason"]
    assert report["failures"] == []


def test_zero_sized_tensors_optimize_and_check(tmp_path: Path) -> None:
    report, optimized = run_json(tmp_path, builders.zero_sized())
    assert report["numerics"]["status"] == "passed"
    assert "Identity" not in [n.op_type for n in optimized.graph.node]
    assert report["failures"] == []


def test_nan_and_inf_weights_optimize_and_compare_nan_aware(tmp_path: Path) -> None:
    report, optimized = run_json(tmp_path, builders.nan_inf_weights())
    assert report["numerics"]["status"] == "passed"
    assert len(optimized.graph.node) < len(builders.nan_inf_weights().graph.node)
    weight = onnx.numpy_helper.to_array(next(i for i in optimized.graph.initializer if i.name == "w"))
    assert weight[0, 0] != weight[0, 0] and weight[1, 1] == float("inf")


@pytest.mark.parametrize(
    "make", [builders.huge_valid_dim, builders.huge_reshape, builders.huge_constant_of_shape], ids=lambda f: f.__name__
)
def test_huge_shapes_do_not_allocate(tmp_path: Path, make: object) -> None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    report, _ = run_json(tmp_path, make())  # type: ignore[operator]
    assert time.perf_counter() - started < 30
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown_mb < 512, f"peak memory grew by {grown_mb:.0f} MB"
    assert report["numerics"]["status"] == "not checked"
    assert report["failures"] == []


# -- ops without a schema at the model's opset: a warning, an opaque node, exit 0 ----------


@pytest.mark.parametrize("case", sorted(builders.OPAQUE_OPS))
def test_op_missing_at_the_opset_is_a_warning_and_a_validate_error(tmp_path: Path, case: str) -> None:
    source = builders.OPAQUE_OPS[case](tmp_path)
    out = tmp_path / "out" / f"model.opt{source.suffix}"
    result = invoke("run", source, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    # The op's warning, and (where onnxruntime refuses the op too) the check's "not checked" line.
    warnings = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("graphopt: warning: ") and "numerics not checked" not in line
    ]
    assert len(warnings) == 1 and source.name in warnings[0] and "opaque" in warnings[0], result.stderr
    op = "Gelu" if "Gelu" in warnings[0] else "Scatter"
    assert op in warnings[0]
    assert op in json.dumps(json.loads(result.stdout)["summary"]["after"])
    assert out.is_file()
    line = assert_one_line_error(invoke("validate", source))
    assert op in line and "opaque" not in line


@pytest.mark.parametrize("opset", [12, 14])
def test_layer_norm_before_opset_17_is_opaque_and_checked(tmp_path: Path, opset: int) -> None:
    original = builders.layer_norm_at(opset)
    source = builders.write(original, tmp_path)
    out = tmp_path / "out.onnx"
    result = invoke("run", source, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert f"LayerNormalization (1 node) does not exist at opset {opset}" in result.stderr
    report = json.loads(result.stdout)
    assert report["numerics"]["status"] == "passed"  # onnxruntime runs it
    optimized = onnx.load(str(out))
    assert [n.op_type for n in optimized.graph.node] == ["LayerNormalization", "Relu"]  # the Identity went
    (before,) = [n for n in original.graph.node if n.op_type == "LayerNormalization"]
    (after,) = [n for n in optimized.graph.node if n.op_type == "LayerNormalization"]
    assert list(after.attribute) == list(before.attribute)  # untouched, nothing of "opaque" written
    assert "opaque" not in out.read_bytes().decode("latin-1")
    assert [o.version for o in optimized.opset_import] == [opset]


def test_no_shape_rule_through_an_opaque_op(tmp_path: Path) -> None:
    import graphopt

    source = builders.write(builders.layer_norm_at(12), tmp_path)
    model = graphopt.load(source)
    (node,) = [n for n in model.graph if n.op_type == "LayerNormalization"]
    assert node.opaque
    graphopt.optimize(model, "shape-infer", check=False)
    assert node.outputs[0].type is None  # opset 17's rule would give float32[batch, 8]
    current = graphopt.load(builders.write(builders.layer_norm_at(17), tmp_path, "current.onnx"))
    graphopt.optimize(current, "shape-infer", check=False)
    (node,) = [n for n in current.graph if n.op_type == "LayerNormalization"]
    assert not node.opaque and node.outputs[0].type is not None


def test_nothing_is_folded_through_an_opaque_op(tmp_path: Path) -> None:
    # Every input of the LayerNormalization is a constant: at opset 17 a folding pass could
    # replace it by its value; at opset 12 it has no schema, so it must stay as it is.
    proto = builders.layer_norm_at(12)
    data = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(data, "table"))
    proto.graph.node[1].input[0] = "table"
    proto.graph.node.append(onnx.helper.make_node("Add", ["x", "y_table"], ["sum"], name="add"))
    proto.graph.node[2].output[0] = "y_table"
    del proto.graph.output[:]
    proto.graph.output.append(builders.float_info("sum", [2, 8]))
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    report, optimized = run_json(tmp_path, proto)
    assert "LayerNormalization" in [n.op_type for n in optimized.graph.node]
    assert report["numerics"]["status"] == "passed"
