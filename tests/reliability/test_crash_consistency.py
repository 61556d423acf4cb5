"""A run killed at any write or rename leaves the destination loadable: the old set or the new.

graphopt runs in a forked child whose file operations are counted; at the Nth one the child
dies on the spot (``os._exit``: no exception handler, no ``finally``, as with kill -9). For
every N until the run gets through, the destination model must load in onnxruntime with its
external data and compute what the old model or the new one computes, never a mix; the next
complete run removes the staging folders the killed ones left.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from graphopt import files
from graphopt.cli import cli
from tests.reliability.test_atomic_writes import run_model, with_external_data

# What a kill interrupts: every rename, link, removal and mode change, and every chunk of
# model or weights written.
OPERATIONS: list[tuple[Any, str]] = [
    (os, "replace"),
    (os, "rename"),
    (os, "link"),
    (os, "unlink"),
    (os, "chmod"),
    (shutil, "rmtree"),
    (files.HashingFile, "write"),
]
KILLED = 137


def run_killed_at(operation: int, args: list[str]) -> int:
    """Run graphopt with ``args`` in a child killed at its ``operation``-th file operation;
    its exit status (KILLED if it got there)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            count = [0]

            def counted(original: Callable[..., Any]) -> Callable[..., Any]:
                def operation_or_death(*a: Any, **k: Any) -> Any:
                    count[0] += 1
                    if count[0] == operation:
                        os._exit(KILLED)
                    return original(*a, **k)

                return operation_or_death

            for owner, name in OPERATIONS:
                setattr(owner, name, counted(getattr(owner, name)))
            code = CliRunner().invoke(cli, args).exit_code
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def outputs_of(path: Path) -> np.ndarray | None:
    try:
        return run_model(path)
    except Exception:  # onnxruntime cannot load it: a broken set
        return None


def kill_at_every_operation(
    pristine: Path,
    work: Path,
    args: list[str],
    destination_outputs: Callable[[], np.ndarray | None],
    expected_old: np.ndarray,
    expected_new: np.ndarray,
) -> list[str]:
    """Kill the run at its 1st, 2nd, ... file operation, each time on a fresh copy of
    ``pristine`` in ``work``, until it gets through; after every kill the destination must
    compute the old or the new outputs. Returns, per kill, which ("old", "new", "either")."""
    outcomes = []
    for operation in range(1, 500):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work, symlinks=True)
        code = run_killed_at(operation, args)
        found = destination_outputs()
        assert found is not None, f"killed at operation {operation}: the destination does not load"
        is_old = np.allclose(found, expected_old, rtol=1e-6)
        is_new = np.allclose(found, expected_new, rtol=1e-6)
        assert is_old or is_new, f"killed at operation {operation}: the destination computes something else"
        outcomes.append("new" if is_new and not is_old else "old" if is_old and not is_new else "either")
        if code != KILLED:
            assert code == 0
            return outcomes
    pytest.fail("the run never got through")


@pytest.mark.parametrize("in_place", [False, True], ids=["-o onto an older output", "--in-place"])
def test_a_kill_at_any_write_or_rename_leaves_the_old_or_the_new_set(tmp_path: Path, in_place: bool) -> None:
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    source = with_external_data(pristine)
    (pristine / "out").mkdir()
    old = with_external_data(pristine / "out", scale=2.0)  # computes something else
    expected_new = run_model(source)
    expected_old = expected_new if in_place else run_model(old)
    work = tmp_path / "work"
    destination = work / "model.onnx" if in_place else work / "out" / "model.onnx"
    where = ["--in-place"] if in_place else ["-o", str(destination)]
    args = ["run", str(work / "model.onnx"), *where, "--no-check", "--external-data"]
    args += ["--report", str(destination.parent / "report.json")]
    outcomes = kill_at_every_operation(
        pristine, work, args, lambda: outputs_of(destination), expected_old, expected_new
    )
    assert len(outcomes) > 10  # the kills really hit the save and the commit
    if not in_place:
        assert outcomes[0] == "old" and outcomes[-1] == "new"
    # The next complete run into that folder removes what the killed one left.
    shutil.rmtree(work)
    shutil.copytree(pristine, work, symlinks=True)
    assert run_killed_at(8, args) == KILLED
    assert [p for p in destination.parent.iterdir() if p.name.startswith(".graphopt-")]
    assert run_killed_at(0, args) == 0
    assert not [p for p in destination.parent.iterdir() if p.name.startswith(".graphopt-")]
    weights = [p.name for p in destination.parent.iterdir() if p.name.endswith(".data")]
    assert len(weights) == 1  # the old weights are gone, the new ones are the model's


def json_outputs_of(path: Path, scratch: Path) -> np.ndarray | None:
    """What the JSON graph at ``path`` computes (through an ONNX copy), or None if it does not load."""
    from graphopt.io import load, save

    shutil.rmtree(scratch, ignore_errors=True)
    try:
        save(load(path), scratch / "model.onnx")
    except Exception:
        return None
    return outputs_of(scratch / "model.onnx")


def test_a_kill_at_any_rename_leaves_a_json_graph_and_its_sidecars_whole(tmp_path: Path) -> None:
    from graphopt.io import load, save
    from graphopt.ir import Tensor

    pristine = tmp_path / "pristine"
    pristine.mkdir()
    source = with_external_data(pristine)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    old_onnx = with_external_data(scratch, scale=2.0)
    (pristine / "out").mkdir()
    old = load(old_onnx)
    # The bias stays in the JSON text, the weight goes to model.0.npy: an old JSON beside a
    # new sidecar (or the reverse) computes neither model's outputs.
    old.graph.initializers["b"].const = Tensor.from_array(np.full(64, 3, np.float32))
    save(old, pristine / "out" / "model.json")
    assert any(p.suffix == ".npy" for p in (pristine / "out").iterdir())
    expected_new = run_model(source)
    expected_old = json_outputs_of(pristine / "out" / "model.json", tmp_path / "converted")
    assert expected_old is not None and not np.allclose(expected_old, expected_new)
    work = tmp_path / "work"
    destination = work / "out" / "model.json"
    args = ["run", str(work / "model.onnx"), "-o", str(destination), "--no-check"]
    converted = tmp_path / "converted"
    outcomes = kill_at_every_operation(
        pristine, work, args, lambda: json_outputs_of(destination, converted), expected_old, expected_new
    )
    assert outcomes[0] == "old" and outcomes[-1] == "new"
    sidecars = sorted(p.name for p in destination.parent.iterdir() if p.suffix == ".npy")
    assert sidecars and all(len(name.split(".")[1]) == 16 for name in sidecars)  # the old ones are gone
