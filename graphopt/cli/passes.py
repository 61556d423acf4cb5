"""`graphopt passes`: the registry of passes and the default pipeline."""

from __future__ import annotations

import json
import sys

import click

from graphopt.cli.app import cli, exit_codes, guarded, stdout


@cli.command(epilog=exit_codes())
@click.option("--json", "as_json", is_flag=True, help="Print the registry as JSON on stdout.")
@guarded
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
    console = stdout()
    render_passes(console, registry)
    console.print("default pipeline: " + json.dumps(DEFAULT_PIPELINE))
