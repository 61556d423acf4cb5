"""`graphopt passes`: the passes, their options and rules, and the default pipeline."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from graphopt.cli.app import cli, exit_codes, guarded, stdout


@cli.command(epilog=exit_codes())
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON on stdout.")
@guarded
def passes(name: str | None, as_json: bool) -> None:
    """List every pass with its options and rule families, and the default pipeline; with
    NAME, that pass and each of its rules on one line (what fuse's enable / disable take).

    \b
    Examples:
      graphopt passes
      graphopt passes fuse                             # every fuse rule, one line each
      graphopt run model.onnx --passes shape-infer,noop,dce
      graphopt passes --json | jq '.passes[].name'
    """
    from graphopt.passes.base import all_passes, get_pass, option_specs
    from graphopt.passes.pipeline import DEFAULT_PIPELINE
    from graphopt.report.console import render_passes

    chosen = {name: get_pass(name)} if name is not None else dict(sorted(all_passes().items()))
    listing = [
        {
            "name": pass_name,
            "description": cls.description,
            "options": [vars(spec) for spec in option_specs(cls)],
            **({"rules": rules} if (rules := rules_of(pass_name)) else {}),
        }
        for pass_name, cls in chosen.items()
    ]
    if as_json:
        document: dict[str, Any] = {"passes": listing}
        if name is None:
            document["default_pipeline"] = DEFAULT_PIPELINE
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return
    render_passes(stdout(), listing, DEFAULT_PIPELINE if name is None else None, detailed=name is not None)


def rules_of(pass_name: str) -> list[dict[str, Any]]:
    """The rewrite rules of a pass that has them (fuse), as the listing shows them."""
    if pass_name != "fuse":
        return []
    from graphopt.passes.fuse import registered_rules

    return [
        {
            "name": rule.name,
            "family": rule.family,
            "kind": rule.kind,
            "default": rule.default,
            "targets": sorted(rule.targets),
            "min_opset": rule.min_opset,
            "max_opset": rule.max_opset,
            "doc": rule.doc,
        }
        for rule in registered_rules()
    ]
