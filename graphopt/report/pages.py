"""Writing a report's HTML page and Markdown summary (`--html PATH`, `--markdown PATH`).

The targets are checked before any work, as ``--report``'s is: not a folder, not a model of
the run, not a FIFO or a device, and an existing file only when graphopt wrote it (it begins
with the view's mark). The views are written as the JSON report is, through a temporary file
renamed into place, whenever the run has a report to give (a failed check's too); ``-`` is
stdout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphopt.errors import InputError
from graphopt.files import atomic_write
from graphopt.writer import check_report_output

__all__ = ["Pages"]


@dataclass(frozen=True)
class Pages:
    """Where a command writes the views of its report (None: not asked for)."""

    html: Path | None = None
    markdown: Path | None = None

    def _views(self) -> list[tuple[str, Path, str]]:
        from graphopt.report.html import HTML_MARK
        from graphopt.report.markdown import MARKDOWN_MARK

        asked = (("--html", self.html, HTML_MARK), ("--markdown", self.markdown, MARKDOWN_MARK))
        return [(flag, path, mark) for flag, path, mark in asked if path is not None]

    def check(self, models: Iterable[Path], *, stdout_taken: str | None = None) -> None:
        """Refuse, before any work, a target the views must not replace (InputError, exit 2);
        ``stdout_taken`` names the option that prints on stdout already (--json)."""
        resolved = {model.resolve() for model in models}
        views = self._views()
        on_stdout = [flag for flag, path, _ in views if path == Path("-")] + ([stdout_taken] if stdout_taken else [])
        if len(on_stdout) > 1:
            raise InputError(f"{' and '.join(on_stdout)} would both print on stdout; give one of them a file")
        for flag, path, mark in views:
            if path != Path("-"):  # the guards of every file graphopt writes (graphopt.writer)
                check_report_output(path, resolved, flag, mark=mark.encode(), stranger=f"was not written by {flag}")

    def write(self, report: dict[str, Any]) -> None:
        """Render and write the views asked for of ``report`` (its JSON form)."""
        from graphopt.report.html import render_html
        from graphopt.report.markdown import render_markdown

        for flag, path, _ in self._views():
            text = render_html(report) if flag == "--html" else render_markdown(report)
            if path == Path("-"):
                sys.stdout.write(text)
            else:
                data = text.encode("utf-8")
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, lambda out, data=data: out.write(data))  # type: ignore[misc]
