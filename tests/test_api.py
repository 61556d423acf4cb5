"""The Python API as a user calls it: paths, ModelProtos and graphopt models everywhere,
``optimize`` checks and writes, and the README's API examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest

import graphopt
from graphopt.errors import CheckFailed
from graphopt.ir import Model
from graphopt.numerics.options import CheckOptions
from tests.cli_helpers import mlp
from tests.numerics import assert_same_outputs

README = Path(__file__).resolve().parent.parent / "README.md"


def test_optimize_a_proto_checks_it_and_gives_a_proto(tmp_path: Path) -> None:
    proto = onnx.load(mlp(tmp_path / "m.onnx", 2.0))
    result = graphopt.optimize(proto)
    assert isinstance(result.model, onnx.ModelProto)
    assert len(result.model.graph.node) == 1 and len(proto.graph.node) == 2  # the one given is left as it was
    assert result.numerics is not None and result.numerics.status == "passed"
    assert result.numerics.passed_by is not None


def test_optimize_a_path_writes_the_output_after_the_check(tmp_path: Path) -> None:
    source = mlp(tmp_path / "m.onnx", 2.0)
    result = graphopt.optimize(source, output=tmp_path / "out.onnx")
    assert isinstance(result.model, Model) and result.numerics is not None
    assert result.numerics.status == "passed"
    assert len(onnx.load(tmp_path / "out.onnx").graph.node) == 1
    assert_same_outputs(source, tmp_path / "out.onnx")


def test_a_failed_check_raises_and_writes_nothing(tmp_path: Path) -> None:
    source = mlp(tmp_path / "m.onnx", 2.0)
    with pytest.raises(CheckFailed, match="numerics failed") as raised:
        graphopt.optimize(source, "test-breaks-numerics", output=tmp_path / "out.onnx")
    assert getattr(raised.value.result, "status", None) == "failed"
    assert not (tmp_path / "out.onnx").exists()
    unchecked = graphopt.optimize(source, "test-breaks-numerics", check=False)  # asked for: no check
    assert unchecked.numerics is None


def test_optimize_a_graphopt_model_checks_it_against_the_model_as_given(tmp_path: Path) -> None:
    model = graphopt.load(mlp(tmp_path / "m.onnx", 2.0))
    with pytest.raises(CheckFailed):
        graphopt.optimize(model, "test-breaks-numerics")
    result = graphopt.optimize(graphopt.load(tmp_path / "m.onnx"), check=CheckOptions(dims={"batch": 3}))
    assert result.numerics is not None and result.numerics.status == "passed"
    assert [b.dims for b in result.numerics.bindings] == [{"batch": 3}] * len(result.numerics.bindings)


def test_check_save_inspect_and_diff_take_protos(tmp_path: Path) -> None:
    """Before: check(proto, proto) raised TypeError and save(proto, path) AttributeError."""
    proto = onnx.load(mlp(tmp_path / "m.onnx", 2.0))
    optimized = graphopt.optimize(proto).model
    assert graphopt.check(proto, optimized).status == "passed"
    graphopt.save(optimized, tmp_path / "saved.onnx")
    assert graphopt.check(tmp_path / "m.onnx", tmp_path / "saved.onnx").status == "passed"
    assert graphopt.inspect(optimized)["ops"] == {"MatMul": 1}
    assert graphopt.inspect(tmp_path / "m.onnx")["nodes"] == 2
    assert graphopt.diff(tmp_path / "m.onnx", optimized)["ops"] == graphopt.diff(proto, tmp_path / "saved.onnx")["ops"]
    broken = graphopt.optimize(proto, "test-breaks-numerics", check=False).model
    with pytest.raises(CheckFailed, match="the ModelProto: numerics differ from"):
        graphopt.check(proto, broken)


def test_optimize_file_writes_what_graphopt_run_writes(tmp_path: Path) -> None:
    source = mlp(tmp_path / "m.onnx", 2.0)
    ran = graphopt.optimize_file(source, tmp_path / "out.onnx", report=tmp_path / "r.json")
    assert ran.exit_code == 0 and ran.report["numerics"]["status"] == "passed"
    assert (tmp_path / "r.json").is_file() and len(onnx.load(tmp_path / "out.onnx").graph.node) == 1
    failed = graphopt.optimize_file(source, tmp_path / "bad.onnx", passes="test-breaks-numerics")
    assert failed.exit_code == 1 and not (tmp_path / "bad.onnx").exists()


def _readme_api_examples() -> list[str]:
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.parametrize("index", range(len(_readme_api_examples())))
def test_the_readme_api_examples_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], index: int
) -> None:
    mlp(tmp_path / "model.onnx", 2.0)
    for name, scale in (("a", 1.0), ("b", 3.0)):
        mlp(tmp_path / "models" / f"{name}.onnx", scale)
    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_api_examples()[index], f"README.md API example {index + 1}", "exec"), {})
    printed = capsys.readouterr().out
    assert "passed" in printed  # every example prints a check's outcome
