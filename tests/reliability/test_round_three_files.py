"""Nothing lost, nothing planted, round three: what graphopt writes and what it keeps.

Reproductions from the third campaign (issue 40, N1-N3, N6, N7, N13, N17): weights planted
by a file of the input folder, weights replaced under a kept name, `report merge -o`
without `run`'s guards, weights removed while a copy of their model still reads them,
companions of two folders on one name, a link to a hidden file copied out, and the
partial copy a kill left behind. Each test failed before its fix.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import external_data_helper, numpy_helper

from graphopt.io.json_io import sidecar_locations
from tests.cli_helpers import error_lines, invoke, mlp
from tests.reliability import builders
from tests.reliability.test_atomic_writes import run_model, with_external_data
from tests.reliability.test_bad_input import assert_one_line_error, snapshot


def only_error(result: object, code: int = 2) -> str:
    """The one `graphopt: error:` line of a folder run that exited ``code`` (its table aside)."""
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = error_lines(result)  # type: ignore[arg-type]
    assert len(lines) == 1, result.stderr
    assert ".graphopt-" not in lines[0] and "Traceback" not in result.stderr
    return lines[0]


# -- N1: a file of the input folder named as the output's weights -------------------------


def test_a_file_named_as_the_outputs_weights_is_not_planted(tmp_path: Path) -> None:
    """The output's weights name is predictable (`model.onnx.<hash>.data`): a file of that
    name in the input folder, copied along with config.json, must not become the weights
    the written model reads."""
    (folder := tmp_path / "a").mkdir()
    source = with_external_data(folder)
    (folder / "config.json").write_text("{}")
    assert invoke("run", folder, "-o", f"{tmp_path / 'probe'}/", "--no-check").exit_code == 0
    (weights,) = (tmp_path / "probe").glob("model.onnx.*.data")
    planted = folder / weights.name
    planted.write_bytes(weights.read_bytes()[::-1])  # the same size, other numbers
    out = tmp_path / "out"
    line = only_error(invoke("run", folder, "-o", f"{out}/", "--no-check"))
    assert str(planted) in line and str(out / weights.name) in line
    assert not (out / "model.onnx").exists() or np.array_equal(run_model(out / "model.onnx"), run_model(source))


# -- N2: --external-data-name --------------------------------------------------------------


def sharing_weights(folder: Path, names: list[str], location: str = "shared.bin") -> list[Path]:
    """Models (one weight scaled 1, 2, ...) that all read their weights from one file."""
    paths, offset, payload = [], 0, b""
    for scale, name in enumerate(names, start=1):
        proto = builders.base_model(scale * np.arange(16, dtype=np.float32).reshape(4, 4))
        for tensor in proto.graph.initializer:
            raw = numpy_helper.to_array(tensor).tobytes()
            external_data_helper.set_external_data(tensor, location, offset, len(raw))
            tensor.data_location = onnx.TensorProto.EXTERNAL
            tensor.ClearField("float_data")
            tensor.ClearField("raw_data")
            payload, offset = payload + raw, offset + len(raw)
        paths.append(builders.write(proto, folder, name))
    (folder / location).write_bytes(payload)
    return paths


def test_two_models_of_a_folder_keeping_one_weights_name_are_refused(tmp_path: Path) -> None:
    (folder := tmp_path / "a").mkdir()
    sharing_weights(folder, ["m1.onnx", "m2.onnx"])
    out = tmp_path / "out"
    line = only_error(invoke("run", folder, "-o", f"{out}/", "--external-data-name", "--no-check"))
    assert str(out / "shared.bin") in line and "m1.onnx" in line and "m2.onnx" in line
    assert not out.exists()


def test_a_kept_weights_name_never_replaces_what_another_model_reads(tmp_path: Path) -> None:
    (src := tmp_path / "src").mkdir()
    source = with_external_data(src)  # reads model.onnx.data
    (dst := tmp_path / "dst").mkdir()
    other = with_external_data(dst, scale=2.0).rename(dst / "other.onnx")  # reads model.onnx.data too
    expected, before = run_model(other), snapshot(dst)
    result = invoke("run", source, "-o", dst / "m.onnx", "--external-data-name", "--no-check")
    line = assert_one_line_error(result)
    assert str(dst / "model.onnx.data") in line and str(other) in line
    assert snapshot(dst) == before
    np.testing.assert_array_equal(run_model(other), expected)


@pytest.mark.parametrize("check", ["--no-check", "--check"])
@pytest.mark.parametrize("clash", ["the output model", "the report"])
def test_a_kept_weights_name_that_is_another_output_is_refused(tmp_path: Path, clash: str, check: str) -> None:
    """The input reads its weights from weights.onnx: kept, that name would be the model or
    the report written beside it (an unloadable model at exit 0; a staging path in the
    check's error)."""
    (src := tmp_path / "src").mkdir()
    source = with_external_data(src)
    proto = onnx.load(str(source))
    onnx.save(proto, str(source), save_as_external_data=True, location="weights.onnx", size_threshold=0)
    (src / "model.onnx.data").unlink()
    dst = tmp_path / "dst"
    if clash == "the output model":
        args: list[str | Path] = ["-o", dst / "weights.onnx"]
    else:
        args = ["-o", dst / "m.onnx", "--report", dst / "weights.onnx"]
    line = assert_one_line_error(invoke("run", source, *args, "--external-data-name", check))
    assert line.count(str(dst / "weights.onnx")) >= 2 and ".graphopt-" not in line
    assert not dst.exists()


@pytest.mark.parametrize("keep", [True, False], ids=["kept name", "content-addressed"])
def test_a_folder_runs_report_never_takes_a_weights_name(tmp_path: Path, keep: bool) -> None:
    (folder := tmp_path / "a").mkdir()
    with_external_data(folder)
    out = tmp_path / "out"
    if keep:
        args: list[str | Path] = ["--external-data-name", "--report", out / "model.onnx.data"]
    else:
        assert invoke("run", folder, "-o", f"{tmp_path / 'probe'}/", "--no-check").exit_code == 0
        (weights,) = (tmp_path / "probe").glob("model.onnx.*.data")
        args = ["--report", out / weights.name]
    line = only_error(invoke("run", folder, "-o", f"{out}/", "--no-check", *args))
    assert str(args[-1]) in line and not (out / "model.onnx").exists()


# -- N3: report merge -o --------------------------------------------------------------------


def a_report(tmp_path: Path) -> Path:
    (folder := tmp_path / "models").mkdir()
    mlp(folder / "m.onnx")
    report = tmp_path / "shard.json"
    assert invoke("run", folder, "-o", f"{tmp_path / 'out'}/", "--no-check", "--report", report).exit_code == 0
    return report


def _text(path: Path) -> Path:
    path.write_text("my notes\n")
    return path


def _model(path: Path) -> Path:
    return mlp(path)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    (path / "kept.txt").write_text("kept")
    return path


@pytest.mark.parametrize("make", [_text, _model, _fifo, _folder], ids=["a text file", "a model", "a FIFO", "a folder"])
def test_report_merge_writes_only_reports(tmp_path: Path, make: object) -> None:
    report = a_report(tmp_path)
    (place := tmp_path / "place").mkdir()
    target = make(place / "target.json")  # type: ignore[operator]
    kind = stat.S_IFMT(target.lstat().st_mode)
    before = snapshot(place) if kind != stat.S_IFIFO else None  # reading a FIFO would block
    line = assert_one_line_error(invoke("report", "merge", report, "-o", target))
    assert str(target) in line
    assert stat.S_IFMT(target.lstat().st_mode) == kind
    if before is not None:
        assert snapshot(place) == before


def test_report_merge_does_not_replace_its_own_input(tmp_path: Path) -> None:
    report = a_report(tmp_path)
    before = report.read_bytes()
    assert_one_line_error(invoke("report", "merge", report, "-o", report))
    assert report.read_bytes() == before
    # An earlier merged report is replaced, as --report replaces an earlier report.
    merged = tmp_path / "all.json"
    for _ in range(2):
        assert invoke("report", "merge", report, "-o", merged).exit_code == 0
    assert merged.read_bytes().startswith(b'{\n  "graphopt_version": ')


@pytest.mark.parametrize("make", [_text, _fifo, _folder], ids=["a text file", "a FIFO", "a folder"])
def test_convert_writes_only_models(tmp_path: Path, make: object) -> None:
    source = mlp(tmp_path / "m.onnx")
    (place := tmp_path / "place").mkdir()
    target = make(place / "target")  # type: ignore[operator]
    kind = stat.S_IFMT(target.lstat().st_mode)
    line = assert_one_line_error(invoke("convert", source, target))
    assert str(target) in line and stat.S_IFMT(target.lstat().st_mode) == kind


def test_convert_never_replaces_weights_another_model_reads(tmp_path: Path) -> None:
    (src := tmp_path / "src").mkdir()
    source = with_external_data(src)
    (dst := tmp_path / "dst").mkdir()
    other = with_external_data(dst, scale=2.0).rename(dst / "other.onnx")  # reads model.onnx.data
    expected = run_model(other)
    line = assert_one_line_error(invoke("convert", source, dst / "model.onnx", "--external-data"))
    assert str(dst / "model.onnx.data") in line and str(other) in line
    np.testing.assert_array_equal(run_model(other), expected)


# -- N6: weights kept for every file that reads them ---------------------------------------


@pytest.mark.parametrize("copy_name", ["model.onnx.bak", "model_v1", "model.onnx.orig"])
def test_weights_a_copy_of_the_model_reads_are_kept(tmp_path: Path, copy_name: str) -> None:
    (a := tmp_path / "a").mkdir()
    (b := tmp_path / "b").mkdir()
    first, second = with_external_data(a), with_external_data(b, scale=3.0)
    dst = tmp_path / "dst"
    assert invoke("run", first, "-o", dst / "model.onnx", "--no-check").exit_code == 0
    copy = dst / copy_name
    shutil.copy(dst / "model.onnx", copy)  # `cp model.onnx model.onnx.bak`
    expected = run_model(copy)
    assert invoke("run", second, "-o", dst / "model.onnx", "--no-check").exit_code == 0
    np.testing.assert_array_equal(run_model(copy), expected)
    np.testing.assert_array_equal(run_model(dst / "model.onnx"), run_model(second))


def test_sidecars_a_copy_of_a_json_graph_reads_are_kept(tmp_path: Path) -> None:
    (a := tmp_path / "a").mkdir()
    (b := tmp_path / "b").mkdir()
    first, second = with_external_data(a), with_external_data(b, scale=3.0)
    dst = tmp_path / "dst"
    assert invoke("run", first, "-o", dst / "model.json", "--no-check").exit_code == 0
    copy = dst / "model.json.orig"
    shutil.copy(dst / "model.json", copy)
    read = sidecar_locations(copy)
    assert read
    before = {name: (dst / name).read_bytes() for name in read}
    assert invoke("run", second, "-o", dst / "model.json", "--no-check").exit_code == 0
    assert {name: (dst / name).read_bytes() for name in read} == before


def test_a_copied_file_never_replaces_what_a_model_of_the_output_folder_reads(tmp_path: Path) -> None:
    (folder := tmp_path / "m").mkdir()
    mlp(folder / "model.onnx")
    (folder / "shared.bin").write_bytes(b"not weights")
    (out := tmp_path / "out").mkdir()
    (reader,) = sharing_weights(out, ["other.onnx"])  # out/other.onnx reads out/shared.bin
    expected = run_model(reader)
    line = only_error(invoke("run", folder, "-o", f"{out}/", "--no-check"))
    assert str(out / "shared.bin") in line and str(reader) in line
    np.testing.assert_array_equal(run_model(reader), expected)


# -- N13: companions of two input folders on one name ---------------------------------------


def test_companions_of_two_folders_on_one_name_are_refused(tmp_path: Path) -> None:
    for name, model in (("a", "m1.onnx"), ("b", "m2.onnx")):
        mlp(tmp_path / name / model)
        (tmp_path / name / "config.json").write_text(f'{{"model": "{name}"}}')
    out = tmp_path / "out"
    line = only_error(invoke("run", tmp_path / "a", tmp_path / "b", "-o", f"{out}/", "--no-check"))
    assert str(tmp_path / "a" / "config.json") in line and str(tmp_path / "b" / "config.json") in line
    assert not out.exists()


# -- N7: a visible link to a hidden file ----------------------------------------------------


def test_a_link_to_a_hidden_file_is_not_copied(tmp_path: Path) -> None:
    (folder := tmp_path / "m").mkdir()
    mlp(folder / "model.onnx")
    (folder / ".env").write_text("TOKEN=secret\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "config").write_text("[credential] secret\n")
    (folder / "notes.txt").symlink_to(".env")
    (folder / "settings.txt").symlink_to(".git/config")
    (folder / "vocab.txt").write_text("a b c\n")
    out = tmp_path / "out"
    assert invoke("run", folder, "-o", f"{out}/", "--no-check").exit_code == 0
    assert sorted(p.name for p in out.rglob("*")) == ["model.onnx", "vocab.txt"]


# -- N17: the partial copy a kill leaves ----------------------------------------------------

_KILLED_WHILE_COPYING = """
import os, shutil, signal, sys
from graphopt.cli import cli
def killed(source, target, *args, **kwargs):
    target.write(source.read(8))
    target.flush()
    os.kill(os.getpid(), signal.SIGKILL)
shutil.copyfileobj = killed
cli.main(args=sys.argv[1:])
"""


def test_a_partial_copy_of_a_killed_run_is_removed_by_the_next(tmp_path: Path) -> None:
    (folder := tmp_path / "m").mkdir()
    mlp(folder / "model.onnx")
    (folder / "vocab.txt").write_text("a b c\n" * 100)
    out = tmp_path / "out"
    out.mkdir()
    mine = out / ".vocab.txt.mine"  # a hidden file of the user's is never graphopt's to remove
    mine.write_text("mine")
    args = ["run", str(folder), "-o", f"{out}/", "--no-check"]
    killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_COPYING, *args], capture_output=True, check=False)
    assert killed.returncode == -9, killed.stderr
    assert invoke(*args).exit_code == 0
    assert sorted(p.name for p in out.rglob("*") if p.name.startswith(".")) == [mine.name]
    assert (out / "vocab.txt").read_text() == "a b c\n" * 100
