"""`graphopt report merge`: one report of the reports of a CI matrix's shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import jsonschema

from graphopt import __version__
from graphopt.cli.app import EXIT_CODES, cli, guarded, stderr
from graphopt.errors import InputError


@cli.group()
def report() -> None:
    """Work with run reports (`graphopt run --report FILE`)."""


@report.command(epilog=EXIT_CODES)
@click.argument("reports", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the merged report here (else stdout).")
@guarded
def merge(reports: tuple[Path, ...], output: Path | None) -> None:
    """Merge the reports of several runs (the shards of a CI matrix) into one, with totals.

    Rows are sorted by model path; totals count models, failures (a non-zero exit code),
    models the numerics check could not verify (not checked), and nodes and weight bytes
    before -> after.

    \b
    Examples:
      graphopt report merge shard*.json -o all.json
      graphopt report merge shard1.json shard2.json | jq .totals
    """
    from graphopt.report import dumps, merge_reports, write_report
    from graphopt.report.console import totals_line
    from graphopt.schemas import schema

    loaded = []
    for path in reports:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            jsonschema.validate(document, schema("report"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InputError(f"{path}: not a JSON report ({err})") from None
        except jsonschema.ValidationError as err:
            raise InputError(f"{path}: not a graphopt report ({err.message})") from None
        loaded.append(document)
    try:
        merged = merge_reports(loaded, __version__)
    except ValueError as err:
        raise InputError(f"{', '.join(map(str, reports))}: {err}") from None
    if output is None:
        sys.stdout.write(dumps(merged))
    else:
        write_report(merged, output)
    stderr().print(
        f"merged {len(reports)} reports: {totals_line(merged['totals'])}"
        + (f", wrote {output}" if output is not None else "")
    )
