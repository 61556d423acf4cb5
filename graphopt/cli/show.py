"""`graphopt report show`: a written report as people read it, on the console, in HTML or Markdown."""

from __future__ import annotations

from pathlib import Path

import click

from graphopt.cli.app import exit_codes, guarded, stdout
from graphopt.cli.report import load_report, report


@report.command(epilog=exit_codes())
@click.argument("path", metavar="REPORT", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--html", type=click.Path(path_type=Path), help="Write one self-contained HTML page here ('-': stdout).")
@click.option(
    "--markdown", type=click.Path(path_type=Path), help="Write Markdown here, e.g. a CI job summary ('-': stdout)."
)
@guarded
def show(path: Path, html: Path | None, markdown: Path | None) -> None:
    """Show a report (a model's, a folder's, a merged or a --check-optimized one): its tables
    on stdout, or as an HTML page or Markdown.

    \b
    Examples:
      graphopt report show report.json
      graphopt report show all.json --html report.html
      graphopt report show all.json --markdown - >> "$GITHUB_STEP_SUMMARY"
    """
    from graphopt.report.console import render_batch, render_gate, render_report
    from graphopt.report.pages import Pages

    document = load_report(path)
    pages = Pages(html, markdown)
    if html is None and markdown is None:
        console = stdout()
        if "check_optimized" in document:
            render_gate(console, document)
        elif "models" in document:
            render_batch(console, document)
        else:
            render_report(console, document)
        return
    pages.check([])
    pages.write(document)
