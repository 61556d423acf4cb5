"""Nothing lost, nothing leaked: the user's files survive every run that does not mean to replace them.

Each test is a reproduction from a fault-injection campaign (issue 19): a report written over
the input, an output that took the input's weights file, a report that failed after the
model was already replaced, staging folders taken for models, --in-place breaking a link or
a read-only mode, permission problems reported as internal errors naming graphopt's own
temporary paths, error messages of megabytes, negative declared dims. Permission failures
are simulated by patching the calls (the suite may run as root, which no chmod stops).
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from graphopt import files
from graphopt.errors import MESSAGE_LIMIT
from graphopt.runner import RunOptions, optimize_file
from tests.cli_helpers import invoke
from tests.reliability import builders
from tests.reliability.test_atomic_writes import (
    _model_with_a_64x64_weight,
    fail_renaming_onto,
    run_model,
    with_external_data,
)
from tests.reliability.test_bad_input import assert_one_line_error, snapshot

# -- 1. --report never replaces a model ---------------------------------------------------


def test_a_report_naming_the_input_or_the_output_is_refused(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    second = builders.write(builders.base_model(), tmp_path, "second.onnx")
    out = tmp_path / "out.onnx"
    before = snapshot(tmp_path)
    for report in (source, out, tmp_path / "model.onnx.data"):
        line = assert_one_line_error(invoke("run", source, "-o", out, "--report", report))
        assert str(report) in line
    assert_one_line_error(invoke("run", source, "--check-optimized", "--report", source))
    assert_one_line_error(invoke("run", source, second, "-o", tmp_path / "outs", "--report", second))
    assert_one_line_error(
        invoke("run", source, second, "-o", tmp_path / "outs", "--report", tmp_path / "outs" / "second.onnx")
    )
    assert snapshot(tmp_path) == before


def test_the_report_is_written_with_the_model_and_may_replace_an_earlier_report(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    out, report = tmp_path / "out" / "model.onnx", tmp_path / "reports" / "report.json"
    for _ in range(2):
        result = invoke("run", source, "-o", out, "--report", report, "--json")
        assert result.exit_code == 0, result.stderr
        assert json.loads(report.read_text()) == json.loads(result.stdout)
    assert json.loads(report.read_text())["output"]["path"] == str(out)


# -- 2. every write checked against every read ------------------------------------------------


def renamed_export(folder: Path) -> Path:
    """An exported model renamed: orig.onnx, its weights still in model.onnx.data."""
    return with_external_data(folder).rename(folder / "orig.onnx")


@pytest.mark.parametrize("flag", ["--external-data", "--no-external-data"])
def test_an_output_named_like_the_inputs_weights_leaves_them(tmp_path: Path, flag: str) -> None:
    """model.onnx.data belongs to orig.onnx, not to the new model.onnx: it stays (issue 27.1)."""
    source = renamed_export(tmp_path)
    expected = run_model(source)
    weights = (tmp_path / "model.onnx.data").read_bytes()
    result = invoke("run", source, "-o", tmp_path / "model.onnx", flag)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "model.onnx.data").read_bytes() == weights
    np.testing.assert_array_equal(run_model(source), expected)
    np.testing.assert_allclose(run_model(tmp_path / "model.onnx"), expected, rtol=1e-6)


def test_clashes_are_found_through_symbolic_links(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    source = renamed_export(models)
    (tmp_path / "alias").symlink_to(models)
    before = snapshot(models)
    assert_one_line_error(invoke("run", source, "-o", tmp_path / "alias" / "model.onnx.data"))
    assert_one_line_error(
        invoke("run", source, "-o", tmp_path / "x.onnx", "--report", tmp_path / "alias" / "orig.onnx")
    )
    assert snapshot(models) == before


def test_the_sidecars_a_json_input_reads_are_not_replaced(tmp_path: Path) -> None:
    source = builders.write(_model_with_a_64x64_weight(), tmp_path, "export.onnx")
    assert invoke("convert", source, tmp_path / "model.json").exit_code == 0
    renamed = (tmp_path / "model.json").rename(tmp_path / "a.json")  # still reads model.0.npy
    sidecar = (tmp_path / "model.0.npy").read_bytes()
    # The new model.json's sidecars are named after their contents, never model.0.npy.
    assert invoke("run", renamed, "-o", tmp_path / "model.json").exit_code == 0
    assert (tmp_path / "model.0.npy").read_bytes() == sidecar
    assert invoke("run", renamed, "-o", tmp_path / "again.json").exit_code == 0  # a.json still loads


def test_a_folder_run_never_removes_or_replaces_what_another_of_its_models_reads(tmp_path: Path) -> None:
    """Two exports sharing one weights file (the second a renamed copy): rewriting the first
    in place would remove the weights the second reads; an output landing on another input
    of the run would replace it before that input's own turn."""
    shared = tmp_path / "shared"
    shared.mkdir()
    source = with_external_data(shared, "model.onnx")
    (shared / "z_copy.onnx").write_bytes(source.read_bytes())  # reads model.onnx.data too, and runs second
    expected = run_model(source)
    result = invoke("run", shared, "--in-place", "--no-check")
    assert result.exit_code == 0, result.output  # model.onnx.data stays: z_copy.onnx reads it
    for name in ("model.onnx", "z_copy.onnx"):
        np.testing.assert_allclose(run_model(shared / name), expected, rtol=1e-6)

    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    outer = with_external_data(nested, "x.onnx", scale=2.0)
    inner = with_external_data(nested / "sub", "x.onnx")
    inner_before = (inner.read_bytes(), run_model(inner))
    result = invoke("run", nested, nested / "sub", "-o", nested / "sub", "--no-check")
    assert result.exit_code == 2 and "the input model" in result.output
    assert inner.read_bytes() == inner_before[0]  # outer's output did not land on it
    np.testing.assert_array_equal(run_model(inner), inner_before[1])
    assert outer.is_file()


def test_a_json_output_removes_only_the_sidecars_its_older_version_read(tmp_path: Path) -> None:
    source = builders.write(_model_with_a_64x64_weight(), tmp_path, "export.onnx")
    out = tmp_path / "out"
    assert invoke("run", source, "-o", out / "m.json", "--no-check").exit_code == 0
    first = sorted(p.name for p in out.glob("m.*.npy"))
    users = [out / "m.2024.npy", out / "m.0123456789abcdef.npy"]  # named like sidecars, read by no graph
    for path in users:
        np.save(path, np.arange(3))
    changed = _model_with_a_64x64_weight()
    changed.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.full((64, 64), 3, np.float32), "w"))
    other = builders.write(changed, tmp_path, "other.onnx")
    assert invoke("run", other, "-o", out / "m.json", "--no-check").exit_code == 0
    assert all(path.is_file() for path in users)
    assert not any((out / name).exists() for name in first)  # the old version's sidecars went


# -- 3. one commit of model + weights, and a lock -------------------------------------------


def test_new_weights_get_a_new_name_and_the_old_ones_go_after_the_model(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with_external_data(out, scale=2.0)
    result = invoke("run", source, "-o", out / "model.onnx", "--json", "--external-data")
    assert result.exit_code == 0, result.stderr
    data = Path(json.loads(result.stdout)["output"]["external_data"]["path"])
    assert data.name != "model.onnx.data"  # never the name the old model reads
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", data.name]
    locations = {
        e.value
        for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer
        for e in t.external_data
        if e.key == "location"
    }
    assert locations == {data.name}
    np.testing.assert_allclose(run_model(out / "model.onnx"), run_model(source), rtol=1e-6)


def test_a_second_writer_waits_for_the_lock_then_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = with_external_data(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(files, "LOCK_TIMEOUT", 0.3)
    with files.folder_lock(out, out / "model.onnx"):
        started = time.monotonic()
        line = assert_one_line_error(invoke("run", source, "-o", out / "model.onnx"))
    assert time.monotonic() - started >= 0.3
    assert "another graphopt run is writing" in line and str(out / "model.onnx") in line
    assert [p.name for p in out.iterdir()] == []


def test_concurrent_writers_of_one_output_leave_one_whole_set(tmp_path: Path) -> None:
    sources = []
    for scale in (1.0, 3.0):
        folder = tmp_path / f"in{scale:g}"
        folder.mkdir()
        sources.append(with_external_data(folder, scale=scale))
    expected = [run_model(s) for s in sources]
    out = tmp_path / "out" / "model.onnx"
    errors: list[BaseException] = []

    def write(source: Path) -> None:
        try:
            for _ in range(3):
                optimize_file(source, RunOptions(output=out, check=False, external_data=True))
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=write, args=(s,)) for s in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    found = run_model(out)
    assert any(np.allclose(found, e, rtol=1e-6) for e in expected)
    assert len([p for p in out.parent.iterdir() if p.suffix == ".data"]) == 1
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_a_sweep_by_another_thread_never_takes_a_new_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # test_concurrent_writers_... failed once under load with FileNotFoundError: another thread swept the folder
    # between its creation and its entry among this process's live ones, and took it for a dead run's
    made = tempfile.mkdtemp
    swept: list[bool] = []

    def made_then_swept(*args: Any, **kwargs: Any) -> str:
        path = made(*args, **kwargs)
        sweep = threading.Thread(target=files.remove_stale_staging, args=(tmp_path,))
        sweep.start()
        sweep.join(timeout=0.3)  # a sweep that waits for the folder's entry is still running
        swept.append(not sweep.is_alive())
        return path

    monkeypatch.setattr(files.tempfile, "mkdtemp", made_then_swept)
    with files.staging_folder(tmp_path) as staging:
        assert staging.is_dir()
    assert swept == [False]


# -- 4. the report commits with the model, or neither is written ----------------------------


def deny(monkeypatch: pytest.MonkeyPatch, folder: Path, *, reads: bool = False) -> None:
    """Writes (and with ``reads``, reads) of paths under ``folder`` fail as without permission."""
    folder = folder.resolve()

    def denied(path: Any) -> bool:
        try:
            return Path(os.fsdecode(path)).resolve().is_relative_to(folder)
        except (TypeError, ValueError):
            return False

    def guard(original: Callable[..., Any], writes_only: Callable[..., bool]) -> Callable[..., Any]:
        def guarded(path: Any, *args: Any, **kwargs: Any) -> Any:
            if denied(path) and (reads or writes_only(*args, **kwargs)):
                raise PermissionError(13, "Permission denied", os.fsdecode(path))
            return original(path, *args, **kwargs)

        return guarded

    def opens_for_writing(flags: int = os.O_RDONLY, *_: Any, **__: Any) -> bool:
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    def mode_writes(mode: str = "r", *_: Any, **__: Any) -> bool:
        return any(c in mode for c in "wax+")

    monkeypatch.setattr(os, "open", guard(os.open, opens_for_writing))
    monkeypatch.setattr(os, "mkdir", guard(os.mkdir, lambda *a, **k: True))
    monkeypatch.setattr(io, "open", guard(io.open, mode_writes))
    monkeypatch.setattr("builtins.open", guard(open, mode_writes))


def test_a_report_folder_that_cannot_be_written_stops_the_run_before_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = with_external_data(tmp_path)
    reports = tmp_path / "reports"
    reports.mkdir()
    before = snapshot(tmp_path)
    deny(monkeypatch, reports)
    line = assert_one_line_error(
        invoke("run", source, "-o", tmp_path / "out" / "model.onnx", "--report", reports / "r.json")
    )
    assert "r.json" in line and ".graphopt-" not in line
    assert snapshot(tmp_path) == before


def test_a_report_that_fails_to_commit_puts_the_old_model_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = with_external_data(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with_external_data(out, scale=2.0)
    before = snapshot(tmp_path)
    fail_renaming_onto(monkeypatch, out, ".json")
    result = invoke("run", source, "-o", out / "model.onnx", "--report", out / "report.json")
    assert result.exit_code == 3 and "No space left" in result.stderr and ".graphopt-" not in result.stderr
    assert snapshot(tmp_path) == before


# -- 5. staging folders: never models, never left for long -----------------------------------


def test_folder_runs_skip_staging_folders_and_remove_those_of_dead_runs(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    builders.write(builders.base_model(), models, "good.onnx")
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owners = {"dead": f"{socket.gethostname()} {dead_pid.stdout.strip()}", "live": f"{socket.gethostname()} 1"}
    owners["elsewhere"] = "another-machine 12345"
    for which, owner in owners.items():
        staging = models / f".graphopt-{which}"
        (staging / "output").mkdir(parents=True)
        builders.write(builders.base_model(), staging / "output", "good.onnx")
        (staging / "owner").write_text(owner + "\n")
    result = invoke("run", models, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    assert [row["input"]["path"] for row in json.loads(result.stdout)["models"]] == [str(models / "good.onnx")]
    assert sorted(p.name for p in models.iterdir()) == [
        ".graphopt-elsewhere",
        ".graphopt-live",
        "good.onnx",
        "good.opt.onnx",
    ]


# -- 6. --in-place: through links, keeping the mode -------------------------------------------


def test_in_place_writes_through_a_link_and_keeps_the_mode(tmp_path: Path) -> None:
    target = with_external_data(tmp_path, "real.onnx")
    expected = run_model(target)
    for file in tmp_path.iterdir():
        file.chmod(0o640)
    link = tmp_path / "link.onnx"
    link.symlink_to("real.onnx")
    result = invoke("run", link, "--in-place", "--json")
    assert result.exit_code == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == "real.onnx"
    assert len(onnx.load(str(target)).graph.node) < 6
    data = Path(json.loads(result.stdout)["output"]["external_data"]["path"])
    assert data.parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([data.name, "link.onnx", "real.onnx"])
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and stat.S_IMODE(data.stat().st_mode) == 0o640
    np.testing.assert_allclose(run_model(link), expected, rtol=1e-6)


def test_in_place_keeps_a_read_only_mode(tmp_path: Path) -> None:
    """Named itself, a read-only model may be replaced in place (not through a link: issue 27.7)."""
    target = with_external_data(tmp_path, "real.onnx")
    expected = run_model(target)
    for file in tmp_path.iterdir():
        file.chmod(0o444)
    result = invoke("run", target, "--in-place", "--json")
    assert result.exit_code == 0, result.stderr
    data = Path(json.loads(result.stdout)["output"]["external_data"]["path"])
    assert stat.S_IMODE(target.stat().st_mode) == 0o444 and stat.S_IMODE(data.stat().st_mode) == 0o444
    np.testing.assert_allclose(run_model(target), expected, rtol=1e-6)


def test_in_place_through_a_link_into_another_folder_with_weights_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with_external_data(elsewhere)
    (elsewhere / "model.onnx.data").rename(tmp_path / "model.onnx.data")  # found beside the link
    (tmp_path / "model.onnx").symlink_to(elsewhere / "model.onnx")
    before = snapshot(tmp_path)
    line = assert_one_line_error(invoke("run", tmp_path / "model.onnx", "--in-place"))
    assert "link's target" in line
    assert snapshot(tmp_path) == before


# -- 8. the user's problems are exit 2 and name the user's files ------------------------------


def test_unreadable_input_or_weights_are_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models"
    models.mkdir()
    source = with_external_data(models)
    with monkeypatch.context() as patch:
        deny(patch, source, reads=True)
        line = assert_one_line_error(invoke("run", source, "-o", tmp_path / "out.onnx"))
    assert str(source) in line and "Permission denied" in line
    with monkeypatch.context() as patch:
        deny(patch, models / "model.onnx.data", reads=True)
        line = assert_one_line_error(invoke("run", source, "-o", tmp_path / "out.onnx"))
    assert "model.onnx.data" in line and "cannot be read" in line
    assert not (tmp_path / "out.onnx").exists()


def test_an_output_folder_that_cannot_be_written_is_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = with_external_data(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    deny(monkeypatch, out)
    line = assert_one_line_error(invoke("run", source, "-o", out / "model.onnx"))
    assert str(out / "model.onnx") in line and "Permission denied" in line and ".graphopt-" not in line


def test_output_through_a_file_is_bad_usage_and_an_existing_folder_receives_the_model(tmp_path: Path) -> None:
    source = with_external_data(tmp_path)
    (tmp_path / "out").mkdir()
    assert invoke("run", source, "-o", tmp_path / "out", "-q").exit_code == 0
    assert (tmp_path / "out" / source.name).is_file()
    before = snapshot(tmp_path)
    line = assert_one_line_error(invoke("run", source, "-o", source / "inside.onnx"))  # a file as a folder
    assert str(source / "inside.onnx") in line and ".graphopt-" not in line
    assert snapshot(tmp_path) == before


# -- 9. bounded messages ------------------------------------------------------------------


def test_a_megabyte_error_from_onnxruntime_is_bounded(tmp_path: Path) -> None:
    node = helper.make_node("Transpose", ["x"], ["y"], perm=list(range(200_000)))
    proto = builders.model([node], [builders.float_info("x", [2, 3])], [builders.float_info("y", None)])
    source = builders.write(proto, tmp_path)
    started = time.perf_counter()
    result = invoke("run", source, "-o", tmp_path / "out.onnx", "--json")
    assert time.perf_counter() - started < 30
    assert result.exit_code == 0, result.stderr
    reason = json.loads(result.stdout)["numerics"]["reason"]
    assert len(reason) <= 300 and reason.endswith("..."), reason  # a "not checked" reason fits one log line
    assert len(result.stderr) < 2 * MESSAGE_LIMIT + 2000


# -- 10. negative declared dims ----------------------------------------------------------------


def test_negative_declared_dims_are_read_as_unknown_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proto = builders.base_model()
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -5
    onnx.checker.check_model(proto)  # onnx's checker accepts it: a warning, not a refusal
    source = builders.write(proto, tmp_path)
    with caplog.at_level(logging.WARNING):
        result = invoke("run", source, "-o", tmp_path / "out.onnx")
    assert result.exit_code == 0, result.stderr
    assert any("'x' declares dim -5" in r.getMessage() for r in caplog.records)
    dim = onnx.load(str(tmp_path / "out.onnx")).graph.input[0].type.tensor_type.shape.dim[0]
    assert not dim.HasField("dim_value") and not dim.HasField("dim_param")
    assert invoke("validate", source).exit_code == 0
