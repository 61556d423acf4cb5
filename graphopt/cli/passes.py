"""`graphopt passes`: the registry of passes and the default pipeline."""

from __future__ import annotations

import enum
import json
import sys

import click

from graphopt.cli.app import EXIT_CODES, cli, guarded, stderr


@cli.command(epilog=EXIT_CODES)
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
        sys.stdout.write(
            json.dumps({"passes": registry, "default_pipeline": DEFAULT_PIPELINE}, indent=2, default=_plain) + "\n"
        )
        return
    console = stderr()
    render_passes(console, registry)
    console.print("default pipeline: " + json.dumps(DEFAULT_PIPELINE))


def _plain(value: object) -> object:
    """An option default JSON cannot hold as is: an Enum by its value, anything else as text."""
    return value.value if isinstance(value, enum.Enum) else str(value)
