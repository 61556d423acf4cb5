"""`graphopt run`: optimize models (files or folders), check them, write them and a report."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from graphopt import __version__
from graphopt.cli.app import EXIT_CODES, cli, emit, fail, guarded, parse_dims, stderr, with_settings
from graphopt.errors import GraphoptError, InputError, bounded
from graphopt.files import is_staging


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 1 <= int(index) <= int(count):
        raise InputError(f"--shard {text!r}: expected i/n with 1 <= i <= n, e.g. 2/4")
    return int(index), int(count)


def _collect(sources: Sequence[Path]) -> list[Path]:
    found: list[Path] = []
    for source in sources:
        if source.is_dir():
            found += sorted(
                p
                for p in source.rglob("*")
                if p.suffix.lower() in (".onnx", ".json")
                and ".opt." not in p.name
                and not is_staging(p.relative_to(source))
            )
        elif source.exists():
            found.append(source)
        else:
            raise InputError(f"{source}: no such file or directory")
    return found


def _run_one(source: Path, options: Any) -> tuple[dict[str, Any], int]:
    """One model of a batch, in a worker process: errors become a report row."""
    from graphopt.runner import optimize_file

    try:
        return optimize_file(source, options)
    except GraphoptError as err:
        return {"input": {"path": str(source)}, "error": bounded(str(err)), "exit_code": err.exit_code}, err.exit_code
    except Exception as err:
        return {
            "input": {"path": str(source)},
            "error": bounded(f"internal error: {type(err).__name__}: {err}"),
            "exit_code": 3,
        }, 3


@cli.command(epilog=EXIT_CODES)
@click.argument("models", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output file (one model) or folder (several).")
@click.option("--passes", help="Comma list of passes or groups, e.g. 'shape-infer,cleanup'. See `graphopt passes`.")
@click.option(
    "--config", type=click.Path(path_type=Path), help="Pipeline config, TOML or JSON (schemas/pipeline.schema.json)."
)
@click.option("--max-steps", type=click.IntRange(min=1), help="Most iterations of each group (default 8).")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--check/--no-check", default=True, show_default=True, help="Compare outputs in onnxruntime.")
@click.option(
    "--dim", "dims", multiple=True, metavar="NAME=VALUE", help="Fix a dynamic dim for the check (repeatable)."
)
@click.option(
    "--inputs", type=click.Path(path_type=Path, exists=True, dir_okay=False), help="Check with these inputs (.npz)."
)
@click.option("--atol", type=float, help="Element-wise check: absolute tolerance (with --rtol).")
@click.option("--rtol", type=float, help="Element-wise check: relative tolerance (with --atol).")
@click.option("--keep-failed", is_flag=True, help="Write the output even when the check fails.")
@click.option("--blame", is_flag=True, help="On a failed check, find the first pass that broke numerics.")
@click.option("--strict", is_flag=True, help="Exit 3 when a pass fails (default: roll it back and go on).")
@click.option("--in-place", is_flag=True, help="Overwrite the input model.")
@click.option("--external-data/--no-external-data", default=None, help="Force weights into (or out of) a .data file.")
@click.option(
    "--check-optimized", is_flag=True, help="Write nothing; exit 1 if the pipeline would still change the model."
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
    output: Path | None,
    passes: str | None,
    config: Path | None,
    max_steps: int | None,
    report_path: Path | None,
    as_json: bool,
    check: bool,
    dims: tuple[str, ...],
    inputs: Path | None,
    atol: float | None,
    rtol: float | None,
    keep_failed: bool,
    blame: bool,
    strict: bool,
    in_place: bool,
    external_data: bool | None,
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
    from graphopt.runner import RunOptions, is_optimized, optimize_file

    if (atol is None) != (rtol is None):
        raise InputError("--atol and --rtol go together (element-wise check)")
    options = RunOptions(
        output=output,
        passes=passes,
        config=config,
        max_steps=max_steps,
        check=check,
        dims=parse_dims(dims),
        inputs=inputs,
        atol=atol,
        rtol=rtol,
        keep_failed=keep_failed,
        blame=blame,
        strict=strict,
        in_place=in_place,
        external_data=external_data,
        settings=settings,
        report=report_path,
    )
    resolve_settings(resolve_pipeline(passes, config, max_steps), settings)  # bad pipelines fail before any work
    console = stderr()
    sources = _collect(models)
    selected = _parse_shard(shard)
    if selected is not None:
        index, count = selected
        sources = [s for i, s in enumerate(sources) if i % count == index - 1]
    single = len(models) == 1 and not models[0].is_dir() and selected is None
    if not sources:
        raise InputError(f"{', '.join(map(str, models))}: no models found (looked for *.onnx and *.json)")
    if report_path is not None:
        check_report_target(report_path, sources)

    if check_optimized:
        rows = [is_optimized(s, options) for s in sources]
        report: dict[str, Any] = {"graphopt_version": __version__, "check_optimized": rows}
        for row in rows:
            mark = "[green]optimized[/green]" if row["optimized"] else f"[red]not optimized[/red]: {row['reason']}"
            console.print(f"{row['path']}: {mark}")
        emit(report, report_path, as_json)
        sys.exit(0 if all(r["optimized"] for r in rows) else 1)

    if single:
        with console.status("optimizing", spinner="dots") as status:
            report, code = optimize_file(sources[0], options, on_pass=lambda r: status.update(f"{r.name} done"))
        from graphopt.report.console import render_report

        render_report(console, report)
        emit(report, None, as_json)  # the report file is committed with the model
        if strict and report["failures"]:
            fail(f"pass {report['failures'][0]['pass']!r} failed: {report['failures'][0]['error']}", 3)
        sys.exit(code)

    if output is not None and output.suffix.lower() in (".onnx", ".json"):
        raise InputError(f"{output}: with several models, -o names a folder")
    if in_place and output is not None:
        raise InputError("--in-place and -o exclude each other")
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
    rows_by_index: dict[int, dict[str, Any]] = {}
    worst = 0
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        bar = progress.add_task("optimizing", total=len(tasks))
        if jobs == 1:
            for i, (source, task_options) in enumerate(tasks):
                rows_by_index[i], code = _run_one(source, task_options)
                worst = max(worst, code)
                progress.advance(bar)
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(_run_one, s, o): i for i, (s, o) in enumerate(tasks)}
                for future in as_completed(futures):
                    rows_by_index[futures[future]], code = future.result()
                    worst = max(worst, code)
                    progress.advance(bar)
    report = {
        "graphopt_version": __version__,
        "shard": shard,
        "models": [rows_by_index[i] for i in range(len(tasks))],
    }
    from graphopt.report.console import render_batch

    render_batch(console, report)
    emit(report, report_path, as_json)
    if strict and any(row.get("failures") for row in report["models"]):
        worst = max(worst, 3)
    sys.exit(worst)
