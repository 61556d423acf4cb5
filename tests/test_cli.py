"""The command line end to end: exit codes, files written (or not), reports, stdout/stderr."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from click.testing import Result
from onnx import TensorProto, helper, numpy_helper

from graphopt.ir import Model, Tensor
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.schemas import schema
from samples.build_samples import tiny_encoder
from tests.cli_helpers import diagnostics, invoke, mlp, one_line_error


@register
class _Explodes(Pass):
    name = "test-explodes"
    description = "Removes a node, then raises (tests the rollback)"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        model.graph.remove(model.graph.nodes[0], safe=False)
        raise RuntimeError("boom")


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_encoder(), path)
    return path


def _one_line_error(result: Result) -> str:
    lines = diagnostics(result)
    assert len(lines) == 1 and lines[0].startswith("graphopt: error:"), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_run_writes_model_and_a_valid_report(sample: Path, tmp_path: Path) -> None:
    out, report_path = tmp_path / "out.onnx", tmp_path / "report.json"
    result = invoke("run", sample, "-o", out, "--report", report_path, "--json")
    assert result.exit_code == 0, result.stderr
    onnx.checker.check_model(str(out))
    report = json.loads(result.stdout)
    assert report == json.loads(report_path.read_text())
    jsonschema.validate(report, schema("report"))
    assert report["numerics"]["status"] == "passed"
    assert len(report["numerics"]["bindings"]) >= 2
    assert report["output"]["path"] == str(out)
    assert report["summary"]["after"]["nodes"] <= report["summary"]["before"]["nodes"]


def test_default_output_name_and_no_overwrite(sample: Path) -> None:
    assert invoke("run", sample, "--no-check", "-q").exit_code == 0
    assert sample.with_name("tiny.opt.onnx").is_file()
    before = sample.read_bytes()
    result = invoke("run", sample, "-o", sample, "--no-check")
    assert result.exit_code == 2 and "--in-place" in _one_line_error(result)
    assert sample.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "expected"),
    [(b"garbage\x00\xff", "not a valid ONNX"), (b"", "not an ONNX model")],
)
def test_bad_model_exits_2_and_writes_nothing(tmp_path: Path, content: bytes, expected: str) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    result = invoke("run", bad, "-o", tmp_path / "out.onnx")
    assert result.exit_code == 2
    assert expected in _one_line_error(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]


def test_unknown_pass_and_option_are_usage_errors(sample: Path, tmp_path: Path) -> None:
    result = invoke("run", sample, "--passes", "dce,no-such-pass")
    assert result.exit_code == 2 and "no-such-pass" in _one_line_error(result)
    config = tmp_path / "pipeline.toml"
    config.write_text('[[pipeline]]\npass = "shape-infer"\noptions = { no_such_option = 1 }\n')
    result = invoke("run", sample, "--config", config)
    assert result.exit_code == 2 and "no_such_option" in _one_line_error(result)
    config.write_text('[[pipeline]]\npasses = "dce"\n')
    result = invoke("run", sample, "--config", config)
    assert result.exit_code == 2 and "$.pipeline[0]" in _one_line_error(result)


def test_failing_pass_is_rolled_back_and_reported(sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    result = invoke("run", sample, "--passes", "test-explodes,shape-infer", "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["failures"] == [{"pass": "test-explodes", "error": "RuntimeError: boom"}]
    assert report["summary"]["after"]["nodes"] == report["summary"]["before"]["nodes"]
    assert report["numerics"]["status"] == "passed"
    strict = invoke("run", sample, "--passes", "test-explodes", "-o", tmp_path / "strict.onnx", "--strict")
    assert strict.exit_code == 3
    assert "test-explodes" in _one_line_error(strict)


def test_broken_numerics_exit_1_write_nothing_and_blame(sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    result = invoke("run", sample, "--passes", "shape-infer,test-breaks-numerics", "-o", out, "--blame", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["numerics"]["status"] == "failed"
    assert report["blame"]["pass"] == "test-breaks-numerics"
    assert report["output"] is None and not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.onnx"]
    kept = invoke("run", sample, "--passes", "test-breaks-numerics", "-o", out, "--keep-failed")
    assert kept.exit_code == 1 and out.is_file()


def test_check_command_compares_two_models(sample: Path, tmp_path: Path) -> None:
    assert invoke("check", sample, sample).exit_code == 0
    model = tiny_encoder()
    weight = model.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) + 1, weight.name))
    onnx.save(model, tmp_path / "changed.onnx")
    result = invoke("check", sample, tmp_path / "changed.onnx", "--json")
    assert result.exit_code == 1, result.stderr  # exit 0 once in CI, under load: what did the check say?
    assert json.loads(result.stdout)["status"] == "failed"


def test_convert_inspect_and_validate(sample: Path, tmp_path: Path) -> None:
    as_json = tmp_path / "tiny.json"
    assert invoke("convert", sample, as_json).exit_code == 0
    assert invoke("convert", as_json, tmp_path / "back.onnx").exit_code == 0
    assert invoke("validate", tmp_path / "back.onnx", as_json).exit_code == 0
    result = invoke("inspect", sample, "--json")
    info = json.loads(result.stdout)
    assert info["inputs"] == [{"name": "x", "type": "float[batch, seq, 32]"}]
    assert info["ops"]["Identity"] == 3 and info["parameters"] == 32 * 64 + 64 + 64 * 32
    broken = tmp_path / "broken.onnx"
    model = tiny_encoder()
    model.graph.node[0].op_type = "NoSuchOp"
    broken.write_bytes(model.SerializeToString())
    result = invoke("validate", broken)
    assert result.exit_code == 2 and "checker" in _one_line_error(result)


def test_passes_lists_registry_with_options() -> None:
    result = invoke("passes", "--json")
    assert result.exit_code == 0
    listing = json.loads(result.stdout)
    names = {p["name"] for p in listing["passes"]}
    assert {"shape-infer", "dce", "cse", "noop"} <= names
    for entry in listing["default_pipeline"]:
        assert "pass" in entry or "group" in entry


def test_help_texts_teach_with_examples() -> None:
    for command in ("run", "convert", "inspect", "validate", "check", "passes"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "Examples:" in result.output and "Exit codes" in result.output
    assert "0.1.0" in invoke("--version").output


def test_batch_mode_over_a_folder_with_shards(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    for i in range(3):
        mlp(models / f"m{i}.onnx", i + 1.0)
    (models / "bad.onnx").write_bytes(b"junk")
    out = tmp_path / "out"
    result = invoke("run", models, "-o", out, "-j", "2", "--json")
    report = json.loads(result.stdout)
    jsonschema.validate(report, schema("report"))
    assert result.exit_code == 2  # one bad model among good ones
    rows = {Path(r["input"]["path"]).name: r for r in report["models"]}
    assert "not a valid ONNX" in rows["bad.onnx"]["error"]
    assert all(rows[f"m{i}.onnx"]["numerics"]["status"] == "passed" for i in range(3))
    assert sorted(p.name for p in out.iterdir()) == ["m0.onnx", "m1.onnx", "m2.onnx"]
    shards = [json.loads(invoke("run", models, "-o", out, "--shard", f"{i}/2", "--json").stdout) for i in (1, 2)]
    names = [sorted(Path(r["input"]["path"]).name for r in s["models"]) for s in shards]
    assert names == [["bad.onnx", "m1.onnx"], ["m0.onnx", "m2.onnx"]]
    refused = invoke("run", models, "--shard", "3/2")
    assert refused.exit_code == 2 and "--shard 3/2: expected i/n" in refused.output


def test_outputs_get_the_permissions_of_a_plain_write(sample: Path, tmp_path: Path) -> None:
    # Temporary files are private (0600); renamed into place they must not stay so.
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    as_json = tmp_path / "model.json"
    assert invoke("run", sample, "-o", out, "--report", report, "--external-data", "--no-check").exit_code == 0
    assert invoke("convert", sample, as_json).exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    written = [out, report, as_json, *tmp_path.glob("*.data"), *tmp_path.glob("*.npy")]
    assert len(written) >= 4
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


@register
class _BreaksSecondWeight(Pass):
    name = "test-breaks-w2"
    description = "Scales the initializer 'w2' by 1.5 (a wrong optimization of one node)"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        value = model.graph.initializers["w2"]
        assert isinstance(value.const, Tensor)
        value.const = Tensor.from_array(value.const.numpy() * 1.5, "w2")
        return PassResult(True)


def _two_layers(path: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
        helper.make_node("MatMul", ["r", "w2"], ["m"], name="second"),
        helper.make_node("Add", ["m", "b"], ["y"], name="bias"),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.ones(4, np.float32), "b"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    return path


def test_blame_bisects_and_names_the_first_diverging_node(tmp_path: Path) -> None:
    source = _two_layers(tmp_path / "two.onnx")
    passes = ["noop", "dce", "cse", "noop", "dce", "test-breaks-w2", "cse", "noop", "dce", "cse", "noop", "dce"]
    result = invoke("run", source, "--passes", ",".join(passes), "-o", tmp_path / "out.onnx", "--blame", "--json")
    assert result.exit_code == 1, result.stderr
    blame = json.loads(result.stdout)["blame"]
    assert blame["pass"] == "test-breaks-w2" and blame["execution"] == 6 and blame["executions"] == 12
    assert blame["reruns"] <= 4  # ceil(log2(12)), not 12
    divergence = blame["divergence"]
    assert (divergence["node"], divergence["op_type"], divergence["output"]) == ("second", "MatMul", "m")
    assert divergence["compared"] == 3  # 'h' and 'r' agreed before it
    assert divergence["rel_l2"] > 0.1 and divergence["max_abs"] >= divergence["p99_abs"] > 0
    assert "first diverging node: second (MatMul, output m)" in " ".join(result.stderr.split())
    jsonschema.validate(json.loads(result.stdout), schema("report"))


def test_run_and_check_take_the_same_check_options_and_refuse_a_lone_atol_alike(tmp_path: Path) -> None:
    from graphopt.cli import cli

    def check_flags(command: str) -> dict[str, str | None]:
        params = cli.commands[command].params  # type: ignore[attr-defined]
        return {
            p.name: p.help
            for p in params
            if p.name in {"dims", "inputs", "atol", "rtol", "require_check", "check_memory", "check_timeout"}
        }

    assert check_flags("run") == check_flags("check") and len(check_flags("run")) == 7
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    for command in (["run", model, "--no-check"], ["check", model, model]):
        result = invoke(*command, "--atol", "1e-5")
        assert result.exit_code == 2 and "--atol and --rtol go together" in result.output


def test_unwind_refuses_a_negative_time_budget(tmp_path: Path) -> None:
    model = mlp(tmp_path / "m.onnx")
    assert "time budget is -1.0 seconds" in one_line_error(invoke("unwind", model, "--time-budget", "-1"))
    assert "time budget is -1.0 seconds" in one_line_error(invoke("run", model, "--unwind-time-budget", "-1"))
