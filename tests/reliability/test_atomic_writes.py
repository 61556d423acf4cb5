"""Writes are all or nothing: staged in a temporary folder, checked, renamed into place.

A failure at any point of the save or of the move leaves the destination as it was (no
partial model, no orphaned .data, no temporary file); the input is overwritten only with
--in-place, and then model and .data are replaced together; a model written with external
data matches its .data file (onnxruntime runs it, the report's sha256 are the files').
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphopt.io import onnx_write
from tests.cli_helpers import BreaksNumerics, invoke
from tests.reliability import builders
from tests.reliability.test_bad_input import snapshot


def with_external_data(folder: Path, name: str = "model.onnx", scale: float = 1.0) -> Path:
    """The base model widened to 64 features (its weight times ``scale``), its weights in ``name``.data."""
    proto = builders.base_model(scale * np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64))
    for info in (proto.graph.input[0], proto.graph.output[0]):
        info.type.tensor_type.shape.dim[1].dim_value = 64
    proto.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.ones(64, np.float32), "b"))
    # Read by nothing: dce drops it, so the optimized .data differs from the original's.
    proto.graph.initializer.insert(0, onnx.numpy_helper.from_array(np.full(512, 7, np.float32), "unused"))
    path = folder / name
    onnx.save(proto, path, save_as_external_data=True, location=f"{name}.data", size_threshold=0)
    return path


def run_model(path: Path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    x = np.random.default_rng(0).standard_normal((3, session.get_inputs()[0].shape[1])).astype(np.float32)
    return np.asarray(session.run(None, {name: x})[0])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fail_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, after: int) -> None:
    """Make ``owner.name`` work ``after`` times, then raise: a disk that fills up mid-write."""
    original = getattr(owner, name)
    calls = [0]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise OSError(28, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)


@pytest.mark.parametrize(
    ("owner", "name", "after", "external"),
    [
        (onnx_write._Writer, "node", 2, False),  # while building the protobuf
        (onnx_write._ExternalWriter, "write", 0, True),  # with the .data file open
        (os, "replace", 0, False),  # the first rename of the save
        (os, "replace", 1, True),  # the .data is written, the model is not
    ],
)
def test_a_failure_during_save_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, owner: Any, name: str, after: int, external: bool
) -> None:
    source = with_external_data(tmp_path)
    before = snapshot(tmp_path)
    fail_on_call(monkeypatch, owner, name, after)
    flag = "--external-data" if external else "--no-external-data"
    result = invoke("run", source, "-o", tmp_path / "out" / "model.onnx", flag)
    assert result.exit_code == 3, result.stderr
    assert "No space left" in result.stderr and "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before


def fail_renaming_onto(monkeypatch: pytest.MonkeyPatch, folder: Path, suffix: str) -> None:
    """Make the renames onto files of ``folder`` whose name ends with ``suffix`` fail."""
    original = os.replace

    def flaky(source: Any, destination: Any) -> None:
        if Path(destination).parent == folder and str(destination).endswith(suffix):
            raise OSError(28, "No space left on device")
        original(source, destination)

    monkeypatch.setattr(os, "replace", flaky)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("failing", [".onnx", ".data"])
def test_a_failure_while_moving_into_place_keeps_the_old_model_and_data(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, in_place: bool, failing: str
) -> None:
    source = with_external_data(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with_external_data(out)  # an earlier output, to be replaced
    before = snapshot(tmp_path)
    destination = tmp_path if in_place else out
    fail_renaming_onto(monkeypatch, destination, failing)
    where = ["--in-place"] if in_place else ["-o", out / "model.onnx"]
    result = invoke("run", source, *where, "--external-data")
    assert result.exit_code == 3 and "No space left" in result.stderr
    assert ".graphopt-" not in result.stderr  # the message names the user's file
    assert snapshot(tmp_path) == before


def test_in_place_replaces_model_and_data_together(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    reference = tmp_path / "reference"
    reference.mkdir()
    expected = run_model(with_external_data(reference))
    result = invoke("run", source, "--in-place", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    data = Path(report["output"]["external_data"]["path"])
    # The new weights have a new, content-addressed name; the old ones are gone.
    assert data.name.startswith("model.onnx.") and data.name != "model.onnx.data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", data.name, "reference"]
    assert report["output"]["path"] == str(source) and report["numerics"]["status"] == "passed"
    assert report["output"]["sha256"] == sha256(source)
    assert report["output"]["external_data"]["sha256"] == sha256(data)
    assert report["input"]["sha256"] != report["output"]["sha256"]
    assert len(onnx.load(str(source)).graph.node) < 6
    np.testing.assert_allclose(run_model(source), expected, rtol=1e-6)


def test_without_in_place_the_input_is_never_overwritten(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    (tmp_path / "link.onnx").symlink_to(source)
    before = snapshot(tmp_path)
    for target in (source, tmp_path / "link.onnx", tmp_path / "." / "model.onnx"):
        result = invoke("run", source, "-o", target)
        assert result.exit_code == 2 and "--in-place" in result.stderr
    result = invoke("run", tmp_path, "-o", tmp_path, "--json")  # a folder onto itself
    assert result.exit_code == 2
    assert all("refusing to overwrite" in row["error"] for row in json.loads(result.stdout)["models"])
    assert snapshot(tmp_path) == before


def _model_with_a_64x64_weight() -> onnx.ModelProto:
    proto = builders.base_model(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64))
    for info in (proto.graph.input[0], proto.graph.output[0]):
        info.type.tensor_type.shape.dim[1].dim_value = 64
    proto.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.ones(64, np.float32), "b"))
    return proto


def test_external_data_output_matches_its_model_and_the_report(tmp_path: Path) -> None:
    # The weight is over the 1 KiB threshold, so --external-data has something to move out.
    source = builders.write(_model_with_a_64x64_weight(), tmp_path)
    out = tmp_path / "out" / "model.onnx"
    for flag in ("--external-data", "--no-external-data"):
        result = invoke("run", source, "-o", out, flag, "--json")
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout)["output"]
        assert report["sha256"] == sha256(out)
        np.testing.assert_allclose(run_model(out), run_model(source), rtol=1e-6)
        if flag == "--external-data":
            data = out.parent / f"model.onnx.{report['external_data']['sha256'][:16]}.data"
            assert report["external_data"] == {"path": str(data), "sha256": sha256(data), "bytes": data.stat().st_size}
        else:  # the .data of the previous run no longer belongs to any model
            assert "external_data" not in report and not data.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx"]


def test_json_output_keeps_its_sidecars(tmp_path: Path) -> None:
    source = builders.write(_model_with_a_64x64_weight(), tmp_path)
    as_json = tmp_path / "model.json"
    assert invoke("convert", source, as_json).exit_code == 0
    out = tmp_path / "out" / "model.json"
    result = invoke("run", as_json, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["numerics"]["status"] == "passed"
    back = tmp_path / "back.onnx"
    assert invoke("convert", out, back).exit_code == 0  # every sidecar it names is there
    np.testing.assert_allclose(run_model(back), run_model(source), rtol=1e-6)


def test_a_failed_check_leaves_no_new_folder(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    before = snapshot(tmp_path)
    result = invoke("run", source, "-o", tmp_path / "new" / "deeper" / "out.onnx", "--passes", BreaksNumerics.name)
    assert result.exit_code == 1, result.stderr
    assert snapshot(tmp_path) == before
    assert invoke("run", source, "--in-place", "--passes", BreaksNumerics.name).exit_code == 1
    assert snapshot(tmp_path) == before
