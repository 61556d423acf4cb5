"""Progress where people read it: a spinner or a bar on a terminal; in a CI log or a pipe
one line per phase of a model's run, and one per finished model of a batch, each with the
seconds since the start. Warnings name their model and never land inside a progress line.
"""

from __future__ import annotations

import time
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.status import Status

from graphopt.errors import one_line
from graphopt.report.console import naming

__all__ = ["PhaseLog", "echo_logs", "model_line"]


class PhaseLog:
    """Called with each phase of one run as it starts (``load model.onnx``, ``pass fold``,
    ``save ...``, ``check: the original at {batch=1}``): the spinner's text on a terminal,
    else one line ``[  4.2s] save out.onnx``."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.perf_counter()
        self.status: Status | None = None

    def __enter__(self) -> PhaseLog:
        if self.console.is_terminal:
            self.status = self.console.status("starting", spinner="dots")
            self.status.__enter__()
        return self

    def __exit__(self, *raised: Any) -> None:
        if self.status is not None:
            self.status.__exit__(*raised)

    def __call__(self, phase: str) -> None:
        elapsed = time.perf_counter() - self.started
        if self.status is not None:
            self.status.update(escape(one_line(f"{phase} ({elapsed:.1f} s)")))
        else:
            self.console.print(escape(one_line(f"[{elapsed:6.1f}s] {phase}")))


def model_line(row: dict[str, Any], done: int, total: int, seconds: float) -> str:
    """One finished model of a batch, for the log: its outcome in a few words."""
    path = row["input"]["path"]
    head = f"[{done}/{total} {seconds:.1f}s] {path}: "
    if "error" in row:
        error = row["error"].removeprefix(f"{path}: ")
        return one_line(head + f"error (exit {row['exit_code']}): {error}")
    before, after = row["summary"]["before"]["nodes"], row["summary"]["after"]["nodes"]
    cached = " (from the cache)" if row.get("cache", {}).get("status") == "hit" else ""
    return one_line(head + f"{row['status']}, nodes {before} -> {after}, numerics {row['numerics']['status']}{cached}")


def echo_logs(path: str, records: list[tuple[str, str]]) -> None:
    """Print records captured while ``path`` ran, each naming it (--quiet or not)."""
    for level, message in records:
        click.echo(f"graphopt: {level}: {one_line(naming(path, message))}", err=True)
