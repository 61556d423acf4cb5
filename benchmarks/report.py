"""Shared by bench.py and bigmodel.py: the machine and versions, and BENCHMARKS.md sections.

Each script owns one section of BENCHMARKS.md, between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->``, and rewrites only that one, so running one script never erases the
other's figures.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
_HEADER = """# Benchmarks

How graphopt compares with the tools people use today, measured by the scripts in
`benchmarks/`. Every figure below was written by the script named in its section; rerun it
to refresh them (the sections are rewritten in place).

"""
_PACKAGES = (
    "graphopt",
    "onnx",
    "onnxruntime",
    "numpy",
    "onnxsim",
    "onnxslim",
    "onnxoptimizer",
    "onnxscript",
    "onnx-ir",
)


def versions() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        found["graphopt"] = f"{found.get('graphopt', '?')} ({commit})"
    except (OSError, subprocess.CalledProcessError):
        pass
    return found


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": memory_gb,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def context() -> dict[str, Any]:
    return {"date": datetime.date.today().isoformat(), "machine": machine(), "versions": versions()}


def describe_context(ctx: dict[str, Any]) -> str:
    m = ctx["machine"]
    tools = ", ".join(f"{k} {v}" for k, v in ctx["versions"].items())
    return (
        f"Measured {ctx['date']} on {m['cores']} cores ({m['cpu']}), {m['memory_gb']} GB RAM, "
        f"{m['system']}, Python {m['python']}; {tools}."
    )


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the section ``name`` of ``path`` with ``body``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}\n"
    text = path.read_text(encoding="utf-8") if path.is_file() else _HEADER
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text, encoding="utf-8")
