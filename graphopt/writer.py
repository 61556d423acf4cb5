"""The guards every file graphopt writes goes through, in one place.

`graphopt run`'s model, its weights, its ``--report`` and the report's views (``--html``,
``--markdown``), ``graphopt report merge -o``, ``graphopt convert``'s destination and the
files a folder run copies beside its outputs are all checked here before anything is
written (``graphopt unwind`` writes only to stdout), and refused (InputError, exit 2, one
line naming both files) when the write would:

- replace a folder, a special file (FIFO, device node, socket) or anything in /dev, /proc
  or /sys (:func:`graphopt.files.unwritable_kind`);
- replace an existing file of another kind: a model replaces only a model, a report only
  a report (``-o NOTES`` or ``-o model.onnx`` for a report are someone's files);
- replace a file the run reads, or one that another model of the destination folder reads
  (its weights), whatever that model's file is named: ``model.onnx.bak`` made with ``cp``
  still reads ``model.onnx.<hash>.data`` (:func:`readers`);
- take a name another file of the same run is written under (:func:`refuse_reserved`).

The bytes then go through a temporary file renamed into place (graphopt.files), whose name
marks it as graphopt's, so that the next run removes what a killed one left.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from graphopt.errors import InputError
from graphopt.files import atomic_write, file_digest, is_staging, unwritable_kind

__all__ = [
    "check_model_output",
    "check_report_output",
    "copy_file",
    "readers",
    "refuse_read_by_others",
    "refuse_reserved",
    "same_bytes",
    "tensor_files_named_by",
]

# How every report graphopt writes begins (graphopt.report.dumps keeps the key order).
_REPORT_HEAD = b'{\n  "graphopt_version": '
# A larger file is no model that reads external data: protobuf cannot parse a message
# this large, so neither onnx nor onnxruntime can load it. Larger files are not read.
_MODEL_LIMIT = 2**31


def _refuse_special(path: Path, option: str) -> None:
    if path.is_dir():
        raise InputError(f"{path}: is a folder; {option} needs a file name")
    unwritable = unwritable_kind(path)
    if unwritable is not None:  # a FIFO would block the run, a pipe behind /dev/stdout too
        raise InputError(f"{path}: {unwritable}; {option} writes regular files only")


def _is_replaceable_model(path: Path) -> bool:
    """Whether the file at ``path`` may be replaced by a model: one named .onnx, or one that
    is a model (a file without a model's extension may be anything, NOTES or a key)."""
    from graphopt.io.json_io import is_graph_file
    from graphopt.io.wire import is_model_file

    suffix = path.suffix.lower()
    if suffix == ".json":
        return is_graph_file(path)
    return suffix == ".onnx" or is_model_file(path)


def check_model_output(path: Path, option: str = "-o") -> None:
    """Refuse ``path`` as a model's output: a folder, a special file, a file that is not a model,
    a name with no format graphopt writes (found before any work)."""
    from graphopt.io import check_output_format

    _refuse_special(path, option)
    check_output_format(path)
    if path.is_file() and not _is_replaceable_model(path):
        raise InputError(f"{path}: exists and is not an ONNX model or a graphopt graph; {option} will not replace it")


def check_report_output(
    path: Path,
    reads: Iterable[Path],
    option: str = "--report",
    *,
    reads_are: str = "a model of this run",
    mark: bytes = _REPORT_HEAD,
    stranger: str = "is not a graphopt report",
) -> None:
    """Refuse ``path`` as the output of a report or of one of its views (``--html``): a
    folder, a special file, one of ``reads`` (the files the command reads or writes, which
    are ``reads_are``), an existing file that does not begin with ``mark`` (one graphopt did
    not write: it ``stranger``), a folder this process cannot write into (found before any
    model is written)."""
    _refuse_special(path, option)
    if path.resolve() in {read.resolve() for read in reads}:
        raise InputError(f"{path}: {option} names {reads_are}; give another file name")
    if path.exists():
        try:
            with path.open("rb") as existing:
                head = existing.read(len(mark))
        except OSError as err:
            raise InputError(f"{path}: {option} cannot replace it ({err.strerror or err})") from None
        if head != mark:
            raise InputError(f"{path}: exists and {stranger}; {option} will not replace it")
    if path.parent.is_dir():
        try:
            # A file without a name where the system has them (O_TMPFILE): a kill leaves nothing.
            with tempfile.TemporaryFile(dir=path.parent):
                pass
        except OSError as err:
            raise InputError(f"{path}: {option} cannot write into {path.parent} ({err.strerror or err})") from None


def tensor_files_named_by(file: Path) -> set[str]:
    """The weights files (external data, .npy sidecars) ``file`` names, whatever its name:
    read from its ONNX fields or its JSON without its tensors; empty for other files (one
    without a model's extension is read only up to :data:`_MODEL_LIMIT` bytes)."""
    from graphopt.io.json_io import is_graph_file, sidecar_locations
    from graphopt.io.onnx_io import external_locations
    from graphopt.io.wire import is_model_file

    try:
        named_as_model = file.suffix.lower() in (".onnx", ".pb", ".json")
        if not file.is_file() or is_staging(file) or (not named_as_model and file.stat().st_size > _MODEL_LIMIT):
            return set()
    except OSError:
        return set()
    if is_graph_file(file):
        return sidecar_locations(file)
    return external_locations(file) if is_model_file(file) else set()


def readers(folder: Path, ignoring: Collection[Path] = ()) -> dict[Path, Path]:
    """The files of ``folder`` that a model there reads, resolved, each with one model that
    reads it; every regular file of the folder is a candidate, whatever its name (a copy
    ``model.onnx.bak``, ``model_v1``), but the files in ``ignoring`` (the model a run
    replaces)."""
    skipped = {path.resolve() for path in ignoring}
    found: dict[Path, Path] = {}
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return found
    for entry in entries:
        if entry.resolve() in skipped:
            continue
        for location in tensor_files_named_by(entry):
            found.setdefault((folder / location).resolve(), entry)
    return found


def refuse_read_by_others(targets: Iterable[Path], what: str, ignoring: Collection[Path] = ()) -> None:
    """Refuse replacing or removing an existing file of ``targets`` that another model of
    its folder reads (``ignoring`` the models being replaced); ``what`` says what the write
    is, e.g. "the weights of out/m.onnx"."""
    existing = [target for target in targets if target.is_file()]
    for folder in sorted({target.parent for target in existing}):
        read = readers(folder, ignoring)
        for target in existing:
            reader = read.get(target.resolve()) if target.parent == folder else None
            if reader is not None:
                raise InputError(f"{target}: {reader} reads it; {what} would replace it")


def refuse_reserved(targets: Iterable[Path], reserved: Mapping[Path, str], what: str) -> None:
    """Refuse a target that another file of the same run is written under: ``reserved``
    maps each (resolved) path the run writes for something else to what that is."""
    for target in targets:
        other = reserved.get(target.resolve())
        if other is not None:
            raise InputError(f"{target}: {what} would take the name of {other}; rename one of them")


def same_bytes(staged: Path, existing: Path) -> bool:
    """Whether ``existing`` is a regular file holding the bytes of ``staged`` (read in chunks)."""
    try:
        return (
            existing.is_file()
            and existing.stat().st_size == staged.stat().st_size
            and file_digest(existing) == file_digest(staged)
        )
    except OSError:
        return False


def copy_file(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through a temporary file renamed into place (the next
    run removes one a kill left behind); never onto a folder or a special file, nor over a
    file another model of the folder reads (a target that has these bytes already stays)."""
    _refuse_special(target, "a copy")
    if same_bytes(source, target):
        return
    refuse_read_by_others([target], f"the copy of {source}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with source.open("rb") as data:
            atomic_write(target, functools.partial(shutil.copyfileobj, data))
    except OSError as err:
        raise InputError(f"{target}: cannot copy {source} there ({err.strerror or err})") from None
