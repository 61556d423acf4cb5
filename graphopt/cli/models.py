"""`graphopt convert`, `inspect` and `validate`: one model file at a time, no passes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from graphopt.cli.app import cli, error_line, exit_codes, guarded, stderr, stdout
from graphopt.errors import InputError, InvalidDocument


@cli.command(epilog=exit_codes())
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("destination", type=click.Path(path_type=Path))
@click.option("--external-data/--no-external-data", default=None, help="Write ONNX weights to a .data file.")
@guarded
def convert(source: Path, destination: Path, external_data: bool | None) -> None:
    """Convert between ONNX (.onnx) and graphopt's JSON form (.json), by extension.

    \b
    Examples:
      graphopt convert model.onnx model.json      # readable, diffable; big weights in .npy files
      graphopt convert model.json model.onnx
    """
    from graphopt.io import load, save
    from graphopt.writer import check_model_output, refuse_read_by_others

    check_model_output(destination, "DESTINATION")
    if destination.exists() and destination.resolve() == source.resolve():
        raise InputError(f"{destination}: refusing to overwrite the input")
    # The model and the weights file it would name: never what another model there reads.
    weights = destination.with_name(f"{destination.name}.data")
    refuse_read_by_others([destination, weights], f"the conversion of {source}", ignoring=[destination])
    model = load(source)
    options: dict[str, Any] = {}
    if destination.suffix.lower() != ".json" and external_data is not None:
        options["external_data"] = external_data
    save(model, destination, **options)
    stderr().print(f"wrote {destination}")


@cli.command(epilog=exit_codes())
@click.argument("models", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the inspection as JSON on stdout.")
@guarded
def inspect(models: tuple[Path, ...], as_json: bool) -> None:
    """Show a model's inputs and outputs with dims, op histogram, parameters, opsets, subgraphs;
    given two models, compare them as `graphopt diff A B` does.

    \b
    Examples:
      graphopt inspect model.onnx
      graphopt inspect model.onnx --json | jq .ops
      graphopt inspect model.onnx model.opt.onnx      # side by side
    """
    from graphopt.api import inspect as inspect_model
    from graphopt.cli.diff import show_diff
    from graphopt.report.console import render_inspection

    if len(models) > 2:
        raise click.UsageError(f"inspect takes one model, or two to compare; got {len(models)}")
    if len(models) == 2:
        show_diff(*models, as_json)
        return
    info = inspect_model(models[0])
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        render_inspection(stdout(), info)


@cli.command(epilog=exit_codes())
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@guarded
def validate(files: tuple[Path, ...]) -> None:
    """Validate models: JSON graphs against the schema, then everything with the ONNX checker.
    Every file is validated, and every place a JSON graph breaks the schema is listed, one
    error line each; exit 2 if any file is invalid.

    \b
    Examples:
      graphopt validate model.onnx
      graphopt validate graph.json other.json
    """
    from graphopt.io.validation import validate_file

    console = stderr()
    invalid = 0
    for path in files:
        try:
            validate_file(path)
        except InvalidDocument as err:
            invalid += 1
            for problem in err.problems:
                error_line(problem)
            continue
        except InputError as err:
            invalid += 1
            error_line(str(err))
            continue
        console.print(f"{path}: [green]valid[/green]")
    if invalid:
        sys.exit(2)
