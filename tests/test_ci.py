"""graphopt in CI and shell pipelines: folders, shards, quiet runs, one-line errors, stdout
for products, merged reports, and the Python API called from a script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import onnx
import pytest

import graphopt
from graphopt.errors import CheckFailed, InputError
from graphopt.report import without_timings
from graphopt.schemas import schema
from samples.build_samples import tiny_encoder
from tests.cli_helpers import error_lines, invoke, mlp, one_line_error
from tests.reliability import builders

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _hf_export(folder: Path) -> Path:
    """A Hugging Face export folder: model.onnx beside its config and tokenizer files."""
    folder.mkdir(parents=True)
    onnx.save(tiny_encoder(), folder / "model.onnx")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return folder


# -- folders -------------------------------------------------------------------------------


def test_hf_export_folder_optimizes_the_model_and_skips_the_rest(tmp_path: Path) -> None:
    folder = _hf_export(tmp_path / "bert-export")
    graphopt.save(graphopt.load(folder / "model.onnx"), folder / "graph.json")  # graphopt's own JSON: read
    result = invoke("run", folder, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, schema("report"))
    assert sorted(Path(row["input"]["path"]).name for row in report["models"]) == ["graph.json", "model.onnx"]
    assert sorted(Path(s["path"]).name for s in report["skipped"]) == ["config.json", "tokenizer_config.json"]
    assert "note: skipped 2 JSON files that are not graphopt graphs" in result.stderr
    gate = invoke("run", folder, "--check-optimized", "--json")
    assert gate.exit_code == 1  # the export is not optimized; the config files are no error
    rows = json.loads(gate.stdout)["check_optimized"]
    assert sorted(Path(row["path"]).name for row in rows) == ["graph.json", "model.onnx"]
    assert "config.json" in gate.stderr and not any("config.json" in line for line in error_lines(gate))
    optimized = invoke("run", tmp_path / "out", "--check-optimized")
    assert optimized.exit_code == 0, optimized.stderr


def test_an_output_folder_inside_the_input_is_not_read_back(tmp_path: Path) -> None:
    models = tmp_path / "models"
    mlp(models / "a.onnx")
    mlp(models / "sub" / "b.onnx", 2.0)
    mlp(models / "c.opt.onnx", 3.0)  # an earlier run's default output: never an input
    runs = [invoke("run", models, "-o", models / "optimized", "--json") for _ in range(2)]
    assert [r.exit_code for r in runs] == [0, 0]
    first, second = (json.loads(r.stdout) for r in runs)
    assert [row["input"]["path"] for row in second["models"]] == [str(models / "a.onnx"), str(models / "sub/b.onnx")]
    assert without_timings(first) == without_timings(second)
    assert sorted(p.relative_to(models).as_posix() for p in (models / "optimized").rglob("*.onnx")) == [
        "optimized/a.onnx",
        "optimized/sub/b.onnx",
    ]


def test_output_naming_a_folder_writes_into_it(tmp_path: Path) -> None:
    source = mlp(tmp_path / "in" / "model.onnx")
    existing = tmp_path / "existing"
    existing.mkdir()
    assert invoke("run", source, "-o", existing, "-q").exit_code == 0
    assert [p.name for p in existing.iterdir()] == ["model.onnx"]
    assert invoke("run", source, "-o", f"{tmp_path / 'fresh'}/", "-q").exit_code == 0
    assert [p.name for p in (tmp_path / "fresh").iterdir()] == ["model.onnx"]
    assert invoke("run", source, "-o", tmp_path / "plain", "-q").exit_code == 0
    assert (tmp_path / "plain").is_file()  # no slash, not a folder: the output file itself
    mlp(tmp_path / "in" / "other.onnx", 2.0)
    many = invoke("run", source, tmp_path / "in" / "other.onnx", "-o", existing, "-q")
    assert many.exit_code == 0, many.stderr
    assert sorted(p.name for p in existing.iterdir()) == ["model.onnx", "other.onnx"]


def test_more_shards_than_models_gives_an_empty_shard(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for i in range(2):
        mlp(models / f"m{i}.onnx", i + 1.0)
    result = invoke("run", models, "-o", tmp_path / "out", "--shard", "4/4", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, schema("report"))
    assert report["models"] == [] and report["totals"]["models"] == 0
    gate = invoke("run", models, "--check-optimized", "--shard", "3/4", "--json")
    assert gate.exit_code == 0 and json.loads(gate.stdout)["check_optimized"] == []


# -- what reaches stderr and stdout --------------------------------------------------------


def test_quiet_silences_progress_and_tables_nevererror_lines(tmp_path: Path) -> None:
    models = tmp_path / "models"
    mlp(models / "good.onnx")
    (models / "bad.onnx").write_bytes(b"junk")
    quiet = invoke("run", models, "-o", tmp_path / "out", "-q")
    assert quiet.exit_code == 2
    assert quiet.stderr.splitlines() == error_lines(quiet) and len(error_lines(quiet)) == 1
    assert "bad.onnx" in error_lines(quiet)[0] and "not a valid ONNX" in error_lines(quiet)[0]
    assert invoke("run", models / "good.onnx", "-o", tmp_path / "g.onnx", "-q").stderr == ""
    broken = invoke("run", models / "good.onnx", "--passes", "test-breaks-numerics", "-o", tmp_path / "b.onnx", "-q")
    line = one_line_error(broken, 1)
    assert "good.onnx: numerics failed: output 'y'" in line
    gate = invoke("run", models / "good.onnx", "--check-optimized", "-q")
    assert "not optimized: nodes 2 -> 1" in one_line_error(gate, 1)


def test_stderr_is_not_wrapped_when_it_is_not_a_terminal(tmp_path: Path) -> None:
    deep = tmp_path / ("a-folder-name-long-enough-to-push-every-line-past-eighty-columns" * 2)
    source = mlp(deep / "model.onnx")
    result = invoke("run", source, "--passes", "test-breaks-numerics", "-o", deep / "out.onnx")
    assert result.exit_code == 1
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("numerics: failed")]
    assert "rel L2" in line and "max abs" in line and "floor" in line  # the whole reason on one line
    assert any(len(line) > 200 for line in result.stderr.splitlines())


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "--no-such-option", "m.onnx"], "No such option"),
        (["run"], "Missing argument"),
        (["run", "m.onnx", "-j", "many"], "'many' is not a valid integer"),
        (["no-such-command"], "No such command"),
        (["check", "only-one.onnx"], "does not exist"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args: list[str], expected: str) -> None:
    line = one_line_error(invoke(*args))
    assert expected in line and "--help" in line and "Usage:" not in line


def test_conflicting_options_are_bad_input(tmp_path: Path) -> None:
    source = mlp(tmp_path / "model.onnx")
    before = source.read_bytes()
    assert "--in-place and -o" in one_line_error(invoke("run", source, "--in-place", "-o", tmp_path / "o.onnx"))
    assert "--in-place and -o" in one_line_error(invoke("run", tmp_path, "--in-place", "-o", tmp_path / "out"))
    assert source.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    line = one_line_error(invoke("run", source, "--dim", "batch=2", "--dim", "batch=3", "-o", tmp_path / "o.onnx"))
    assert "conflicting" in line and "batch" in line
    assert "conflicting" in one_line_error(invoke("check", source, source, "--dim", "batch=2", "--dim", "batch=4"))
    assert invoke("check", source, source, "--dim", "batch=2", "--dim", "batch=2").exit_code == 0


def test_check_of_models_with_different_inputs_is_bad_input(tmp_path: Path) -> None:
    a = mlp(tmp_path / "a.onnx")
    b = mlp(tmp_path / "b.onnx", inputs="features")
    line = one_line_error(invoke("check", a, b))
    assert "cannot be compared" in line and "features" in line


def test_listings_go_to_stdout_diagnostics_to_stderr(tmp_path: Path) -> None:
    listing = invoke("passes")
    assert listing.exit_code == 0 and listing.stderr == ""
    assert "shape-infer" in listing.stdout and "default pipeline" in listing.stdout
    source = tmp_path / "tiny.onnx"
    onnx.save(tiny_encoder(), source)
    inspected = invoke("inspect", source)
    assert inspected.exit_code == 0 and inspected.stderr == ""
    assert "MatMul" in inspected.stdout and str(source) in inspected.stdout
    quiet = invoke("inspect", source, "-q")  # --quiet is about stderr: the product still comes
    assert quiet.stdout == inspected.stdout
    missing = invoke("inspect", tmp_path / "absent.onnx")
    assert missing.stdout == "" and one_line_error(missing)


# -- reports -------------------------------------------------------------------------------


def test_report_merge_adds_up_the_shards(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for i in range(3):
        mlp(models / f"m{i}.onnx", i + 1.0)
    (models / "bad.onnx").write_bytes(b"junk")
    whole = invoke("run", models, "-o", tmp_path / "all", "--json", "-q")
    totals = json.loads(whole.stdout)["totals"]
    assert totals["models"] == 4 and totals["failures"] == 1
    assert totals["nodes"] == [6, 3] and totals["initializer_bytes"] == [192, 192]
    shards = []
    for i in (1, 2, 3):
        shard = tmp_path / f"shard{i}.json"
        invoke("run", models, "-o", tmp_path / "out", "--shard", f"{i}/3", "--report", shard, "-q")
        shards.append(shard)
    merged_path = tmp_path / "merged.json"
    result = invoke("report", "merge", *shards, "-o", merged_path)
    assert result.exit_code == 1, result.stderr  # bad.onnx failed, as the run of the whole folder did
    assert "3 reports (shards 1/3, 2/3, 3/3): 4 models, 1 failure, 0 not checked, nodes 6 -> 3" in result.stderr
    merged = json.loads(merged_path.read_text())
    jsonschema.validate(merged, schema("report"))
    assert merged["totals"] == totals and merged["shards"] == ["1/3", "2/3", "3/3"]
    assert [Path(row["input"]["path"]).name for row in merged["models"]] == [
        "bad.onnx",
        "m0.onnx",
        "m1.onnx",
        "m2.onnx",
    ]
    to_stdout = invoke("report", "merge", *shards)
    assert json.loads(to_stdout.stdout) == merged
    (tmp_path / "junk.json").write_text("{}")
    assert "junk.json: not a graphopt report" in one_line_error(
        invoke("report", "merge", shards[0], tmp_path / "junk.json")
    )


# -- the Python API ------------------------------------------------------------------------


def test_api_check_twice_in_one_process_and_raise_on_failure(tmp_path: Path) -> None:
    a, b = mlp(tmp_path / "a.onnx"), mlp(tmp_path / "b.onnx", 2.0)
    assert graphopt.check(a, a).status == "passed"
    assert graphopt.check(a, a).status == "passed"  # the API function, called twice
    with pytest.raises(CheckFailed, match="numerics differ") as failure:
        graphopt.check(a, b)
    assert failure.value.result.status == "failed"
    assert graphopt.check(a, b, raise_on_failure=False).status == "failed"
    with pytest.raises(InputError, match="cannot be compared"):
        graphopt.check(a, mlp(tmp_path / "c.onnx", inputs="features"))


# -- set-up --------------------------------------------------------------------------------


def test_license_is_an_spdx_string_and_the_readme_says_how_to_call_graphopt() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"  # a table warns on every build (setuptools >= 77)
    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/graphopt" in readme and "source .venv/bin/activate" in readme


# -- acceptance: a mixed folder, twice -----------------------------------------------------


def test_a_mixed_folder_twice_gives_the_same_outputs_and_exit_codes(tmp_path: Path) -> None:
    models = tmp_path / "models"
    mlp(models / "good.onnx")
    onnx.save(builders.layer_norm_at(12), models / "legacy_layer_norm.onnx")
    (models / "bad.onnx").write_bytes(b"junk")
    builders.write(builders.cycle(), models, "cycle.onnx")
    _hf_export(models / "hf-export")
    out = models / "optimized"
    runs = [invoke("run", models, "-o", out, "--json") for _ in range(2)]
    outputs = []
    for result in runs:
        assert result.exit_code == 2  # the two bad models
        outputs.append({p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    assert outputs[0] == outputs[1]
    assert sorted(outputs[0]) == [
        "good.onnx",
        "hf-export/config.json",  # the export's other files go with its model
        "hf-export/model.onnx",
        "hf-export/tokenizer_config.json",
        "legacy_layer_norm.onnx",
    ]
    first, second = (without_timings(json.loads(r.stdout)) for r in runs)
    assert first == second
    assert [Path(row["input"]["path"]).name for row in first["models"]] == [
        "bad.onnx",
        "cycle.onnx",
        "good.onnx",
        "model.onnx",
        "legacy_layer_norm.onnx",
    ]
    assert first["totals"]["models"] == 5 and first["totals"]["failures"] == 2
    assert [Path(s["path"]).name for s in first["skipped"]] == ["config.json", "tokenizer_config.json"]
    assert error_lines(runs[0]) == error_lines(runs[1]) and len(error_lines(runs[0])) == 2
