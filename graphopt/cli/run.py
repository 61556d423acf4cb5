"""`graphopt run`: optimize models (files or folders), check them, write them and a report.

Folder mode reads ``*.onnx`` files and graphopt's own JSON graphs (the ones with its format
marker) and leaves out, with a note, other JSON files (a Hugging Face export's config.json
and tokenizer files), hidden files and folders, the default outputs of earlier runs
(``*.opt.*``) and everything inside the output folder, so that a second run reads what
the first one read.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from graphopt.cli.app import (
    State,
    cli,
    emit,
    error_line,
    exit_codes,
    fail,
    guarded,
    stderr,
    warning_line,
    with_check_options,
    with_settings,
)
from graphopt.cli.progress import PhaseLog, captured_logs, echo_logs, model_line
from graphopt.errors import GraphoptError, InputError, bounded, one_line
from graphopt.numerics.options import CheckOptions
from graphopt.version import __version__


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 1 <= int(index) <= int(count):
        raise InputError(f"--shard {text!r}: expected i/n with 1 <= i <= n, e.g. 2/4")
    return int(index), int(count)


def _parse_output(text: str | None) -> tuple[Path | None, bool]:
    """The -o path and whether it names a folder: one that exists, or any ending in a slash."""
    if text is None:
        return None, False
    path = Path(text)
    return path, text.endswith(("/", os.sep)) or path.is_dir()


@dataclass
class _Collected:
    sources: list[Path] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)


_NOT_A_GRAPH = "JSON that is not a graphopt graph"
_OUTSIDE = "a symbolic link that leads outside the folder"


def _is_other_json(path: Path) -> bool:
    """A readable JSON file without graphopt's format marker: a model folder's config.json,
    a tokenizer's files (one that cannot be read is left to the load to report)."""
    from graphopt.io.json_io import is_graph_file

    return path.suffix.lower() == ".json" and os.access(path, os.R_OK) and not is_graph_file(path)


def _collect(sources: Sequence[Path], output_folder: Path | None, strict: bool = False) -> _Collected:
    """The models among ``sources``; files named on the command line get the rule of the
    files found in folders (a pre-commit hook names every changed file). A link in a folder
    that leads outside it is skipped (refused with ``strict``): a pull request can add one,
    and git stores links; a link named on the command line is the user's choice."""
    found = _Collected()
    for source in sources:
        if not source.exists():
            raise InputError(f"{source}: no such file or directory")
        if not source.is_dir():
            if source.is_file() and _is_other_json(source):
                found.skipped.append({"path": str(source), "reason": _NOT_A_GRAPH})
            else:
                found.sources.append(source)
            continue
        # An output folder inside this one holds the results of a run, not inputs (a folder
        # written onto itself is left to the overwrite check).
        excluded = output_folder.resolve() if output_folder is not None else None
        if excluded == source.resolve():
            excluded = None
        for path in sorted(source.rglob("*")):
            relative = path.relative_to(source)
            if path.suffix.lower() not in (".onnx", ".json") or not path.is_file() or ".opt." in path.name:
                continue
            if any(part.startswith(".") for part in relative.parts):  # hidden, graphopt's staging folders too
                continue
            if excluded is not None and path.resolve().is_relative_to(excluded):
                continue
            if not path.resolve().is_relative_to(source.resolve()):
                if strict:
                    raise InputError(f"{path}: {_OUTSIDE} ({path.resolve()}); name it to run it (--strict)")
                found.skipped.append({"path": str(path), "reason": _OUTSIDE})
                continue
            if _is_other_json(path):
                found.skipped.append({"path": str(path), "reason": _NOT_A_GRAPH})
                continue
            found.sources.append(path)
    return found


def _run_one(source: Path, options: Any) -> tuple[dict[str, Any], int, list[tuple[str, str]]]:
    """One model of a batch, in a worker process: errors become a report row, and the
    warnings are handed back to be printed, naming the model, between progress lines."""
    from graphopt.runner import optimize_file

    with captured_logs() as logs:
        try:
            row, code = optimize_file(source, options)
        except GraphoptError as err:
            row, code = _error_row(source, bounded(str(err)), err.exit_code), err.exit_code
        except Exception as err:
            row, code = _error_row(source, bounded(f"internal error: {type(err).__name__}: {err}"), 3), 3
    return row, code, logs


def _error_row(source: Path, error: str, exit_code: int) -> dict[str, Any]:
    return {"input": {"path": str(source)}, "error": error, "status": "error", "exit_code": exit_code}


@cli.command(epilog=exit_codes("a model's numerics check failed, or --check-optimized found a model not optimized"))
@click.argument("models", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="Output file (one model), or folder: several models, an existing folder, or a path ending in '/'.",
)
@click.option("--passes", help="Comma list of passes or groups, e.g. 'shape-infer,cleanup'. See `graphopt passes`.")
@click.option(
    "--config", type=click.Path(path_type=Path), help="Pipeline config, TOML or JSON (schemas/pipeline.schema.json)."
)
@click.option("--max-steps", type=click.IntRange(min=1), help="Most iterations of each group (default 8).")
@click.option(
    "--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here ('-': stdout)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--check/--no-check", default=True, show_default=True, help="Compare outputs in onnxruntime.")
@with_check_options
@click.option("--keep-failed", is_flag=True, help="Write the output even when the check fails.")
@click.option("--blame", is_flag=True, help="On a failed check, find the first pass that broke numerics.")
@click.option("--strict", is_flag=True, help="Exit 3 when a pass fails (default: roll it back and go on).")
@click.option("--in-place", is_flag=True, help="Overwrite the input model.")
@click.option("--external-data/--no-external-data", default=None, help="Force weights into (or out of) a .data file.")
@click.option(
    "--external-data-name",
    is_flag=True,
    help="Name the output's weights file as the input's (model.onnx_data), not after its content.",
)
@click.option(
    "--check-optimized",
    is_flag=True,
    help="Exit 1 if the pipeline would still change the model. Writes nothing and runs no numerics check.",
)
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes for several models.",
)
@click.option("--shard", help="Process only shard i of n of the models (i/n, 1-based), for CI matrices.")
@with_settings
@guarded
def run(
    models: tuple[Path, ...],
    output: str | None,
    passes: str | None,
    config: Path | None,
    max_steps: int | None,
    report_path: Path | None,
    as_json: bool,
    check: bool,
    numerics: CheckOptions,
    keep_failed: bool,
    blame: bool,
    strict: bool,
    in_place: bool,
    external_data: bool | None,
    external_data_name: bool,
    check_optimized: bool,
    jobs: int,
    shard: str | None,
    settings: dict[str, Any],
) -> None:
    """Optimize MODELS (files or folders), check numerics, write the result and a report.

    \b
    Examples:
      graphopt run model.onnx                          # writes model.opt.onnx
      graphopt run model.onnx -o out.onnx --passes shape-infer,cleanup --report r.json
      graphopt run model.onnx --dim batch=4 --dim seq=128 --blame
      graphopt run models/ -o optimized/ -j 2 --shard 1/4 --json > report.json
      graphopt run model.onnx --check-optimized        # CI gate: exit 1 if not optimized

    The default pipeline is every pass that exists (see `graphopt passes`). A pass that
    fails is rolled back and reported; the run goes on (--strict makes it exit 3).
    """
    from graphopt.api import resolve_pipeline, resolve_settings
    from graphopt.report import check_report_target
    from graphopt.runner import RunOptions

    if in_place and output is not None:
        raise InputError("--in-place and -o exclude each other")
    if report_path == Path("-"):  # the report as a stream on stdout, as --json prints it
        report_path, as_json = None, True
    if numerics.required and (not check or check_optimized):
        raise InputError(
            f"--require-check: {'--no-check' if not check else '--check-optimized'} runs no numerics check"
        )
    target, into_folder = _parse_output(output)
    options = RunOptions(
        output=target,
        passes=passes,
        config=config,
        max_steps=max_steps,
        check=check,
        numerics=numerics,
        keep_failed=keep_failed,
        blame=blame,
        strict=strict,
        in_place=in_place,
        external_data=external_data,
        external_data_name=external_data_name,
        settings=settings,
        report=report_path,
    )
    resolve_settings(resolve_pipeline(passes, config, max_steps), settings)  # bad pipelines fail before any work
    console = stderr()
    single = len(models) == 1 and not models[0].is_dir() and shard is None
    collected = _collect(models, target if (into_folder or not single) else None, strict)
    for reason, one, many in (
        (_NOT_A_GRAPH, "JSON file that is not a graphopt graph", "JSON files that are not graphopt graphs"),
        (_OUTSIDE, "symbolic link that leads outside its folder", "symbolic links that lead outside their folder"),
    ):
        listed = [s["path"] for s in collected.skipped if s["reason"] == reason]
        if listed:
            kind = one if len(listed) == 1 else many
            console.print(escape(one_line(f"note: skipped {len(listed)} {kind}: {', '.join(listed)}")))
    if not collected.sources:
        if not collected.skipped:
            raise InputError(f"{', '.join(map(str, models))}: no models found (looked for *.onnx and graphopt *.json)")
        single = False  # only files that are not models were named: an empty batch, exit 0
    sources = collected.sources
    selected = _parse_shard(shard)
    if selected is not None:
        index, count = selected
        # A fixed CI matrix may have more jobs than models: the extra shards are empty, not errors.
        sources = [s for i, s in enumerate(sources) if i % count == index - 1]
    if report_path is not None:
        check_report_target(report_path, sources)
    head: dict[str, Any] = {"graphopt_version": __version__}
    if not single:
        head |= {"shard": shard, "skipped": collected.skipped}

    if check_optimized:
        _gate(console, sources, options, head, single, report_path, as_json)
    if single:
        if into_folder:
            assert target is not None
            options = replace(options, output=target / sources[0].name)
        _single(console, sources[0], options, report_path, as_json)
    if sources and target is not None and not into_folder and target.suffix.lower() in (".onnx", ".json"):
        raise InputError(f"{target}: with several models, -o names a folder")
    _batch(console, models, sources, options, head, jobs, report_path, as_json)


def _gate(
    console: Console,
    sources: list[Path],
    options: Any,
    head: dict[str, Any],
    single: bool,
    report_path: Path | None,
    as_json: bool,
) -> None:
    """--check-optimized: exit 1 if the pipeline would still change a model; writes nothing."""
    from graphopt.report import totals
    from graphopt.report.console import failure_line
    from graphopt.runner import is_optimized

    rows: list[dict[str, Any]] = []
    for source in sources:
        try:
            row = is_optimized(source, options)
        except GraphoptError as err:
            if single:
                raise
            row = {"path": str(source), "optimized": False, "reason": str(err), "exit_code": err.exit_code}
        rows.append(row)
        if row["optimized"]:  # the others get their error line below
            console.print(f"{escape(one_line(row['path']))}: [green]optimized[/green]")
    report = head | {"check_optimized": rows}
    if not single:
        report["totals"] = totals(rows)
    emit(report, report_path, as_json)
    for line in map(failure_line, rows):
        if line is not None:
            error_line(line)
    sys.exit(max([row.get("exit_code", 0 if row["optimized"] else 1) for row in rows], default=0))


def _single(console: Console, source: Path, options: Any, report_path: Path | None, as_json: bool) -> None:
    from graphopt.report.console import render_report
    from graphopt.runner import optimize_file

    State.model = str(source)
    with PhaseLog(console) as phases:
        report, code = optimize_file(source, options, on_phase=phases)
    render_report(console, report)
    emit(report, None, as_json)  # the report file is committed with the model
    if options.strict and report["failures"]:
        fail(f"pass {report['failures'][0]['pass']!r} failed: {report['failures'][0]['error']}", 3)
    _say_not_checked(str(source), report, options.numerics.required)
    if code == 1 and report["numerics"]["status"] == "failed":
        fail(f"{source}: numerics failed: {report['numerics']['reason']}", 1)
    sys.exit(code)


def _copy_companions(roots: list[Path], output: Path, reads: set[Path], written_in: set[Path]) -> list[Path]:
    """Copy the files beside the models of the folders in ``roots`` (a Hugging Face export's
    config.json, tokenizer and vocabulary files) into ``output``, where a model of their
    folder was written: tools load a model folder whole. Each copy is a temporary file
    renamed into place. Left out: what the models read (rewritten beside the outputs),
    hidden files, earlier outputs (``*.opt.*``) and the output folder itself."""
    from graphopt.files import atomic_write

    excluded = output.resolve()
    copied: list[Path] = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root)
            resolved = path.resolve()
            if not path.is_file() or resolved in reads or ".opt." in path.name or resolved.parent not in written_in:
                continue
            if any(part.startswith(".") for part in relative.parts) or resolved.is_relative_to(excluded):
                continue
            target = output / relative
            if target.exists() and target.resolve() == resolved:
                continue
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with path.open("rb") as source:
                    atomic_write(target, functools.partial(shutil.copyfileobj, source))
            except OSError as err:
                raise InputError(f"{target}: cannot copy {path} there ({err.strerror or err})") from None
            copied.append(relative)
    return copied


def _say_not_checked(path: str, row: dict[str, Any], required: bool) -> None:
    """A model the check could not verify: one line, --quiet or not (an error under --require-check)."""
    numerics = row.get("numerics", {})
    if numerics.get("status") != "not checked":
        return
    if required:
        error_line(f"{path}: numerics not checked (--require-check): {numerics['reason']}")
    else:
        warning_line(f"{path}: numerics not checked: {numerics['reason']}")


def _batch(
    console: Console,
    models: Sequence[Path],
    sources: list[Path],
    options: Any,
    head: dict[str, Any],
    jobs: int,
    report_path: Path | None,
    as_json: bool,
) -> None:
    from graphopt.report import check_report_target, totals
    from graphopt.report.console import failure_line, render_batch
    from graphopt.runner import batch_reads

    output = options.output
    tasks = []
    roots = [m for m in models if m.is_dir()]
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
        check_report_target(report_path, list(written))
    if output is not None or options.in_place:
        with captured_logs():  # quiet: each model's own run reports what loading it finds
            reads = batch_reads(sources, options)
        tasks = [(source, replace(task, batch_reads=reads)) for source, task in tasks]
    rows_by_index: dict[int, dict[str, Any]] = {}
    worst = 0
    started = time.perf_counter()
    # A bar on a terminal; in a CI log or a pipe, only the line of each finished model.
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        bar = progress.add_task("optimizing", total=len(tasks))

        def finished(index: int, outcome: tuple[dict[str, Any], int, list[tuple[str, str]]]) -> None:
            nonlocal worst
            row, code, logs = outcome
            rows_by_index[index] = row
            worst = max(worst, code)
            echo_logs(row["input"]["path"], logs)
            console.print(escape(model_line(row, len(rows_by_index), len(tasks), time.perf_counter() - started)))
            progress.advance(bar)

        if jobs == 1:
            for i, (source, task_options) in enumerate(tasks):
                finished(i, _run_one(source, task_options))
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(_run_one, s, o): i for i, (s, o) in enumerate(tasks)}
                for future in as_completed(futures):
                    finished(futures[future], future.result())
    rows = [rows_by_index[i] for i in range(len(tasks))]
    if output is not None:
        written_in = {source.parent.resolve() for source, row in zip(sources, rows) if row.get("output")}
        copied = _copy_companions(roots, output, set(reads), written_in)
        if copied:
            listed = ", ".join(str(path) for path in copied)
            files = "other file" if len(copied) == 1 else "other files"
            copied_line = f"copied {len(copied)} {files} of the model folders into {output}: {listed}"
            console.print(escape(one_line(copied_line)))
    report = head | {"models": rows, "totals": totals(rows)}
    if rows:
        render_batch(console, report)
    emit(report, report_path, as_json)
    for row in rows:
        line = failure_line(row)
        if line is not None:
            error_line(line)
        _say_not_checked(row["input"]["path"], row, options.numerics.required)
    if options.strict and any(row.get("failures") for row in rows):
        worst = max(worst, 3)
    sys.exit(worst)
