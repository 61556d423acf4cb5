"""`graphopt run`: optimize models (files or folders), check them, write them and a report.

The work is graphopt.runner's (one model) and graphopt.batch's (many: discovery, shards,
the pool, the gate); this command parses, shows progress, renders and exits.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from graphopt.cache import DEFAULT_LIMIT
from graphopt.cli.app import (
    Number,
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
from graphopt.cli.progress import PhaseLog, echo_logs, model_line
from graphopt.errors import InputError, one_line
from graphopt.numerics.options import CheckOptions
from graphopt.report.pages import Pages

if TYPE_CHECKING:
    from graphopt.report.model import FolderReport, GateReport
    from graphopt.runner import RunOptions


_DIGITS = re.compile("[0-9]+")
# Worker processes of a folder run: at most one per model, and this many in all.
MAX_JOBS = 1024


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard i/n``, read; :func:`graphopt.batch.select_shard` checks the range."""
    if text is None:
        return None
    index, sep, count = text.partition("/")
    if not sep or not _DIGITS.fullmatch(index) or not _DIGITS.fullmatch(count):
        raise InputError(f"--shard {text!r}: expected i/n with 1 <= i <= n, e.g. 2/4")
    return int(index), int(count)


def _parse_output(text: str | None) -> tuple[Path | None, bool]:
    """The -o path and whether it names a folder: one that exists, or any ending in a slash."""
    if text is None:
        return None, False
    path = Path(text)
    return path, text.endswith(("/", os.sep)) or path.is_dir()


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
@click.option(
    "--max-steps", type=Number(whole=True, low=1, high=10**6), help="Most iterations of each group (default 8)."
)
@click.option(
    "--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here ('-': stdout)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--html", type=click.Path(path_type=Path), help="Write the report as one self-contained HTML page here.")
@click.option(
    "--markdown",
    type=click.Path(path_type=Path),
    help="Write the report as Markdown here (a CI job summary; '-': stdout).",
)
@click.option("--check/--no-check", default=True, show_default=True, help="Compare outputs in onnxruntime.")
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
    type=Number(whole=True, low=1, high=MAX_JOBS),
    default=1,
    show_default=True,
    help=f"Worker processes for several models (at most {MAX_JOBS}).",
)
@click.option("--shard", help="Process only shard i of n of the models (i/n, 1-based), for CI matrices.")
@click.option(
    "--cache",
    "cache_folder",
    type=click.Path(path_type=Path),
    envvar="GRAPHOPT_CACHE",
    help="Keep results in this folder (also GRAPHOPT_CACHE): a model already optimized with the same options, "
    "graphopt and onnxruntime is copied from there, not run again.",
)
@click.option(
    "--cache-limit",
    type=Number(low=0, high=1e9),
    default=DEFAULT_LIMIT / 1e6,
    show_default=True,
    help="MB the cache may hold; the results used least recently go first.",
)
@with_settings
@guarded
@with_check_options
def run(
    models: tuple[Path, ...],
    output: str | None,
    passes: str | None,
    config: Path | None,
    max_steps: int | None,
    report_path: Path | None,
    as_json: bool,
    html: Path | None,
    markdown: Path | None,
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
    cache_folder: Path | None,
    cache_limit: float,
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
      graphopt run models/ -o out/ --html report.html --markdown - >> "$GITHUB_STEP_SUMMARY"
      graphopt run models/ -o out/ --cache ~/.cache/graphopt   # unchanged models: copied

    The default pipeline is every pass that exists (see `graphopt passes`). A pass that
    fails is rolled back and reported; the run goes on (--strict makes it exit 3).
    """
    from graphopt.batch import NOT_A_GRAPH, OUTSIDE, collect, select_shard
    from graphopt.cache import ResultCache
    from graphopt.report.model import FolderReport, GateReport
    from graphopt.runner import RunOptions
    from graphopt.writer import check_report_output

    if in_place and output is not None:
        raise InputError("--in-place and -o exclude each other")
    if report_path == Path("-"):  # the report as a stream on stdout, as --json prints it
        report_path, as_json = None, True
    if numerics.required and (not check or check_optimized):
        raise InputError(
            f"--require-check: {'--no-check' if not check else '--check-optimized'} runs no numerics check"
        )
    target, into_folder = _parse_output(output)
    selected = _parse_shard(shard)
    # Resolved once, here: a bad pipeline fails before any work, and no model resolves it again.
    options = RunOptions.resolve(
        passes,
        config,
        max_steps,
        settings,
        output=target,
        check=check,
        numerics=numerics,
        keep_failed=keep_failed,
        blame=blame,
        strict=strict,
        in_place=in_place,
        external_data=external_data,
        external_data_name=external_data_name,
        report=report_path,
        cache=None if cache_folder is None or check_optimized else ResultCache(cache_folder, int(cache_limit * 1e6)),
    )
    console = stderr()
    single = len(models) == 1 and not models[0].is_dir() and shard is None
    collected = collect(models, target if (into_folder or not single) else None, strict)
    if not collected.sources and (check_optimized or numerics.required):  # only files that are not models named
        flag = "--check-optimized" if check_optimized else "--require-check"
        named = ", ".join(s["path"] for s in collected.skipped)
        raise InputError(f"{named}: no model to check ({NOT_A_GRAPH}); {flag} passes only a run that checked one")
    for reason, one, many in (
        (NOT_A_GRAPH, "JSON file that is not a graphopt graph", "JSON files that are not graphopt graphs"),
        (OUTSIDE, "symbolic link that leads outside its folder", "symbolic links that lead outside their folder"),
    ):
        listed = [s["path"] for s in collected.skipped if s["reason"] == reason]
        if listed:
            kind = one if len(listed) == 1 else many
            console.print(escape(one_line(f"note: skipped {len(listed)} {kind}: {', '.join(listed)}")))
    if not collected.sources:
        single = False  # only files that are not models were named: an empty batch, exit 0
    sources = select_shard(collected.sources, selected)
    if report_path is not None:
        check_report_output(report_path, sources)
    pages = Pages(html, markdown)
    pages.check(sources, stdout_taken="--json" if as_json else None)

    if check_optimized:
        gate = GateReport(batch=not single, shard=shard, skipped=collected.skipped)
        _gate(console, sources, options, gate, report_path, as_json, pages)
    if single:
        if into_folder:
            assert target is not None
            options = replace(options, output=target / sources[0].name)
        _single(console, sources[0], options, report_path, as_json, pages)
    if sources and target is not None and not into_folder and target.suffix.lower() in (".onnx", ".json"):
        raise InputError(f"{target}: with several models, -o names a folder")
    head = FolderReport(shard=shard, skipped=collected.skipped)
    _batch(console, models, collected.sources, sources, options, head, jobs, report_path, as_json, pages)


def _gate(
    console: Console,
    sources: list[Path],
    options: RunOptions,
    gate: GateReport,
    report_path: Path | None,
    as_json: bool,
    pages: Pages,
) -> None:
    """--check-optimized: exit 1 if the pipeline would still change a model; writes nothing."""
    from graphopt.batch import check_optimized
    from graphopt.report.console import failure_line

    report = check_optimized(sources, options, raise_errors=not gate.batch, report=gate)
    for row in report.check_optimized:
        if row["optimized"]:  # the others get their error line below
            console.print(f"{escape(one_line(row['path']))}: [green]optimized[/green]")
    emit(report.to_json(), report_path, as_json)
    pages.write(report.to_json())
    for line in map(failure_line, report.check_optimized):
        if line is not None:
            error_line(line)
    sys.exit(report.exit_code)


def _single(
    console: Console, source: Path, options: RunOptions, report_path: Path | None, as_json: bool, pages: Pages
) -> None:
    from graphopt.report.console import render_report
    from graphopt.runner import optimize_file

    State.model = str(source)
    with PhaseLog(console) as phases:
        report, code = optimize_file(source, options, on_phase=phases)
    render_report(console, report)
    emit(report, None, as_json)  # the report file is committed with the model
    pages.write(report)  # its views after it, as a folder run writes its report
    if options.strict and report["failures"]:
        fail(f"pass {report['failures'][0]['pass']!r} failed: {report['failures'][0]['error']}", 3)
    _say_not_checked(str(source), report, options.numerics.required)
    _say_unloadable(str(source), report)
    if code == 1 and report["numerics"]["status"] == "failed":
        fail(f"{source}: numerics failed: {report['numerics']['reason']}", 1)
    sys.exit(code)


def _say_not_checked(path: str, row: dict[str, Any], required: bool) -> None:
    """A model the check could not verify: one line, --quiet or not (an error under --require-check)."""
    numerics = row.get("numerics", {})
    if numerics.get("status") != "not checked":
        return
    if required:
        error_line(f"{path}: numerics not checked (--require-check): {numerics['reason']}")
    else:
        warning_line(f"{path}: numerics not checked: {numerics['reason']}")


def _say_unloadable(path: str, row: dict[str, Any]) -> None:
    """A written output onnxruntime cannot load at its default level where it loads the original, and no rewrite
    explains it (an onnxruntime bug the opset asked for trips): one warning line, --quiet or not."""
    from graphopt.runtime.census import UNLOADED  # onnxruntime's import: not for every command line

    guard = row.get("runtime_guard") or {}
    for loss in guard.get("lost", []) if row.get("exit_code") == 0 else []:
        if loss.get("kind") == UNLOADED:  # its message: "ort session lost: <onnxruntime's refusal>; <why>"
            warning_line(f"{path}: the output is written, but {loss['message'].removeprefix('ort session lost: ')}")


def _batch(
    console: Console,
    models: Sequence[Path],
    found: list[Path],
    sources: list[Path],
    options: RunOptions,
    head: FolderReport,
    jobs: int,
    report_path: Path | None,
    as_json: bool,
    pages: Pages,
) -> None:
    from graphopt.batch import Finished, run_models
    from graphopt.report.console import failure_line, render_batch

    started = time.perf_counter()
    done = 0
    # A bar on a terminal; in a CI log or a pipe, only the line of each finished model.
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        bar = progress.add_task("optimizing", total=len(sources))

        def finished(outcome: Finished) -> None:
            nonlocal done
            row, _, logs = outcome
            done += 1
            echo_logs(row["input"]["path"], logs)
            console.print(escape(model_line(row, done, len(sources), time.perf_counter() - started)))
            progress.advance(bar)

        ran = run_models(
            models, sources, options, jobs=jobs, report=head, report_path=report_path, on_model=finished, found=found
        )
    if ran.copied:
        listed = ", ".join(str(path) for path in ran.copied)
        files = "other file" if len(ran.copied) == 1 else "other files"
        console.print(
            escape(one_line(f"copied {len(ran.copied)} {files} of the model folders into {options.output}: {listed}"))
        )
    report = ran.report.to_json()
    if ran.report.models:
        render_batch(console, report)
    emit(report, report_path, as_json)
    pages.write(report)
    for row in ran.report.models:
        line = failure_line(row)
        if line is not None:  # a model not checked under --require-check among them
            error_line(line)
        else:
            _say_not_checked(row["input"]["path"], row, options.numerics.required)
        _say_unloadable(row["input"]["path"], row)
    sys.exit(ran.exit_code)
