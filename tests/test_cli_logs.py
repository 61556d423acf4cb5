"""The command line for people and CI logs (issue 25): checked merges, named files as in
folders, every requested pass shown, progress where logs are read, discoverable rules, one
formatter for numbers, the layout problem of a model, a model folder kept whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.schemas import schema
from tests.cli_helpers import error_lines, invoke, mlp, one_line_error

# -- 6: report merge refuses CI mistakes ----------------------------------------------------


def _sharded_reports(tmp_path: Path, failing: bool = False) -> list[Path]:
    models = tmp_path / "models"
    for i in range(3):
        mlp(models / f"m{i}.onnx", i + 1.0)
    (models / "config.json").write_text("{}")
    if failing:
        (models / "bad.onnx").write_bytes(b"junk")
    shards = []
    for i in (1, 2, 3):
        shard = tmp_path / f"shard{i}.json"
        invoke("run", models, "-o", tmp_path / "out", "--shard", f"{i}/3", "--report", shard, "-q")
        assert json.loads(shard.read_text())["shard"] == f"{i}/3"
        shards.append(shard)
    return shards


def test_merge_refuses_missing_and_repeated_shards(tmp_path: Path) -> None:
    one, two, three = _sharded_reports(tmp_path)
    line = one_line_error(invoke("report", "merge", one, two))
    assert "shard 3/3 is missing" in line
    line = one_line_error(invoke("report", "merge", one, two, three, two))
    assert "shard 2/3" in line and "twice" in line and "shard2.json" in line
    copy = tmp_path / "copy.json"
    copy.write_text(one.read_text())
    line = one_line_error(invoke("report", "merge", one, copy, two, three))
    assert "shard1.json" in line and "copy.json" in line
    merged = invoke("report", "merge", one, two, three)
    assert merged.exit_code == 0, merged.stderr
    report = json.loads(merged.stdout)
    jsonschema.validate(report, schema("report"))
    assert [Path(s["path"]).name for s in report["skipped"]] == ["config.json"]  # once, not once a shard
    assert "weights 192 B -> 192 B" in merged.stderr


def test_merge_exits_1_when_a_merged_model_failed(tmp_path: Path) -> None:
    shards = _sharded_reports(tmp_path, failing=True)
    result = invoke("report", "merge", *shards, "-o", tmp_path / "all.json")
    assert result.exit_code == 1, result.stderr
    assert (tmp_path / "all.json").is_file()  # the merged report is written all the same
    (line,) = error_lines(result)
    assert "bad.onnx" in line and "not a valid ONNX" in line


# -- 4: every requested pass, with its outcome ----------------------------------------------


def _table_rows(stderr: str) -> dict[str, str]:
    """The rows of the pass table of a run's stderr, by their first cell."""
    rows = {}
    for line in stderr.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) >= 5:
            rows[cells[0].split(" x")[0]] = line  # "simplify (1)/fuse x3": it ran three times
    return rows


def test_every_requested_pass_is_shown_with_its_outcome(corpus_dir: Path, tmp_path: Path) -> None:
    result = invoke(
        "run", corpus_dir / "resnet50.onnx", "-o", tmp_path / "r.onnx", "--passes", "fold,unwind", "--no-check"
    )
    assert result.exit_code == 0, result.stderr
    rows = _table_rows(result.stderr)  # neither changed anything: one row, with fold's reason
    assert "no change" in rows["fold, unwind"]
    assert "fold: refused 1 candidate: the copies it needs cost more than the kernels it saves" in rows["fold, unwind"]


def test_two_groups_of_one_name_get_two_labels(tmp_path: Path) -> None:
    config = tmp_path / "twice.toml"
    group = '[[pipeline]]\ngroup = "simplify"\nsteps = [{ pass = "fuse" }, { pass = "dce" }]\n'
    config.write_text(f'{group}\n[[pipeline]]\npass = "fold"\n\n{group}')
    result = invoke("run", mlp(tmp_path / "m.onnx"), "--config", config, "--no-check")
    assert result.exit_code == 0, result.stderr
    labels = list(_table_rows(result.stderr))
    assert labels == ["simplify (1), fold, simplify (2)"]  # all idle: one row, each group's label numbered


def test_the_default_pipeline_shows_each_step_once(tmp_path: Path) -> None:
    result = invoke("run", mlp(tmp_path / "m.onnx"), "--no-check")
    assert result.exit_code == 0, result.stderr
    labels = list(_table_rows(result.stderr))
    assert labels == [
        "shape-infer",
        "cleanup/noop",
        "cleanup/dce, cleanup/cse, simplify, settle, strip-value-info",  # all idle
    ]


# -- 7: a named file gets the folder's rule; the pre-commit hook ----------------------------


def test_a_named_json_that_is_not_a_graph_is_skipped_with_a_note(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "bert"}))
    alone = invoke("run", config)
    assert alone.exit_code == 0, alone.stderr
    assert "note: skipped 1 JSON file that is not a graphopt graph" in alone.stderr and str(config) in alone.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    model = mlp(tmp_path / "model.onnx")
    gate = invoke("run", "--check-optimized", model, config, "--json")  # as a pre-commit hook passes changed files
    assert "note: skipped 1 JSON file" in gate.stderr
    report = json.loads(gate.stdout)
    assert [row["path"] for row in report["check_optimized"]] == [str(model)]
    assert report["skipped"] == [{"path": str(config), "reason": "JSON that is not a graphopt graph"}]


@pytest.mark.parametrize("gate", [[], ["--require-check"], ["--check-optimized"]])
def test_a_folder_without_a_model_is_bad_input_naming_what_it_holds(tmp_path: Path, gate: list[str]) -> None:
    """An export that failed half way (only config.json): exit 0 with a note, under
    --require-check and --check-optimized too (issue 35)."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": "bert"}))
    result = invoke("run", export, "-o", f"{tmp_path / 'out'}/", *gate)
    line = one_line_error(result)
    assert (
        line
        == f"graphopt: error: no model in {export}: found config.json (looked for *.onnx and graphopt's *.json graphs)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gate", ["--require-check", "--check-optimized"])
def test_a_gate_that_found_no_model_to_check_fails(tmp_path: Path, gate: str) -> None:
    """Only files that are not models named: exit 0 with a note before; a gate must check one."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "bert"}))
    line = one_line_error(invoke("run", config, gate))
    assert f"{config}: no model to check (JSON that is not a graphopt graph)" in line and gate in line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format":\n "graphopt-gr', "invalid JSON at line 2"),  # cut short before its marker is whole
        ('{"model_type": "bert"', "invalid JSON at line 1"),  # a truncated config.json
        ('{"nodes": [' + " " * 70_000 + '], "format": "graphopt-graph"}', "'format_version' is a required property"),
    ],
)
def test_a_json_file_that_is_broken_or_claims_the_format_is_bad_input(tmp_path: Path, text: str, message: str) -> None:
    """Named or found in a folder beside a model: skipped as "not a graphopt graph", exit 0
    (the marker is looked for in the first 64 KiB; the third claims it after them)."""
    broken = tmp_path / "models" / "graph.json"
    mlp(tmp_path / "models" / "model.onnx")
    broken.write_text(text)
    line = one_line_error(invoke("run", broken, "--no-check"))
    assert str(broken) in line and message in line
    folder = invoke("run", tmp_path / "models", "-o", f"{tmp_path / 'out'}/", "--no-check")
    assert folder.exit_code == 2 and "note: skipped" not in folder.stderr
    (line,) = error_lines(folder)
    assert str(broken) in line and message in line


def test_the_pre_commit_hook_gates_changed_onnx_files() -> None:
    root = Path(__file__).resolve().parents[1]
    text = (root / ".pre-commit-hooks.yaml").read_text()
    assert text.count("- id:") == 1  # one hook, its keys one a line (YAML without a YAML reader)
    hook = dict(re.findall(r"^[- ] (\w+): (.+)$", text, re.MULTILINE))
    assert hook["entry"].split()[:3] == ["graphopt", "run", "--check-optimized"]
    assert re.search(hook["files"], "models/encoder.onnx") and not re.search(hook["files"], "config.json")
    readme = (root / "README.md").read_text()
    assert "rev:" in readme and f"id: {hook['id']}" in readme and "--require-check" in readme


# -- 2 and 3: progress where logs are read; warnings name their model ------------------------

_PROGRESS = re.compile(r"^\[ *\d+\.\ds\] (.*)$")


def test_a_run_logs_each_phase_as_it_starts(tmp_path: Path) -> None:
    result = invoke("run", mlp(tmp_path / "m.onnx"), "-o", tmp_path / "out.onnx", "--passes", "cleanup,fold")
    assert result.exit_code == 0, result.stderr
    phases = [m.group(1) for m in map(_PROGRESS.match, result.stderr.splitlines()) if m]
    assert phases[0] == f"load {tmp_path / 'm.onnx'}"
    assert phases[1:3] == ["pass cleanup/noop (round 1)", "pass cleanup/dce (round 1)"]
    assert phases.index("pass fold") < phases.index(f"save {tmp_path / 'out.onnx'}") < phases.index("check numerics")
    assert phases[-6:] == [
        "check: the original at {batch=3}",
        "check: the original at {batch=1}",
        "check: the original at {batch=5}",  # the largest binding
        "check: the optimized model at {batch=3}",
        "check: the optimized model at {batch=1}",
        "check: the optimized model at {batch=5}",
    ]
    assert result.stderr.index("check: the optimized model") < result.stderr.index("┃ pass")  # then the table


def _declares_minus_one(path: Path) -> Path:
    mlp(path)
    model = onnx.load(path)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
    onnx.save(model, path)
    return path


def test_a_folder_run_logs_each_model_and_warnings_name_theirs(tmp_path: Path) -> None:
    models = tmp_path / "models"
    mlp(models / "a.onnx")
    _declares_minus_one(models / "b.onnx")
    _declares_minus_one(models / "c.onnx")
    for jobs in ("1", "2"):
        result = invoke("run", models, "-o", tmp_path / f"out{jobs}", "-j", jobs, "--no-check")
        assert result.exit_code == 0, result.stderr
        lines = result.stderr.splitlines()
        finished = [line for line in lines if line.startswith("[") and "s] " in line]
        assert len(finished) == 3 and {line.split("] ")[1].split(":")[0] for line in finished} == {
            str(models / name) for name in ("a.onnx", "b.onnx", "c.onnx")
        }
        assert all("ok, nodes 2 -> 1, numerics skipped" in line for line in finished)
        warnings = [line for line in lines if line.startswith("graphopt: warning:")]
        assert sorted(warnings) == [
            f"graphopt: warning: {models / name}: value 'x' declares dim -1: read as an unknown dim"
            for name in ("b.onnx", "c.onnx")
        ]


def test_a_single_run_warning_names_its_model(tmp_path: Path) -> None:
    source = _declares_minus_one(tmp_path / "m.onnx")
    result = invoke("run", source, "--no-check", "-q")
    assert result.exit_code == 0
    assert result.stderr == f"graphopt: warning: {source}: value 'x' declares dim -1: read as an unknown dim\n"


# -- 5: passes, rule families and rules, readable in a pipe ----------------------------------


def test_passes_lists_readably_with_the_fuse_families() -> None:
    result = invoke("passes")
    assert result.exit_code == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 100
    assert "default pipeline:" in lines
    assert "  cleanup (noop, dce, cse), up to 8 rounds" in lines
    families = result.stdout.split("rule families")[1].split("\n\n")[0]
    assert "activation" in families and "norm" in families and "graphopt passes fuse" in families


def test_passes_fuse_lists_each_rule_on_one_line() -> None:
    listed = invoke("passes", "fuse")
    assert listed.exit_code == 0, listed.stderr
    as_json = json.loads(invoke("passes", "fuse", "--json").stdout)
    (fuse,) = as_json["passes"]
    rules = fuse["rules"]
    assert len(rules) > 40 and {"name", "family", "default", "doc"} <= set(rules[0])
    lines = listed.stdout.splitlines()
    for rule in rules:
        (line,) = [line for line in lines if line.split()[:1] == [rule["name"]]]
        assert rule["family"] in line and ("off by default" in line) == (not rule["default"])
    assert "enable" in listed.stdout and "disable" in listed.stdout
    assert "unknown pass 'nosuch'" in one_line_error(invoke("passes", "nosuch"))
    everything = json.loads(invoke("passes", "--json").stdout)
    assert {p["name"] for p in everything["passes"]} >= {"fuse", "fold", "unwind"}
    assert isinstance(everything["default_pipeline"], list)


# -- 10: one formatter for numbers and results; each command's own exit codes ---------------


def test_check_prints_figures_as_run_does_and_labels_each_binding(tmp_path: Path) -> None:
    a = mlp(tmp_path / "a.onnx")
    b = mlp(tmp_path / "b.onnx", 1.0 + 1e-6)
    result = invoke("check", a, b)
    assert result.exit_code == 0, result.stderr
    assert "{'" not in result.stderr and not re.search(r"\d\.\d{7,}", result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("  binding")]
    assert [line[:19] for line in lines] == ["  binding 1 (batch=", "  binding 2 (batch=", "  binding 3 (batch="]
    assert lines[2].startswith("  binding 3 (batch=5; largest sizes, ")
    assert re.search(r"rel L2 \d\.\d\de-0\d", lines[0])
    run = invoke("run", a, "-o", tmp_path / "out.onnx")
    assert "{'" not in run.stderr and "  binding 1 (batch=" in run.stderr


def test_check_optimized_says_the_gain_and_the_fix_once(tmp_path: Path) -> None:
    model = mlp(tmp_path / "m.onnx")
    result = invoke("run", model, "--check-optimized")
    line = one_line_error(result, 1)
    assert f"{model}: not optimized: nodes 2 -> 1" in line and "(by noop)" in line
    assert f"graphopt run {model} --in-place" in line
    assert "shape-infer" not in line and "strip-value-info" not in line


def test_each_command_shows_its_own_exit_codes_and_quiet_says_what_it_keeps() -> None:
    assert "gate" not in invoke("convert", "--help").stdout and "  1  " not in invoke("convert", "--help").stdout
    assert "  1  a model's numerics check failed" in invoke("run", "--help").stdout
    assert "  1  the outputs differ" in invoke("check", "--help").stdout
    assert "errors and warnings" in " ".join(invoke("run", "--help").stdout.split())


def test_inspect_counts_weights_in_constant_nodes(tmp_path: Path) -> None:
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["w"], value=weight), helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert "parameters: 16 (64 B) in 0 initializers and 1 Constant nodes" in invoke("inspect", path).stdout


def test_a_target_opset_onnx_does_not_know_is_one_plain_line(tmp_path: Path) -> None:
    result = invoke("run", mlp(tmp_path / "m.onnx"), "--target-opset", "99", "-q")
    line = one_line_error(result)
    assert "cannot convert the model to opset 99" in line and "knows opsets 1 to" in line and "Warning" not in line


def test_error_rows_of_a_batch_have_a_status(tmp_path: Path) -> None:
    models = tmp_path / "models"
    mlp(models / "good.onnx")
    (models / "bad.onnx").write_bytes(b"junk")
    result = invoke("run", models, "-o", tmp_path / "out", "--json", "-q")
    report = json.loads(result.stdout)
    jsonschema.validate(report, schema("report"))
    assert [row["status"] for row in report["models"]] == ["error", "ok"]


# -- 1: the layout problem of a model -------------------------------------------------------


def test_unwind_derives_the_layout_problem_of_a_model(corpus_dir: Path, tmp_path: Path) -> None:
    source = corpus_dir / "tf_style_nhwc.onnx"
    result = invoke("unwind", source)
    assert result.exit_code == 0, result.stderr
    assert "Transposes 28 -> 1" in result.stderr
    assert "Transposes 28 -> 0" in invoke("unwind", source, "--allow-input-relayout").stderr
    printed = invoke("unwind", source, "--problem-json")
    problem = tmp_path / "problem.json"
    problem.write_text(printed.stdout)
    solved = json.loads(invoke("unwind", problem, "--json").stdout)
    from_model = json.loads(invoke("unwind", source, "--json").stdout)
    assert solved["objective"] == from_model["objective"] and solved["upper_bound"] == from_model["upper_bound"]
    graph = tmp_path / "m.json"
    assert invoke("convert", source, graph).exit_code == 0
    converted = invoke("unwind", graph)
    assert converted.exit_code == 0, converted.stderr
    assert "Transposes 28 -> 1" in converted.stderr


def test_the_readme_lists_every_command_and_explains_layout_problems() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Commands")[1].split("\n\n")[1]
    for command in ("run", "convert", "inspect", "validate", "check", "passes", "unwind", "report merge"):
        assert f"| `graphopt {command}" in table, command
    assert "## Layout problems" in readme and "[0:16] <- x[0::3]" in readme


# -- 9: the API takes a ModelProto ----------------------------------------------------------


def test_optimize_takes_a_model_proto_and_returns_one(tmp_path: Path) -> None:
    import graphopt

    proto = onnx.load(mlp(tmp_path / "m.onnx"))
    before = proto.SerializeToString()
    result = graphopt.optimize(proto, check=False)
    assert isinstance(result.model, onnx.ModelProto)
    assert [node.op_type for node in result.model.graph.node] == ["MatMul"]
    assert proto.SerializeToString() == before  # the caller's proto is not changed
    onnx.checker.check_model(result.model)
    assert result.report["summary"]["after"]["nodes"] == 1
    assert isinstance(graphopt.optimize(graphopt.load(tmp_path / "m.onnx"), check=False).model, graphopt.ir.Model)


# -- 8: a model folder stays whole -------------------------------------------------------------


def _hf_export(folder: Path) -> Path:
    """A Hugging Face export: model.onnx with its weights in model.onnx_data, beside the
    config and tokenizer files."""
    from samples.build_samples import tiny_encoder

    folder.mkdir(parents=True)
    onnx.save(
        tiny_encoder(), folder / "model.onnx", save_as_external_data=True, location="model.onnx_data", size_threshold=0
    )
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    return folder


def test_a_model_folder_into_out_keeps_its_other_files_and_its_data_name(tmp_path: Path) -> None:
    export = _hf_export(tmp_path / "export")
    out = tmp_path / "out"
    result = invoke("run", export, "-o", out, "--external-data-name")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.onnx",
        "model.onnx_data",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    assert (out / "vocab.txt").read_text() == (export / "vocab.txt").read_text()
    locations = {
        entry.value
        for tensor in onnx.load(out / "model.onnx", load_external_data=False).graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    assert locations == {"model.onnx_data"}
    assert "copied 3 other files" in result.stderr
    again = invoke("run", export, "-o", tmp_path / "out2")
    assert again.exit_code == 0, again.stderr
    names = sorted(p.name for p in (tmp_path / "out2").iterdir())
    assert "config.json" in names and "vocab.txt" in names and "model.onnx_data" not in names
    assert any(re.fullmatch(r"model\.onnx\.[0-9a-f]{16}\.data", name) for name in names)


def test_a_folder_run_with_a_failing_model_reads_without_the_report(tmp_path: Path) -> None:
    models = tmp_path / "models"
    mlp(models / "good.onnx")
    (models / "bad.onnx").write_bytes(b"junk")
    result = invoke("run", models, "-o", tmp_path / "out")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert re.match(
        rf"\[1/2 \d+\.\ds\] {re.escape(str(models / 'bad.onnx'))}: error \(exit 2\): not a valid ONNX", lines[0]
    )
    assert re.match(
        rf"\[2/2 \d+\.\ds\] {re.escape(str(models / 'good.onnx'))}: ok, nodes 2 -> 1, numerics passed", lines[1]
    )
    assert lines[-1].startswith(f"graphopt: error: {models / 'bad.onnx'}: not a valid ONNX")
