"""The `graphopt` command line: a thin layer over graphopt.api.

Exit codes (every command): 0 done; 1 a check or gate failed; 2 bad usage or bad input;
3 internal error. stdout carries only machine output (--json); people read stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from graphopt import __version__
from graphopt.errors import GraphoptError, InputError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_CODES = """\b
Exit codes:
  0  done
  1  a check or gate failed (numerics, --check-optimized)
  2  bad usage or bad input (one line naming the file and the problem)
  3  internal error (one line naming the pass; the traceback with --debug)"""


class _State:
    debug = False
    quiet = False


def _stderr() -> Console:
    return Console(stderr=True, quiet=_State.quiet, highlight=False)


def _fail(message: str, code: int) -> None:
    click.echo(f"graphopt: error: {message}", err=True)
    sys.exit(code)


def _guarded(func: F) -> F:
    """Add --quiet/--debug to a command and turn every failure into one line and its exit code."""

    def wrapper(*args: Any, quiet: bool = False, debug: bool = False, **kwargs: Any) -> Any:
        _State.quiet = _State.quiet or quiet
        _State.debug = _State.debug or debug
        try:
            return func(*args, **kwargs)
        except click.exceptions.Exit:
            raise
        except (click.ClickException, click.Abort):
            raise
        except GraphoptError as err:
            if _State.debug:
                traceback.print_exc()
            _fail(str(err), err.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", 3)
        except Exception as err:  # the last line of defence: one line, never a traceback
            if _State.debug:
                traceback.print_exc()
            _fail(f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", 3)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    wrapper = click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")(wrapper)
    wrapper = click.option("-q", "--quiet", is_flag=True, help="Print nothing on stderr except errors.")(wrapper)
    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="graphopt")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on stderr except errors.")
def cli(debug: bool, quiet: bool) -> None:
    """graphopt: make ONNX models smaller and faster, and prove they still compute the same.

    \b
    Examples:
      graphopt run model.onnx -o model.opt.onnx --report report.json
      graphopt run models/ -o optimized/ -j 2          # a whole folder
      graphopt inspect model.onnx
      graphopt convert model.onnx model.json           # a readable, diffable graph
      graphopt check model.onnx model.opt.onnx
      graphopt passes
    """
    _State.debug = debug
    _State.quiet = quiet
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr)


def _parse_dims(values: Sequence[str]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in values:
        name, sep, number = item.partition("=")
        if not sep or not name or not number.strip().isdigit() or int(number) < 1:
            raise InputError(f"--dim {item!r}: expected NAME=VALUE with a positive integer")
        dims[name.strip()] = int(number)
    return dims


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
                p for p in source.rglob("*") if p.suffix.lower() in (".onnx", ".json") and ".opt." not in p.name
            )
        elif source.exists():
            found.append(source)
        else:
            raise InputError(f"{source}: no such file or directory")
    return found


def _run_one(source: Path, options: Any) -> tuple[dict[str, Any], int]:
    """One model of a batch, in a worker process: errors become a report row."""
    from graphopt.api import optimize_file

    try:
        return optimize_file(source, options)
    except GraphoptError as err:
        return {"input": {"path": str(source)}, "error": str(err), "exit_code": err.exit_code}, err.exit_code
    except Exception as err:
        return {
            "input": {"path": str(source)},
            "error": f"internal error: {type(err).__name__}: {err}",
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
@click.option("--independent-dims", is_flag=True, help="Treat every occurrence of a dim name as its own variable.")
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
@_guarded
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
    independent_dims: bool,
    external_data: bool | None,
    check_optimized: bool,
    jobs: int,
    shard: str | None,
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
    from graphopt.api import RunOptions, is_optimized, optimize_file, resolve_pipeline

    if (atol is None) != (rtol is None):
        raise InputError("--atol and --rtol go together (element-wise check)")
    options = RunOptions(
        output=output,
        passes=passes,
        config=config,
        max_steps=max_steps,
        check=check,
        dims=_parse_dims(dims),
        inputs=inputs,
        atol=atol,
        rtol=rtol,
        keep_failed=keep_failed,
        blame=blame,
        strict=strict,
        in_place=in_place,
        independent_dims=independent_dims,
        external_data=external_data,
    )
    resolve_pipeline(passes, config, max_steps)  # bad pipelines fail before any work
    console = _stderr()
    sources = _collect(models)
    selected = _parse_shard(shard)
    if selected is not None:
        index, count = selected
        sources = [s for i, s in enumerate(sources) if i % count == index - 1]
    single = len(models) == 1 and not models[0].is_dir() and selected is None
    if not sources:
        raise InputError(f"{', '.join(map(str, models))}: no models found (looked for *.onnx and *.json)")

    if check_optimized:
        rows = [is_optimized(s, options) for s in sources]
        report: dict[str, Any] = {"graphopt_version": __version__, "check_optimized": rows}
        for row in rows:
            mark = "[green]optimized[/green]" if row["optimized"] else f"[red]not optimized[/red]: {row['reason']}"
            console.print(f"{row['path']}: {mark}")
        _emit(report, report_path, as_json)
        sys.exit(0 if all(r["optimized"] for r in rows) else 1)

    if single:
        with console.status("optimizing", spinner="dots") as status:
            report, code = optimize_file(sources[0], options, on_pass=lambda r: status.update(f"{r.name} done"))
        from graphopt.report.console import render_report

        render_report(console, report)
        _emit(report, report_path, as_json)
        if strict and report["failures"]:
            _fail(f"pass {report['failures'][0]['pass']!r} failed: {report['failures'][0]['error']}", 3)
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
        tasks.append((source, replace(options, output=target)))
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
    _emit(report, report_path, as_json)
    if strict and any(row.get("failures") for row in report["models"]):
        worst = max(worst, 3)
    sys.exit(worst)


def _emit(report: dict[str, Any], path: Path | None, as_json: bool) -> None:
    from graphopt.report import dumps, write_report

    if path is not None:
        write_report(report, path)
    if as_json:
        sys.stdout.write(dumps(report))


@cli.command(epilog=EXIT_CODES)
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("destination", type=click.Path(path_type=Path))
@click.option("--external-data/--no-external-data", default=None, help="Write ONNX weights to a .data file.")
@_guarded
def convert(source: Path, destination: Path, external_data: bool | None) -> None:
    """Convert between ONNX (.onnx) and graphopt's JSON form (.json), by extension.

    \b
    Examples:
      graphopt convert model.onnx model.json      # readable, diffable; big weights in .npy files
      graphopt convert model.json model.onnx
    """
    from graphopt.io import load, save

    if destination.exists() and destination.resolve() == source.resolve():
        raise InputError(f"{destination}: refusing to overwrite the input")
    model = load(source)
    options: dict[str, Any] = {}
    if destination.suffix.lower() != ".json" and external_data is not None:
        options["external_data"] = external_data
    save(model, destination, **options)
    _stderr().print(f"wrote {destination}")


@cli.command(epilog=EXIT_CODES)
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the inspection as JSON on stdout.")
@_guarded
def inspect(model: Path, as_json: bool) -> None:
    """Show a model's inputs and outputs with dims, op histogram, parameters, opsets, subgraphs.

    \b
    Examples:
      graphopt inspect model.onnx
      graphopt inspect model.onnx --json | jq .ops
    """
    from graphopt.io import load
    from graphopt.report.console import render_inspection
    from graphopt.report.inspection import inspect_model

    info = inspect_model(load(model), str(model))
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        render_inspection(_stderr(), info)


@cli.command(epilog=EXIT_CODES)
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@_guarded
def validate(files: tuple[Path, ...]) -> None:
    """Validate models: JSON graphs against the schema, then everything with the ONNX checker.

    \b
    Examples:
      graphopt validate model.onnx
      graphopt validate graph.json
    """
    from graphopt.io.validation import validate_file

    console = _stderr()
    for path in files:
        validate_file(path)
        console.print(f"{path}: [green]valid[/green]")


@cli.command(epilog=EXIT_CODES)
@click.argument("original", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("optimized", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE", help="Fix a dynamic dim (repeatable).")
@click.option(
    "--inputs", type=click.Path(path_type=Path, exists=True, dir_okay=False), help="Inputs (.npz by input name)."
)
@click.option("--atol", type=float, help="Element-wise check: absolute tolerance (with --rtol).")
@click.option("--rtol", type=float, help="Element-wise check: relative tolerance (with --atol).")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON on stdout.")
@_guarded
def check(
    original: Path,
    optimized: Path,
    dims: tuple[str, ...],
    inputs: Path | None,
    atol: float | None,
    rtol: float | None,
    as_json: bool,
) -> None:
    """Compare two models' outputs in onnxruntime on the same seeded inputs.

    By default each output must have relative L2 error <= 1e-4 and cosine similarity
    >= 0.9999 (robust for deep networks); --atol/--rtol switch to element-wise allclose.
    Dynamic dims are checked at two different bindings. Exit 1 when they differ.

    \b
    Examples:
      graphopt check model.onnx model.opt.onnx
      graphopt check a.onnx b.onnx --dim batch=2 --atol 1e-5 --rtol 1e-4
    """
    import tempfile

    from graphopt.api import _as_onnx
    from graphopt.check import check_models_isolated

    if (atol is None) != (rtol is None):
        raise InputError("--atol and --rtol go together (element-wise check)")
    with tempfile.TemporaryDirectory() as workdir:
        result = check_models_isolated(
            _as_onnx(original, Path(workdir) / "original"),
            _as_onnx(optimized, Path(workdir) / "optimized"),
            dims=_parse_dims(dims) or None,
            inputs=inputs,
            atol=atol,
            rtol=rtol,
        )
    outcome = result.as_dict()
    _render_numerics(outcome)
    if as_json:
        sys.stdout.write(json.dumps(outcome, indent=2, allow_nan=False) + "\n")
    sys.exit({"passed": 0, "failed": 1}.get(result.status, 1))


def _render_numerics(outcome: dict[str, Any]) -> None:
    console = _stderr()
    colour = {"passed": "green", "failed": "red"}.get(outcome["status"], "yellow")
    console.print(
        f"numerics: [{colour}]{outcome['status']}[/{colour}]"
        + (f" ({outcome['reason']})" if outcome.get("reason") else "")
    )
    for binding in outcome.get("bindings", []):
        for entry in binding["outputs"]:
            mark = "ok" if entry["passed"] else f"[red]{entry.get('reason') or 'differs'}[/red]"
            console.print(
                f"  {binding['dims']} {entry['name']}: rel L2 {entry['rel_l2']}, cosine {entry['cosine']}, "
                f"max abs {entry['max_abs']} {mark}"
            )


@cli.command(epilog=EXIT_CODES)
@click.option("--json", "as_json", is_flag=True, help="Print the registry as JSON on stdout.")
@_guarded
def passes(as_json: bool) -> None:
    """List every pass with its options, and the default pipeline.

    \b
    Examples:
      graphopt passes
      graphopt run model.onnx --passes shape-infer,noop,dce
    """
    from graphopt.passes.base import all_passes, option_specs
    from graphopt.passes.pipeline import DEFAULT_PIPELINE
    from graphopt.report.console import render_passes

    registry = [
        {
            "name": name,
            "description": cls.description,
            "options": [vars(spec) for spec in option_specs(cls)],
        }
        for name, cls in sorted(all_passes().items())
    ]
    if as_json:
        sys.stdout.write(json.dumps({"passes": registry, "default_pipeline": DEFAULT_PIPELINE}, indent=2) + "\n")
        return
    console = _stderr()
    render_passes(console, registry)
    console.print("default pipeline: " + json.dumps(DEFAULT_PIPELINE))


def main() -> None:
    os.environ.setdefault("ORT_LOGGING_LEVEL", "3")
    cli(prog_name="graphopt")
