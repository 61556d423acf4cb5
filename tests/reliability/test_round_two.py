"""Nothing lost, nothing leaked, round two: reproductions from a second fault and fuzzing campaign.

Neighbours' weights removed, corrupt weights reused, log lines forged by file names, the
files a failed run writes, links out of a folder or into a read-only cache, special files
as outputs, hangs and memory bombs, and bad input answered as an internal error. Each test
failed before its fix.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import Result
from onnx import TensorProto, helper, numpy_helper

from graphopt.evaluate import evaluator
from graphopt.ir import Model
from graphopt.numerics import inputs
from graphopt.passes.base import Pass, PassContext, PassResult, register
from tests.cli_helpers import invoke
from tests.reliability import builders
from tests.reliability.test_atomic_writes import run_model, with_external_data
from tests.reliability.test_bad_input import assert_one_line_error, snapshot

# -- 1. a neighbour's weights are never removed --------------------------------------------


def test_weights_another_model_of_the_folder_reads_are_kept(tmp_path: Path) -> None:
    """An export renamed by its user still reads model.onnx.data; writing a new model.onnx
    there (with or without an older model.onnx) must leave that file alone."""
    (tmp_path / "src").mkdir()
    source = with_external_data(tmp_path / "src")
    folder = tmp_path / "dir"
    folder.mkdir()
    exported = with_external_data(folder, scale=2.0).rename(folder / "renamed_export.onnx")
    expected = run_model(exported)
    for _ in range(2):  # first without a model.onnx, then replacing the one the first run wrote
        result = invoke("run", source, "-o", folder / "model.onnx", "--no-check", "--external-data")
        assert result.exit_code == 0, result.output
        np.testing.assert_array_equal(run_model(exported), expected)
    np.testing.assert_array_equal(run_model(folder / "model.onnx"), run_model(source))


def test_weights_the_replaced_model_and_a_neighbour_share_are_kept(tmp_path: Path) -> None:
    """model.onnx and a copy of it read one content-addressed file; replacing model.onnx
    must not remove what the copy reads (and the old model's own weights do go)."""
    folder = tmp_path / "dir"
    folder.mkdir()
    (tmp_path / "a").mkdir()
    first = with_external_data(tmp_path / "a")
    assert invoke("run", first, "-o", folder / "model.onnx", "--no-check").exit_code == 0
    shutil.copy(folder / "model.onnx", folder / "copy.onnx")
    expected = run_model(folder / "copy.onnx")
    (other_folder := tmp_path / "b").mkdir()
    other = with_external_data(other_folder, scale=3.0)
    assert invoke("run", other, "-o", folder / "model.onnx", "--no-check").exit_code == 0
    np.testing.assert_array_equal(run_model(folder / "copy.onnx"), expected)
    assert len(list(folder.glob("model.onnx.*.data"))) == 2

    # Once nothing reads the older weights, the next replacement removes them.
    (folder / "copy.onnx").unlink()
    assert invoke("run", first, "-o", folder / "model.onnx", "--no-check").exit_code == 0
    assert len(list(folder.glob("model.onnx.*.data"))) == 1


# -- 2. an existing content-addressed file is reused only when its bytes are right ----------


def test_a_corrupt_weights_file_of_the_same_name_is_written_anew(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    out = tmp_path / "out" / "model.onnx"
    assert invoke("run", source, "-o", out).exit_code == 0
    (weights,) = out.parent.glob("model.onnx.*.data")
    good = weights.read_bytes()
    weights.write_bytes(b"\x7f" * len(good))  # a bad cache restore, or a file planted by a pull request
    result = invoke("run", source, "-o", out)
    assert result.exit_code == 0, result.output
    assert weights.read_bytes() == good
    np.testing.assert_array_equal(run_model(out), run_model(source))


# -- 3. one message, one line, whatever the names say -----------------------------------------

FORGED = "\ngraphopt: all 12 models passed\n"


def _stderr_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_a_file_name_with_a_newline_cannot_forge_a_log_line(tmp_path: Path) -> None:
    bad = builders.truncated(tmp_path).rename(tmp_path / f"model{FORGED}.onnx")
    line = assert_one_line_error(invoke("run", bad, "--no-check"))
    assert "\\n" in line
    good = builders.write(builders.base_model(), tmp_path, f"good{FORGED}.onnx")
    for result in (invoke("run", good, "--no-check"), invoke("run", good, "--check-optimized")):
        assert not any(line.startswith("graphopt: all") for line in _stderr_lines(result)), result.stderr
    folder_run = invoke("run", tmp_path, "-o", tmp_path / "out", "--no-check")
    assert folder_run.exit_code == 2
    assert not any(line.startswith("graphopt: all") for line in _stderr_lines(folder_run))


def test_names_from_the_model_cannot_forge_a_log_line(tmp_path: Path) -> None:
    proto = builders.base_model()
    proto.graph.node[2].domain = f"custom{FORGED}"  # a domain the model does not import: a warning names it
    result = invoke("run", builders.write(proto, tmp_path), "--no-check")
    assert result.exit_code == 0, result.stderr
    assert any("custom\\ngraphopt" in line for line in _stderr_lines(result)), result.stderr
    assert not any(line.startswith("graphopt: all") for line in _stderr_lines(result)), result.stderr


# -- 4. what each exit code writes -------------------------------------------------------------


@register
class _Raises(Pass):
    name = "test-raises"
    description = "Raises (a pass with a bug; with --strict the run exits 3)"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        raise RuntimeError("a bug")


@pytest.mark.parametrize(
    ("code", "args", "written"),
    [
        (0, ["--passes", "cleanup"], {"out.onnx", "report.json"}),
        (1, ["--passes", "test-breaks-numerics"], {"report.json"}),  # the report says why
        (2, ["--passes", "no-such-pass"], set()),
        (3, ["--passes", "test-raises", "--strict"], set()),
    ],
)
def test_the_files_each_exit_code_leaves(tmp_path: Path, code: int, args: list[str], written: set[str]) -> None:
    (tmp_path / "in").mkdir()
    source = builders.write(builders.base_model(), tmp_path / "in")
    out = tmp_path / "out"
    result = invoke("run", source, "-o", out / "out.onnx", "--report", out / "report.json", *args)
    assert result.exit_code == code, result.output
    assert {p.name for p in out.rglob("*")} == written
    if written:
        report = json.loads((out / "report.json").read_text())
        assert report["exit_code"] == code and (report["output"] is None) == (code != 0)


def _prose(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


REPO = Path(__file__).resolve().parents[2]


def test_the_readme_says_what_each_exit_code_leaves() -> None:
    # The program's side is the test above; the README once said a failed run writes nothing.
    readme = _prose(REPO / "README.md")
    assert "the one file a failed run writes is the `--report` of a failed numerics check (exit 1)" in readme
    assert "Bad input (exit 2) and internal errors (exit 3) write nothing at all" in readme


# -- 5. the big model's memory: the README states what BENCHMARKS.md measured ----------------------


def test_the_readme_states_the_measured_peak_memory_of_the_big_model() -> None:
    import re

    readme = re.search(
        r"peaks at ([\d.]+) GB RSS with `--no-check` and ([\d.]+) GB with the check", _prose(REPO / "README.md")
    )
    benchmarks = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    alone = re.search(r"`graphopt run big\.onnx -o out/big\.onnx --no-check` \| (\d+) MB", benchmarks)
    checked = re.search(
        r"`graphopt run big\.onnx -o out/big\.onnx` \(the check at its default dims\) \| (\d+) MB", benchmarks
    )
    assert readme and alone and checked
    assert [float(readme[1]), float(readme[2])] == [round(int(alone[1]) / 1000, 2), round(int(checked[1]) / 1000, 2)]


# -- 6. a folder run stays inside its folder ---------------------------------------------------


def test_a_folder_run_skips_links_that_lead_outside_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = builders.write(builders.base_model(), outside, "secret.onnx")
    before = snapshot(outside)
    models = tmp_path / "models"
    models.mkdir()
    builders.write(builders.base_model(), models, "good.onnx")
    (models / "link.onnx").symlink_to(secret)  # a pull request can add a link: git stores them
    (models / "linked").symlink_to(outside, target_is_directory=True)
    (models / "inside.onnx").symlink_to("good.onnx")  # a link within the folder is fine

    result = invoke("run", models, "-o", tmp_path / "out", "--no-check")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").rglob("*.onnx")) == ["good.onnx", "inside.onnx"]
    assert "link.onnx" in result.stderr and "outside" in result.stderr

    assert invoke("run", models, "--in-place", "--no-check").exit_code == 0
    assert snapshot(outside) == before

    line = assert_one_line_error(invoke("run", models, "-o", tmp_path / "strict", "--no-check", "--strict"))
    assert "link.onnx" in line
    assert not (tmp_path / "strict").exists()

    # Named on the command line, a link is the user's choice.
    assert invoke("run", models / "link.onnx", "-o", tmp_path / "named.onnx", "--no-check").exit_code == 0


def test_a_folder_of_links_to_models_elsewhere_says_they_were_skipped(tmp_path: Path) -> None:
    """A folder of links made to run a selection of models: every link leads outside, and the
    refusal said "no model" and listed the models it had skipped, as if they were no models."""
    store = tmp_path / "store"
    store.mkdir()
    selection = tmp_path / "selection"
    selection.mkdir()
    for name in ("a", "b", "c", "d", "e"):
        (selection / f"{name}.onnx").symlink_to(builders.write(builders.base_model(), store, f"{name}.onnx"))

    line = assert_one_line_error(invoke("run", selection, "-o", f"{tmp_path / 'out'}/", "--no-check"))
    assert line == (
        f"graphopt: error: no model in {selection}: skipped 5 symbolic links that lead outside it "
        f"(a.onnx, b.onnx, c.onnx and 2 other links); name them on the command line to run them, "
        f"e.g. {selection}/*.onnx"
    )
    assert not (tmp_path / "out").exists()
    named = invoke("run", *sorted(selection.glob("*.onnx")), "-o", f"{tmp_path / 'out'}/", "--no-check")
    assert named.exit_code == 0, named.output
    assert len(list((tmp_path / "out").glob("*.onnx"))) == 5

    # A link further down is named by its path: the folder's own glob would not reach it.
    (selection / "onnx").mkdir()
    for link in selection.glob("*.onnx"):
        link.rename(selection / "onnx" / link.name)
    line = assert_one_line_error(invoke("run", selection, "-o", f"{tmp_path / 'nested'}/", "--no-check"))
    assert line.endswith(
        f"(onnx/a.onnx, onnx/b.onnx, onnx/c.onnx and 2 other links); name them on the command line "
        f"to run them, e.g. {selection}/onnx/a.onnx"
    ), line

    # A link to a model folder elsewhere: rglob does not enter it, and the refusal said "found no file".
    models = tmp_path / "models"
    models.mkdir()
    (models / "bert").symlink_to(store, target_is_directory=True)
    line = assert_one_line_error(invoke("run", models, "-o", f"{tmp_path / 'linked'}/", "--no-check"))
    assert line.endswith(
        f"skipped 1 symbolic link that leads outside it (bert); name them on the command line to run them, "
        f"e.g. {models}/bert"
    ), line
    linked = invoke("run", models / "bert", "-o", f"{tmp_path / 'linked'}/", "--no-check")
    assert linked.exit_code == 0, linked.output
    assert len(list((tmp_path / "linked").glob("*.onnx"))) == 5


# -- 7. --in-place does not write through a link into a read-only cache -------------------------


def test_in_place_through_a_link_to_a_read_only_file_is_refused(tmp_path: Path) -> None:
    """The DVC / git-annex layout: the model is a link to a read-only object of a
    content-addressed cache, shared by every checkout."""
    cache = tmp_path / "cache" / "files" / "md5" / "3f"
    cache.mkdir(parents=True)
    cached = builders.write(builders.base_model(), cache, "a9c1e0b2d4")
    cached.chmod(0o444)
    before = snapshot(tmp_path / "cache")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "model.onnx").symlink_to(cached)
    (checkout / "local.onnx").symlink_to(os.path.relpath(cached, checkout))
    for link in (checkout / "model.onnx", checkout / "local.onnx"):
        line = assert_one_line_error(invoke("run", link, "--in-place", "--no-check"))
        assert "read-only" in line and "-o" in line
        assert snapshot(tmp_path / "cache") == before
    assert invoke("run", checkout / "model.onnx", "-o", checkout / "opt.onnx", "--no-check").exit_code == 0


# -- 8. outputs are regular files, or absent ---------------------------------------------------


def _graphopt(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """graphopt in a process of its own, stdout a pipe; a hang fails the test instead of the suite."""
    command = [sys.executable, "-c", "from graphopt.cli import main; main()", *map(str, args)]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=environment)


def test_outputs_onto_special_files_are_refused(tmp_path: Path) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "null.onnx").symlink_to("/dev/null")
    for target in (fifo, tmp_path / "null.onnx"):
        line = assert_one_line_error(invoke("run", source, "-o", target, "--no-check"))
        assert "not a regular file" in line
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and (tmp_path / "null.onnx").is_symlink()
    for report in (fifo, "/dev/stdout"):
        result = _graphopt("run", source, "-o", tmp_path / "out.onnx", "--no-check", "--report", report)
        assert result.returncode == 2, result.stderr
        assert "not a regular file" in result.stderr and not result.stdout
    assert not (tmp_path / "out.onnx").exists()
    with (tmp_path / "stdout.txt").open("w") as stdout:  # /dev/stdout a link to a regular file: still refused
        command = [sys.executable, "-c", "from graphopt.cli import main; main()", "run", str(source), "--no-check"]
        environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
        redirected = subprocess.run(
            [*command, "--report", "/dev/stdout"], stdout=stdout, timeout=60, check=False, env=environment
        )
    assert redirected.returncode == 2 and Path("/dev/stdout").is_symlink()


def test_a_report_to_stdout_is_a_stream(tmp_path: Path) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    result = _graphopt("run", source, "-o", tmp_path / "out.onnx", "--no-check", "--report", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["output"]["path"] == str(tmp_path / "out.onnx")
    assert not (tmp_path / "-").exists()


# -- 9. hangs and memory bombs: budgets of work and bytes --------------------------------------


def _loop_over_constants(trip_count: int | None) -> onnx.ModelProto:
    """y = x + (a Loop adding 1 to a constant, ``trip_count`` times; None: until a constant
    true condition turns false, which it never does)."""
    body = helper.make_graph(
        [helper.make_node("Add", ["v_in", "one"], ["v_out"]), helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, []),
        ],
        [numpy_helper.from_array(np.array(1, np.float32), "one")],
    )
    inits = [numpy_helper.from_array(np.array(True), "cond"), numpy_helper.from_array(np.array(0, np.float32), "v0")]
    if trip_count is not None:
        inits.append(numpy_helper.from_array(np.array(trip_count, np.int64), "M"))
    loop = helper.make_node("Loop", ["M" if trip_count is not None else "", "cond", "v0"], ["v"], body=body)
    nodes = [loop, helper.make_node("Add", ["x", "v"], ["y"])]
    return builders.model(nodes, [builders.float_info("x", [4])], [builders.float_info("y", [4])], inits)


def _refusals(report: dict[str, Any]) -> list[str]:
    return [r["reason"] for run in report["passes"] for r in run["details"].get("refused", [])]


def test_a_loop_of_2_to_the_40_iterations_is_refused_not_run(tmp_path: Path) -> None:
    source = builders.write(_loop_over_constants(2**40), tmp_path)
    started = time.monotonic()
    result = _graphopt("run", source, "--no-check", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60
    assert any("work budget" in reason for reason in _refusals(json.loads(result.stdout)))


def test_a_loop_without_a_trip_count_is_stopped_at_the_time_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(evaluator, "SECONDS_BUDGET", 1.0)
    source = builders.write(_loop_over_constants(None), tmp_path)
    result = invoke("run", source, "--no-check", "--json")
    assert result.exit_code == 0, result.output
    refusals = _refusals(json.loads(result.stdout))
    assert refusals and all("time budget" in reason for reason in refusals)
    assert sum("still running" in reason for reason in refusals) == 1  # later passes do not wait again


def _npz_declaring(path: Path, shape: tuple[int, ...], payload: bytes) -> Path:
    """An .npz whose one array ``x`` declares ``shape`` (float32) in its header, followed by ``payload``."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", header.getvalue() + payload)
    return path


def test_an_npz_bomb_is_refused_before_it_is_decompressed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    # A header declaring 8 GiB over 1 MB of zeros: numpy would allocate for the header's word.
    lying = _npz_declaring(tmp_path / "lying.npz", (2**31,), bytes(1 << 20))
    line = assert_one_line_error(invoke("run", source, "--inputs", lying))
    assert str(2**33) in line and "declares" in line
    # A real bomb inflates past the limit (here lowered to 1 MB: 64 MB of zeros deflate to 64 kB).
    monkeypatch.setattr(inputs, "NPZ_BYTE_LIMIT", 1 << 20)
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, x=np.zeros((1 << 24,), np.float32))
    assert bomb.stat().st_size < 1 << 20
    line = assert_one_line_error(invoke("check", source, source, "--inputs", bomb))
    assert "decompressed" in line and str(1 << 20) in line


# -- 10. bad input is exit 2, not an internal error ----------------------------------------------


def _leaf(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "outputs": [{"name": name, "type": "float32[4]"}],
        "nodes": [{"op": "Identity", "inputs": ["x"], "outputs": [name]}],
    }


def nested_if_json(folder: Path, depth: int) -> Path:
    """A graphopt JSON graph: y = x through ``depth`` nested Ifs (each else branch a leaf)."""
    graph = _leaf("r0")
    for level in range(1, depth + 1):
        branches = {"then_branch": {"graph": graph}, "else_branch": {"graph": _leaf(f"e{level}")}}
        node = {"op": "If", "inputs": ["c"], "outputs": [f"r{level}"], "attributes": branches}
        graph = {"name": f"g{level}", "outputs": [{"name": f"r{level}", "type": "float32[4]"}], "nodes": [node]}
    graph["name"] = "main"
    graph["inputs"] = [{"name": "x", "type": "float32[4]"}, {"name": "c", "type": "bool[]"}]
    graph["outputs"][0]["name"] = "y"
    graph["nodes"][0]["outputs"] = ["y"]
    document = {"format": "graphopt-graph", "format_version": 1, "ir_version": 9, "opsets": {"": 17}, "graph": graph}
    path = folder / "nested.json"
    path.write_text(json.dumps(document))
    return path


def deep_json_value(folder: Path) -> Path:
    path = builders.json_graph(lambda d: None)(folder)
    text = path.read_text()
    path.write_text(text[:-1] + ', "doc_string": ' + "[" * 1000 + "]" * 1000 + "}")
    return path


def long_location(folder: Path) -> Path:
    path = with_external_data(folder)
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "w" * 300  # one name longer than any file system allows
    path.write_bytes(proto.SerializeToString())
    return path


def truncated_sidecar(folder: Path) -> Path:
    source = with_external_data(folder)
    assert invoke("convert", source, folder / "model.json").exit_code == 0
    (sidecar,) = folder.glob("model.*.npy")
    sidecar.write_bytes(sidecar.read_bytes()[:200])
    return folder / "model.json"


@pytest.mark.parametrize(
    "build",
    [long_location, truncated_sidecar, lambda folder: nested_if_json(folder, 60), deep_json_value],
    ids=["location too long", "truncated .npy sidecar", "If nested 60 deep", "JSON nested 1000 deep"],
)
def test_bad_input_that_was_an_internal_error(tmp_path: Path, build: Any) -> None:
    source = build(tmp_path)
    before = snapshot(tmp_path)
    assert_one_line_error(invoke("run", source, "-o", tmp_path / "out.onnx", "--no-check"))
    assert_one_line_error(invoke("inspect", source))
    assert snapshot(tmp_path) == before
