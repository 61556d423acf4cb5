"""`graphopt diff A B` (and `graphopt inspect A B`): two models side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from graphopt.cli.app import cli, exit_codes, guarded, stdout


def show_diff(a: Path, b: Path, as_json: bool) -> None:
    from graphopt.api import diff as diff_models
    from graphopt.report.console import render_diff

    found = diff_models(a, b)
    if as_json:
        sys.stdout.write(json.dumps(found, indent=2) + "\n")
    else:
        render_diff(stdout(), found)


@cli.command(epilog=exit_codes())
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON on stdout.")
@guarded
def diff(a: Path, b: Path, as_json: bool) -> None:
    """Compare two models: inputs and outputs with dims, op histograms with their change,
    the ops B has more of (fused), parameters, weight and file sizes, opsets.

    A and B are .onnx files or graphopt JSON graphs, typically a model and its optimized
    output.

    \b
    Examples:
      graphopt diff model.onnx model.opt.onnx
      graphopt inspect model.onnx model.opt.onnx     # the same
      graphopt diff model.onnx model.opt.onnx --json | jq .fused
    """
    show_diff(a, b, as_json)
