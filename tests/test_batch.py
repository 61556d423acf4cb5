"""Many models at once through the Python API (graphopt.optimize_folder), and what a folder
run costs: the pipeline resolved once per run, each model loaded once."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import onnx
import pytest

import graphopt
import graphopt.api
import graphopt.runner
from graphopt.batch import check_optimized
from graphopt.errors import InputError
from graphopt.runner import RunOptions
from tests.cli_helpers import invoke, mlp


def _model_folder(root: Path) -> Path:
    mlp(root / "a.onnx", 1.0)
    mlp(root / "nested" / "b.onnx", 2.0)
    (root / "nested" / "config.json").write_text('{"model_type": "mlp"}')
    return root


def test_a_folder_run_resolves_the_pipeline_once_and_loads_each_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a folder of 2 models with -o resolved the pipeline 7 times and loaded each model twice."""
    calls: dict[str, int] = {"resolve": 0, "load": 0}

    def counting(name: str, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    monkeypatch.setattr(graphopt.api, "pipeline_from_names", counting("resolve", graphopt.api.pipeline_from_names))
    monkeypatch.setattr(graphopt.runner, "load_noting", counting("load", graphopt.runner.load_noting))
    folder = _model_folder(tmp_path / "models")
    result = invoke("run", folder, "-o", tmp_path / "out/", "--passes", "shape-infer,cleanup", "--no-check")
    assert result.exit_code == 0, result.stderr
    assert calls == {"resolve": 1, "load": 2}


def test_optimize_folder_writes_what_graphopt_run_writes(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "models")
    ran = graphopt.optimize_folder(folder, tmp_path / "out", passes="shape-infer,cleanup")
    assert ran.exit_code == 0
    report = ran.report.to_json()
    assert [Path(row["input"]["path"]).name for row in report["models"]] == ["a.onnx", "b.onnx"]
    assert [row["numerics"]["status"] for row in report["models"]] == ["passed", "passed"]
    assert report["totals"]["models"] == 2 and report["totals"]["nodes"] == [4, 2]
    assert report["skipped"] == [
        {"path": str(folder / "nested" / "config.json"), "reason": "JSON that is not a graphopt graph"}
    ]
    for written in (tmp_path / "out" / "a.onnx", tmp_path / "out" / "nested" / "b.onnx"):
        assert [n.op_type for n in onnx.load(written).graph.node] == ["MatMul"]
    assert ran.copied == [Path("nested/config.json")]
    assert (tmp_path / "out" / "nested" / "config.json").read_text() == '{"model_type": "mlp"}'
    # The same JSON form a `graphopt run --report` writes, and the same outputs.
    cli_report = tmp_path / "cli.json"
    cli = invoke("run", folder, "-o", tmp_path / "cli/", "--passes", "shape-infer,cleanup", "--report", cli_report)
    assert cli.exit_code == 0, cli.stderr
    written = json.loads(cli_report.read_text())
    assert list(written) == list(report) and written["totals"] == report["totals"]


def test_optimize_folder_takes_a_shard_and_run_settings(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "models")
    ran = graphopt.optimize_folder(folder, tmp_path / "out", shard=(2, 2), check=False, provenance=True)
    assert [Path(row["input"]["path"]).name for row in ran.report.models] == ["b.onnx"]
    assert ran.report.to_json()["shard"] == "2/2"
    assert not (tmp_path / "out" / "a.onnx").exists()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda tmp: graphopt.optimize_folder(tmp / "missing", tmp / "out"), "no such file or directory"),
        (lambda tmp: graphopt.optimize_folder(tmp / "models", tmp / "out", passes="no-such-pass"), "no-such-pass"),
        (lambda tmp: graphopt.optimize_folder(tmp / "models", tmp / "out", shard=(3, 2)), "shard 3/2"),
    ],
)
def test_optimize_folder_refuses_bad_input_and_writes_nothing(tmp_path: Path, call: Any, message: str) -> None:
    _model_folder(tmp_path / "models")
    with pytest.raises(InputError, match=message):
        call(tmp_path)
    assert not (tmp_path / "out").exists()


def test_a_model_that_fails_is_a_row_with_its_exit_code(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "models")
    (folder / "broken.onnx").write_bytes(b"not a model")
    ran = graphopt.optimize_folder(folder, tmp_path / "out", check=False)
    assert ran.exit_code == 2
    broken = next(row for row in ran.report.models if row["input"]["path"].endswith("broken.onnx"))
    assert broken["status"] == "error" and broken["exit_code"] == 2
    assert ran.report.to_json()["totals"]["failures"] == 1


def test_the_gate_through_the_api(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "models")
    options = RunOptions.resolve("shape-infer,cleanup")
    before = check_optimized(sorted(folder.rglob("*.onnx")), options)
    assert before.exit_code == 1 and not any(row["optimized"] for row in before.check_optimized)
    graphopt.optimize_folder(folder, tmp_path / "out", options=options)
    after = check_optimized(sorted((tmp_path / "out").rglob("*.onnx")), options)
    assert after.exit_code == 0 and after.to_json()["totals"]["failures"] == 0


def test_a_shard_does_not_copy_the_models_of_other_shards(tmp_path: Path) -> None:
    """Before: --shard 2/2 -o out/ copied a.onnx (shard 1's model) raw into out/ as a file beside
    the models, racing shard 1's optimized output in a CI matrix sharing one output folder."""
    folder = tmp_path / "models"
    mlp(folder / "a.onnx")
    mlp(folder / "b.onnx")
    out = tmp_path / "out"
    result = invoke("run", folder, "--shard", "2/2", "-o", f"{out}/", "--no-check")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["b.onnx"]


def test_the_readme_example_of_optimize_folder_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "optimize_folder(" in c]
    _model_folder(tmp_path / "models")
    mlp(tmp_path / "model.onnx")  # the block's one-file example
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "optimized" / "a.onnx").is_file() and (tmp_path / "optimized" / "nested" / "b.onnx").is_file()
    assert (tmp_path / "model.opt.onnx").is_file() and (tmp_path / "report.json").is_file()
