"""The run report: JSON on disk or stdout, a rich view on stderr (see report/console.py).

The report is assembled from what the other parts hand over (pass runs, model stats,
numerics); this module only writes it, validates it against schemas/report.schema.json,
and strips the timings when two reports are compared for determinism.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from graphopt.files import temporary_file

__all__ = ["dumps", "without_timings", "write_report"]


def dumps(report: Any) -> str:
    return json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_report(report: Any, path: Path) -> None:
    """Write atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = temporary_file(path.parent, path.name)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(dumps(report))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def without_timings(report: Any) -> Any:
    """The report with every timing removed: what must be identical between two runs."""
    if isinstance(report, dict):
        return {k: without_timings(v) for k, v in report.items() if k not in ("seconds",)}
    if isinstance(report, list):
        return [without_timings(v) for v in report]
    return report
