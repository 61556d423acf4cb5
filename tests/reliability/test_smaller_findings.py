"""The smaller findings of the node-suite campaign (issue 28, item 5), each a test that failed before its fix.

Kills that leave a report beside a model it does not describe, or leftovers no later run
removes; external data dropped from an output; staging paths in messages; special files
reported as missing; a kernel folder as an output; deep If nesting; a file that is not a
model overwritten by -o.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphopt import files
from graphopt.io import wire as onnx_wire
from graphopt.ir import Model
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.runner import file_digest
from graphopt.writer import check_report_output
from tests.cli_helpers import invoke
from tests.reliability import builders
from tests.reliability.test_atomic_writes import with_external_data
from tests.reliability.test_bad_input import assert_one_line_error, snapshot
from tests.reliability.test_crash_consistency import KILLED, run_killed_at
from tests.reliability.test_round_two import nested_if_json

# -- a kill between the model's rename and the report's ----------------------------------------


def test_a_report_on_disk_always_describes_the_model_beside_it(tmp_path: Path) -> None:
    """Killed at every file operation of a run replacing model and report: a report that is
    there names the sha256 of the model that is there (the old pair, the new, or no report)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = with_external_data(tmp_path / "a"), with_external_data(tmp_path / "b", scale=2.0)
    out, report = tmp_path / "out" / "model.onnx", tmp_path / "out" / "report.json"
    assert invoke("run", first, "-o", out, "--report", report, "--no-check").exit_code == 0
    operation = 1
    while True:
        status = run_killed_at(operation, ["run", str(second), "-o", str(out), "--report", str(report), "--no-check"])
        if report.exists():
            assert json.loads(report.read_text())["output"]["sha256"] == file_digest(out), operation
        if status != KILLED:
            break
        operation += 1
    assert status == 0 and report.exists()


# -- kills leave nothing that outlives the next run ------------------------------------------------


def _die_in_a_child(action: object) -> None:
    """Run ``action`` in a forked child that dies on the spot (as with kill -9) where ``action`` says."""
    pid = os.fork()
    if pid == 0:
        try:
            action()  # type: ignore[operator]
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_a_staging_folder_killed_before_it_was_marked_is_removed_by_the_next_run(tmp_path: Path) -> None:
    def killed_while_marking() -> None:
        Path.write_text = lambda *a, **k: os._exit(KILLED)  # type: ignore[method-assign,assignment]
        with files.staging_folder(tmp_path):
            pass

    _die_in_a_child(killed_while_marking)
    assert [p.name.startswith(files.STAGING_PREFIX) for p in tmp_path.iterdir()] in ([True], [])
    files.remove_stale_staging(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_report_folder_probe_leaves_nothing_when_killed(tmp_path: Path) -> None:
    def killed_while_probing() -> None:
        os.unlink = lambda *a, **k: os._exit(KILLED)  # type: ignore[assignment]
        os.close = lambda *a, **k: os._exit(KILLED)  # type: ignore[assignment]
        check_report_output(tmp_path / "r.json", [])

    _die_in_a_child(killed_while_probing)
    assert list(tmp_path.iterdir()) == []


# -- the output keeps external data when the input had it ----------------------------------------


def test_external_data_is_kept_when_every_weight_was_rewritten(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    out = tmp_path / "out" / "model.onnx"
    result = invoke("run", source, "-o", out, "--passes", "test-breaks-numerics", "--no-check")
    assert result.exit_code == 0, result.output
    assert len(list(out.parent.glob("model.onnx.*.data"))) == 1
    proto = onnx.load(str(out), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


# -- no staging path in a numerics failure ---------------------------------------------------------


@register
class _Unloadable(Pass):
    name = "test-unloadable"
    description = "Turns a Relu into an op of a domain onnxruntime does not know (a broken rewrite)"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        relu = next(n for n in model.graph if n.op_type == "Relu")
        relu.op_type, relu.domain = "Mystery", "test.mystery"
        model.opset_imports["test.mystery"] = 1
        return PassResult(True)


def test_a_numerics_failure_names_no_staging_path(tmp_path: Path) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    result = invoke("run", source, "-o", tmp_path / "out.onnx", "--passes", "test-unloadable", "--json")
    assert result.exit_code == 1, result.output
    assert files.STAGING_PREFIX not in result.stderr
    assert files.STAGING_PREFIX not in json.dumps(json.loads(result.stdout)["numerics"])


# -- special files where the weights should be --------------------------------------------------


@pytest.mark.parametrize("kind", ["FIFO", "folder", "character device"])
def test_weights_that_are_not_a_regular_file_are_named_so(tmp_path: Path, kind: str) -> None:
    source = with_external_data(tmp_path)
    weights = tmp_path / "model.onnx.data"
    weights.unlink()
    if kind == "FIFO":
        os.mkfifo(weights)
    elif kind == "folder":
        weights.mkdir()
    else:
        weights.symlink_to("/dev/zero")  # a link: refused as one; a device node needs mknod
        weights.unlink()
        try:
            os.mknod(weights, 0o600 | 0o020000, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("no permission to make a device node")
    line = assert_one_line_error(invoke("run", source, "--no-check"))
    assert "missing" not in line and kind in line


# -- an output in a kernel folder ------------------------------------------------------------------


def test_an_output_in_proc_is_bad_usage(tmp_path: Path) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    line = assert_one_line_error(invoke("run", source, "-o", "/proc/x.onnx", "--no-check"))
    assert "/proc" in line


# -- a model nested 40 Ifs deep ----------------------------------------------------------------------


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, written by hand: protobuf's own builders stop at 100 levels."""
    return onnx_wire.length_field(number, payload)


def _graph(name: str, nodes: list[bytes], outputs: list[str], inputs: list[onnx.ValueInfoProto]) -> bytes:
    infos = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [4]) for o in outputs]
    return helper.make_graph([], name, inputs, infos).SerializeToString() + b"".join(_field(1, n) for n in nodes)


def nested_if_onnx(folder: Path, depth: int) -> Path:
    """y = x through ``depth`` nested Ifs (each else branch one Identity), as the bytes of an ONNX file."""

    def identity(out: str) -> bytes:
        return helper.make_node("Identity", ["x"], [out]).SerializeToString()

    graph = _graph("leaf", [identity("r0")], ["r0"], [])
    for level in range(1, depth + 1):
        out = "y" if level == depth else f"r{level}"
        node = helper.make_node("If", ["c"], [out]).SerializeToString()
        for name, branch in (
            ("then_branch", graph),
            ("else_branch", _graph(f"e{level}", [identity(f"e{level}")], [f"e{level}"], [])),
        ):
            attribute = onnx.AttributeProto(name=name, type=onnx.AttributeProto.GRAPH).SerializeToString()
            node += _field(5, attribute + _field(6, branch))
        graph = _graph(f"g{level}", [node], [out], [])
    inputs = [builders.float_info("x", [4]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])]
    main = _graph("main", [node], ["y"], inputs)
    head = helper.make_model(
        helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid("", 17)], ir_version=9
    )
    head.ClearField("graph")
    path = folder / f"nested{depth}.onnx"
    path.write_bytes(head.SerializeToString() + _field(7, main))
    return path


def test_ifs_nested_as_deep_as_onnx_files_go_run_and_deeper_ones_are_named(tmp_path: Path) -> None:
    """31 nested subgraphs is the most onnx and onnxruntime parse (100 protobuf levels); 40 is
    refused by them too, and graphopt says why instead of calling the file invalid."""
    deepest = nested_if_onnx(tmp_path, 31)
    result = invoke("run", deepest, "-o", tmp_path / "out.onnx")
    assert result.exit_code == 0, result.output
    line = assert_one_line_error(invoke("run", nested_if_onnx(tmp_path, 40), "--no-check"))
    assert "nested" in line and "not a valid ONNX protobuf" not in line
    (tmp_path / "json").mkdir()
    line = assert_one_line_error(invoke("run", nested_if_json(tmp_path / "json", 40), "-o", tmp_path / "j.onnx"))
    assert "nested" in line and files.STAGING_PREFIX not in line


# -- -o onto a file that is not a model ---------------------------------------------------------------


def test_o_onto_a_file_that_is_not_a_model_is_refused(tmp_path: Path) -> None:
    source = builders.write(builders.base_model(), tmp_path)
    notes = tmp_path / "NOTES"
    notes.write_text("release notes, not a model\n")
    before = snapshot(tmp_path)
    line = assert_one_line_error(invoke("run", source, "-o", notes, "--no-check"))
    assert "not an ONNX model" in line
    assert snapshot(tmp_path) == before
    # An earlier output of the same name is a model: replaced as usual.
    assert invoke("run", source, "-o", tmp_path / "model_opt", "--no-check").exit_code == 0
    assert invoke("run", source, "-o", tmp_path / "model_opt", "--no-check").exit_code == 0
    np.testing.assert_allclose(run_model_plain(tmp_path / "model_opt"), run_model_plain(source), rtol=1e-6)


def run_model_plain(path: Path) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    return np.asarray(session.run(None, {"x": x})[0])
