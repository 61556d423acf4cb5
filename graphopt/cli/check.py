"""`graphopt check`: compare two models' outputs in onnxruntime."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from graphopt.cli.app import cli, exit_codes, fail, guarded, stderr, warning_line, with_check_options
from graphopt.numerics.options import CheckOptions


@cli.command(epilog=exit_codes("the outputs differ"))
@click.argument("original", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("optimized", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON on stdout.")
@guarded
@with_check_options
def check(
    original: Path,
    optimized: Path,
    as_json: bool,
    numerics: CheckOptions,
) -> None:
    """Compare two models' outputs in onnxruntime on the same seeded inputs.

    By default each output must have relative L2 error <= 1e-4 and cosine similarity
    >= 0.9999 (looser for float16 and lower precisions), or stay within an absolute floor at
    its scale. An output that fails these passes when it moves no more than 3 x the original's
    own rounding noise (measured by running the original with its floats moved by half an ulp;
    at most 3e-2): float16 and quantized models are judged by their own precision.
    --atol/--rtol switch to element-wise allclose (see the README).
    Dynamic dims are checked at two different bindings, then at the largest sizes where that
    is cheap (sized to what the model's first ops accept). Exit 1 when they differ, 2 when
    their inputs differ (they cannot be compared); outputs onnxruntime cannot compute, or
    on which the original disagrees with itself, are "not checked" with a warning (exit 0;
    exit 1 with --require-check).

    \b
    Examples:
      graphopt check model.onnx model.opt.onnx
      graphopt check a.onnx b.onnx --dim batch=2 --atol 1e-5 --rtol 1e-4
      graphopt check a.onnx b.onnx --custom-op-library libcustom_ops.so
    """
    import tempfile

    from graphopt.numerics import check_models_isolated
    from graphopt.report.console import render_numerics
    from graphopt.runner import as_onnx

    with tempfile.TemporaryDirectory() as workdir:
        result = check_models_isolated(
            as_onnx(original, Path(workdir) / "original"),
            as_onnx(optimized, Path(workdir) / "optimized"),
            refuse_other_inputs=True,
            **numerics.arguments(),
        )
    outcome = result.as_dict()
    render_numerics(stderr(), outcome, per_output=True)
    if as_json:
        sys.stdout.write(json.dumps(outcome, indent=2, allow_nan=False) + "\n")
    if result.status == "failed":
        fail(f"{optimized}: numerics failed: {result.reason}", 1)
    if result.status == "not checked" and numerics.required:
        fail(f"{optimized}: numerics not checked (--require-check): {result.reason}", 1)
    if result.status == "not checked":
        warning_line(f"{optimized}: numerics not checked: {result.reason}")
