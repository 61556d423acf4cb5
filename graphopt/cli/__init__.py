"""The `graphopt` command line: a thin layer over graphopt.api and graphopt.runner, one module per command."""

from __future__ import annotations

import os

# Importing the command modules registers their commands on the group.
from graphopt.cli import check, diff, models, passes, report, run, show, unwind  # noqa: F401
from graphopt.cli.app import cli

__all__ = ["cli", "main"]


def main() -> None:
    os.environ.setdefault("ORT_LOGGING_LEVEL", "3")
    cli(prog_name="graphopt")
