"""Many models at once: what `graphopt run` does with folders, for the CLI and the Python API.

Discovery reads ``*.onnx`` files and graphopt's own JSON graphs (the ones with its format
marker) and leaves out, with a note, other JSON files (a Hugging Face export's config.json
and tokenizer files), hidden files and folders, the default outputs of earlier runs
(``*.opt.*``) and everything inside the output folder, so that a second run reads what the
first one read. Then: the shard of a CI matrix, each model's output beside its place in the
input folder, the files the models read (no output may replace another model's), a process
pool, the files beside the models copied along, and the CI gate (``check_optimized``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from graphopt.errors import GraphoptError, InputError, bounded
from graphopt.processes import die_with_parent, ending_children_on_sigterm
from graphopt.report.model import FolderReport, GateReport, error_row
from graphopt.runner import RunOptions, batch_reads, is_optimized
from graphopt.runner import optimize_file as optimize_file_with
from graphopt.writer import check_report_output, copy_file, tensor_files_named_by

__all__ = [
    "NOT_A_GRAPH",
    "OUTSIDE",
    "Collected",
    "FolderRun",
    "captured_logs",
    "check_optimized",
    "collect",
    "optimize_folder",
    "run_models",
    "select_shard",
]

NOT_A_GRAPH = "JSON that is not a graphopt graph"
OUTSIDE = "a symbolic link that leads outside the folder"

# One finished model: its report row, its exit code, and the log records of its run.
Finished = tuple[dict[str, Any], int, list[tuple[str, str]]]


@dataclass
class Collected:
    """The models found, and the files left out with the reason (``NOT_A_GRAPH``, ``OUTSIDE``)."""

    sources: list[Path] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)


def _is_other_json(path: Path) -> bool:
    """Well-formed JSON that does not claim graphopt's format: a model folder's config.json,
    a tokenizer's files. A JSON file that cannot be read or parsed (an export cut short), or
    that has the format marker, is taken as a model: its load reports what is wrong (exit 2)."""
    from graphopt.io.json_io import FORMAT_MARKER, is_graph_file
    from graphopt.io.sources import input_file

    if path.suffix.lower() != ".json" or not os.access(path, os.R_OK) or is_graph_file(path):
        return False
    try:
        document = json.loads(input_file(path).read_bytes())
    except (InputError, OSError, ValueError, RecursionError):  # ValueError: not JSON, or not UTF-8
        return False
    return not (isinstance(document, dict) and document.get("format") == FORMAT_MARKER)


def _listing(folder: Path) -> str:
    """What ``folder`` holds, for the refusal of a folder without a model: a few file names."""
    files = sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )
    if not files:
        return "no file"
    return _shown(files, "file")


def _no_model(folder: Path, skipped: Sequence[dict[str, str]]) -> str:
    """The refusal of ``folder`` without a model; where its files were skipped as links that lead
    outside it (a folder of links to models elsewhere), that, and how to run them."""
    links = [Path(s["path"]).relative_to(folder) for s in skipped if s["reason"] == OUTSIDE]
    if not links:
        return f"no model in {folder}: found {_listing(folder)} (looked for *.onnx and graphopt's *.json graphs)"
    count = f"{len(links)} symbolic link{'s' if len(links) > 1 else ''} that lead{'s' if len(links) == 1 else ''}"
    # A shell's glob names the linked models of the folder itself; a linked folder, or a link further down, is
    # named as it is.
    linked_models = all(link.parent == Path() and link.suffix.lower() == ".onnx" for link in links)
    example = folder / "*.onnx" if linked_models else folder / links[0]
    return (
        f"no model in {folder}: skipped {count} outside it ({_shown([str(link) for link in links], 'link')}); "
        f"name them on the command line to run them, e.g. {example}"
    )


def _shown(names: Sequence[str], noun: str) -> str:
    """A few of ``names``, and how many other ``noun`` (singular) there are."""
    more = len(names) - _LISTED
    return ", ".join(names[:_LISTED]) + (f" and {more} other {noun}{'s' if more > 1 else ''}" if more > 0 else "")


# The file names the refusal of a folder without a model lists.
_LISTED = 3


def collect(sources: Sequence[Path], output_folder: Path | None, strict: bool = False) -> Collected:
    """The models among ``sources``; files named on the command line get the rule of the
    files found in folders (a pre-commit hook names every changed file). A link in a folder
    that leads outside it is skipped (refused with ``strict``): a pull request can add one,
    and git stores links; a link named on the command line is the user's choice."""
    found = Collected()
    for source in sources:
        if not source.exists():
            raise InputError(f"{source}: no such file or directory")
        if not source.is_dir():
            if source.is_file() and _is_other_json(source):
                found.skipped.append({"path": str(source), "reason": NOT_A_GRAPH})
            else:
                found.sources.append(source)
            continue
        # An output folder inside this one holds the results of a run, not inputs (a folder
        # written onto itself is left to the overwrite check; a folder inside the output
        # folder is read as any other).
        root = source.resolve()
        excluded = output_folder.resolve() if output_folder is not None else None
        if excluded is not None and (excluded == root or not excluded.is_relative_to(root)):
            excluded = None
        models_before, skipped_before = len(found.sources), len(found.skipped)
        for path in sorted(source.rglob("*")):
            relative = path.relative_to(source)
            # rglob does not enter a linked folder: one that leads outside is skipped as a linked model is.
            linked_folder = path.is_symlink() and path.is_dir()
            if not linked_folder and (
                path.suffix.lower() not in (".onnx", ".json") or not path.is_file() or ".opt." in path.name
            ):
                continue
            if any(part.startswith(".") for part in relative.parts):  # hidden, graphopt's staging folders too
                continue
            if excluded is not None and path.resolve().is_relative_to(excluded):
                continue
            inside = path.resolve().is_relative_to(root)
            if linked_folder and inside:
                continue  # its models are found where it leads
            if not inside:
                if strict:
                    raise InputError(f"{path}: {OUTSIDE} ({path.resolve()}); name it to run it (--strict)")
                found.skipped.append({"path": str(path), "reason": OUTSIDE})
                continue
            if _is_other_json(path):
                found.skipped.append({"path": str(path), "reason": NOT_A_GRAPH})
                continue
            found.sources.append(path)
        if len(found.sources) == models_before:  # an export that failed half way, a wrong path in a matrix
            raise InputError(_no_model(source, found.skipped[skipped_before:]))
    return found


def select_shard(sources: list[Path], shard: tuple[int, int] | None) -> list[Path]:
    """Shard ``i`` of ``n`` (1-based) of ``sources``, every n-th model; a fixed CI matrix may
    have more jobs than models, and the extra shards are empty, not errors."""
    if shard is None:
        return sources
    index, count = shard
    if not 1 <= index <= count:
        raise InputError(f"--shard {index}/{count}: expected i/n with 1 <= i <= n, e.g. 2/4")
    return [s for i, s in enumerate(sources) if i % count == index - 1]


@contextlib.contextmanager
def captured_logs() -> Iterator[list[tuple[str, str]]]:
    """graphopt's log records of the block, as (level, message), instead of on stderr: a
    worker process hands them to the parent, which prints them between progress lines."""
    logger = logging.getLogger("graphopt")
    collector = _Collector()
    saved, saved_propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [collector], False
    try:
        yield collector.records
    finally:
        logger.handlers, logger.propagate = saved, saved_propagate


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname.lower(), record.getMessage()))


def _run_one(source: Path, options: RunOptions) -> Finished:
    """One model of a batch, in a worker process: errors become a report row, and the
    warnings are handed back to be printed, naming the model, between progress lines."""
    with captured_logs() as logs:
        try:
            row, code = optimize_file_with(source, options)
        except GraphoptError as err:
            row, code = error_row(source, bounded(str(err)), err.exit_code), err.exit_code
        except Exception as err:
            row, code = error_row(source, bounded(f"internal error: {type(err).__name__}: {err}"), 3), 3
    return row, code, logs


@dataclass
class FolderRun:
    """What a run of many models did: the report (its ``models`` rows in input order), the
    files copied beside the outputs, and the exit code the CLI gives (the worst model's;
    3 when a pass failed under ``strict``)."""

    report: FolderReport
    copied: list[Path]
    exit_code: int


def run_models(
    roots: Sequence[Path],
    sources: list[Path],
    options: RunOptions,
    *,
    jobs: int = 1,
    report: FolderReport | None = None,
    report_path: Path | None = None,
    on_model: Callable[[Finished], None] | None = None,
    found: Sequence[Path] = (),
) -> FolderRun:
    """Optimize ``sources`` (found in the folders ``roots``, or named) into ``options.output``,
    a folder, each at its place relative to its root; ``on_model`` is told of each model as
    it finishes (in finishing order). ``found``: every model of the run, the other shards'
    too, which are not copied along as files beside the models."""
    roots = [r for r in roots if r.is_dir()]
    output = options.output
    tasks = []
    written: dict[Path, Path] = {}
    for source in sources:
        target = None
        if output is not None:
            root = next((r for r in roots if source.is_relative_to(r)), source.parent)
            target = output / source.relative_to(root)
            if target in written:  # one result would silently replace the other
                raise InputError(f"{source}: its output {target} is also the output of {written[target]}")
            written[target] = source
        tasks.append((source, replace(options, output=target, report=None)))
    if report_path is not None:
        check_report_output(report_path, list(written))
    reads: dict[Path, list[Path]] = {}
    companions: list[tuple[Path, Path]] = []
    if output is not None or options.in_place:
        reads = batch_reads(sources)
        # A raw copy of another shard's model would race its optimized output in a CI matrix.
        models = {path.resolve() for path in found}
        companions = _companions(roots, output, set(reads) | models) if output is not None else []
        plan = _plan(tasks, companions, options.external_data_name, report_path)
        tasks = [(source, replace(task, batch_reads=reads, reserved=_others(plan, source))) for source, task in tasks]
    finished: dict[int, Finished] = {}

    def done(index: int, outcome: Finished) -> None:
        finished[index] = outcome
        if on_model is not None:
            on_model(outcome)

    if jobs == 1:
        for i, (source, task_options) in enumerate(tasks):
            done(i, _run_one(source, task_options))
    else:
        # Workers die with this process, however it ends (processes.py); with fork they all start at once.
        count = min(jobs, max(1, len(tasks)))
        workers = ProcessPoolExecutor(count, initializer=die_with_parent, initargs=(os.getpid(),))
        with workers as pool, ending_children_on_sigterm(multiprocessing.active_children):
            futures = {pool.submit(_run_one, s, o): i for i, (s, o) in enumerate(tasks)}
            for future in as_completed(futures):
                done(futures[future], future.result())
    rows = [finished[i][0] for i in range(len(tasks))]
    copied: list[Path] = []
    if output is not None:
        written_in = {source.parent.resolve() for source, row in zip(sources, rows) if row.get("output")}
        copied = _copy_companions(companions, output, written_in)
    worst = max((finished[i][1] for i in range(len(tasks))), default=0)
    if options.strict and any(row.get("failures") for row in rows):
        worst = max(worst, 3)
    folder_report = replace(report or FolderReport(), models=rows)
    return FolderRun(folder_report, copied, worst)


def _companions(roots: list[Path], output: Path, reads: set[Path]) -> list[tuple[Path, Path]]:
    """The files beside the models of the folders in ``roots`` (a Hugging Face export's
    config.json, tokenizer and vocabulary files) and where each is copied in ``output``:
    tools load a model folder whole. Left out: what the models read (rewritten beside the
    outputs), hidden files and what a link leads to that is hidden (``notes.txt -> .env``),
    earlier outputs (``*.opt.*``), graphopt's temporary files and the output folder itself."""
    excluded = output.resolve()
    found: list[tuple[Path, Path]] = []
    for root in roots:
        inside = root.resolve()
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root)
            resolved = path.resolve()
            if not path.is_file() or resolved in reads or ".opt." in path.name or resolved.is_relative_to(excluded):
                continue
            if not resolved.is_relative_to(inside):  # a link out of the folder (git stores them)
                continue
            # Links resolved first: a visible name may lead to a hidden file of the folder.
            if any(part.startswith(".") for part in (*relative.parts, *resolved.relative_to(inside).parts)):
                continue
            target = output / relative
            if not (target.exists() and target.resolve() == resolved):
                found.append((path, target))
    return found


# A path the run writes: the model whose run writes it (None for a companion) and what it is.
_Planned = tuple[Path | None, str]


def _plan(
    tasks: Sequence[tuple[Path, RunOptions]],
    companions: Sequence[tuple[Path, Path]],
    keep_names: bool,
    report: Path | None,
) -> dict[Path, _Planned]:
    """Every path the run writes under a name known before it starts (resolved): each model's
    output, its weights under a kept name (``--external-data-name``), each companion's copy,
    the ``--report``.
    Two on one path are refused now, before anything is written; content-addressed weights
    names are checked against these when each model is committed."""
    planned: dict[Path, _Planned] = {}

    def add(target: Path, owner: Path | None, what: str) -> None:
        earlier = planned.setdefault(target.resolve(), (owner, what))
        if earlier != (owner, what):
            raise InputError(f"{target}: {earlier[1]} and {what} would both be written there; rename one of them")

    for source, task in tasks:
        if task.output is None or task.output.resolve() == source.resolve():
            continue  # an output onto its input is refused by the model's own run
        add(task.output, source, f"the output of {source}")
        locations = tensor_files_named_by(source) if keep_names and source.suffix.lower() != ".json" else set()
        if len(locations) == 1:  # the name the output's weights keep (the first file read, when several)
            add(
                task.output.parent / Path(next(iter(locations))).name,
                source,
                f"the weights of {task.output} (--external-data-name)",
            )
    for path, target in companions:
        add(target, None, f"the copy of {path}")
    if report is not None:
        add(report, None, f"the --report {report}")
    return planned


def _others(plan: dict[Path, _Planned], source: Path) -> dict[Path, str]:
    """What the run writes that is not the model ``source``'s, by path (RunOptions.reserved)."""
    return {path: what for path, (owner, what) in plan.items() if owner != source}


def _copy_companions(companions: list[tuple[Path, Path]], output: Path, written_in: set[Path]) -> list[Path]:
    """Copy ``companions`` whose folder had a model written, each through a temporary file
    renamed into place (graphopt.writer.copy_file); returns them relative to ``output``."""
    copied: list[Path] = []
    for path, target in companions:
        if path.resolve().parent in written_in:
            copy_file(path, target)
            copied.append(target.relative_to(output))
    return copied


def check_optimized(
    sources: Sequence[Path], options: RunOptions, *, raise_errors: bool = False, report: GateReport | None = None
) -> GateReport:
    """The CI gate over ``sources``: would the pipeline still change each model? Writes
    nothing. A model that cannot be read is a row with its error (raised with ``raise_errors``)."""
    rows: list[dict[str, Any]] = []
    for source in sources:
        try:
            row = is_optimized(source, options)
        except GraphoptError as err:
            if raise_errors:
                raise
            row = {"path": str(source), "optimized": False, "reason": str(err), "exit_code": err.exit_code}
        rows.append(row)
    return replace(report or GateReport(), check_optimized=rows)


def optimize_folder(
    models: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str] | None = None,
    *,
    passes: str | None = None,
    config: str | os.PathLike[str] | None = None,
    jobs: int = 1,
    shard: tuple[int, int] | None = None,
    check: bool = True,
    strict: bool = False,
    in_place: bool = False,
    options: RunOptions | None = None,
    on_model: Callable[[Finished], None] | None = None,
    **settings: Any,
) -> FolderRun:
    """Optimize the models of folders (or files) as ``graphopt run DIR -o OUT/`` does: each
    model checked and written only when it passed, into ``output`` (a folder; beside the
    input as ``*.opt.onnx`` when None), ``jobs`` processes, shard ``(i, n)`` of a CI matrix.
    ``settings`` are run settings and pass knobs (``target="ort"``, ``fold_min_group=3``);
    ``options`` (a :class:`graphopt.runner.RunOptions`) replaces every keyword but ``output``,
    ``jobs`` and ``shard``. Bad input raises :class:`graphopt.errors.InputError`; a model that
    fails is a row of the report with its exit code."""
    named = [Path(models)] if isinstance(models, (str, os.PathLike)) else [Path(m) for m in models]
    folder = Path(output) if output is not None else None
    if options is None:
        options = RunOptions.resolve(
            passes,
            Path(config) if config is not None else None,
            settings=settings,
            check=check,
            strict=strict,
            in_place=in_place,
        )
    options = replace(options, output=folder)
    found = collect(named, folder, options.strict)
    head = FolderReport(shard=f"{shard[0]}/{shard[1]}" if shard else None, skipped=found.skipped)
    sources = select_shard(found.sources, shard)
    return run_models(named, sources, options, jobs=jobs, report=head, on_model=on_model, found=found.sources)


@dataclass
class FileRun:
    """What a run of one model file did: its report (the JSON ``--report`` writes) and the
    exit code ``graphopt run`` gives (1: the check failed, nothing was written)."""

    report: dict[str, Any]
    exit_code: int


def optimize_file(
    model: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    passes: str | None = None,
    config: str | os.PathLike[str] | None = None,
    check: bool = True,
    report: str | os.PathLike[str] | None = None,
    options: RunOptions | None = None,
    **settings: Any,
) -> FileRun:
    """Optimize one model file as ``graphopt run MODEL -o OUTPUT --report REPORT`` does: staged,
    checked, and committed (with the report) only when the check passed; ``output`` defaults to
    ``*.opt.onnx`` beside the input. ``settings`` and ``options`` as :func:`optimize_folder`."""
    if options is None:
        config_path = Path(config) if config is not None else None
        options = RunOptions.resolve(passes, config_path, settings=settings, check=check)
    target = Path(output) if output is not None else None
    options = replace(options, output=target, report=Path(report) if report is not None else options.report)
    found, exit_code = optimize_file_with(Path(model), options)
    return FileRun(found, exit_code)
