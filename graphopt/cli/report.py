"""`graphopt report merge`: one report of the reports of a CI matrix's shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import jsonschema
from rich.markup import escape

from graphopt.cli.app import cli, error_line, exit_codes, guarded, stderr
from graphopt.errors import InputError
from graphopt.version import __version__


@cli.group()
def report() -> None:
    """Work with run reports (`graphopt run --report FILE`)."""


def load_report(path: Path) -> dict[str, Any]:
    """A report file, read and validated against the report schema (InputError, naming it)."""
    from graphopt.io.sources import input_file
    from graphopt.schemas import schema

    try:
        document: dict[str, Any] = json.loads(input_file(path).read_text(encoding="utf-8"))
        jsonschema.validate(document, schema("report"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: not a JSON report ({err})") from None
    except RecursionError:  # a report graphopt writes is a few levels deep
        raise InputError(f"{path}: not a graphopt report (nested deeper than Python's JSON parser reads)") from None
    except jsonschema.ValidationError as err:
        raise InputError(f"{path}: not a graphopt report ({err.message})") from None
    return document


@report.command(epilog=exit_codes("a merged model failed (its numerics, the gate, or it could not be read)"))
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
    from graphopt.report.console import failure_line, totals_line
    from graphopt.writer import check_report_output

    if output is not None:  # run's guards: never a folder, a special file, an input or a file not a report
        check_report_output(output, reports, "-o", reads_are="one of the reports it merges")

    loaded = [(str(path), load_report(path)) for path in reports]
    try:
        merged = merge_reports(loaded, __version__)
        kind = "check_optimized" if "check_optimized" in merged else "models"
    except ValueError as err:
        raise InputError(f"cannot merge: {err}") from None
    if output is None:
        sys.stdout.write(dumps(merged))
    else:
        write_report(merged, output)
    shards = f" (shards {', '.join(merged['shards'])})" if merged["shards"] else ""
    stderr().print(
        escape(
            f"merged {len(reports)} reports{shards}: {totals_line(merged['totals'])}"
            + (f", wrote {output}" if output is not None else "")
        )
    )
    # As the runs would have: a model that failed fails the merged run (exit 1), named.
    failed = [line for line in map(failure_line, merged[kind]) if line is not None]
    for line in failed:
        error_line(line)
    if failed:
        sys.exit(1)
