"""Latency of an NHWC export: the original, graphopt's default pipeline, onnxruntime's basic level.

    .venv/bin/python benchmarks/unwind_latency.py                      # corpus tf_style_nhwc
    .venv/bin/python benchmarks/unwind_latency.py --model m.onnx --runs 1000

A benchmark, not a test. graphopt writes its output with the default pipeline (the unwind
pass among it; check off, as `graphopt run --no-check`), onnxruntime its basic level's
(``SessionOptions.optimized_model_filepath`` at ORT_ENABLE_BASIC, the transpose optimizer
among it), each in a fresh process (benchmarks/tools.py), and both outputs go through
graphopt's numerics check against the original. The three files then run in one process at
ORT_ENABLE_ALL and ORT_DISABLE_ALL, one thread, interleaved round by round
(:func:`measure.interleaved_latency`): medians, and the median of each round's ratio to the
original (``paired``); graphopt / ort_basic is the quotient of the two paired ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure
from tools import BUILDER, GRAPHOPT, run_tool

CORPUS = Path.home() / ".cache" / "graphopt-corpus"
TOOLS = (GRAPHOPT, "ort_basic")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="the model (default: the corpus' tf_style_nhwc.onnx)")
    parser.add_argument("--runs", type=int, default=500, help="interleaved rounds measured per level")
    parser.add_argument("--warmup", type=int, default=50, help="rounds run first and not measured")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def corpus_model(name: str) -> Path:
    path = CORPUS / f"{name}.onnx"
    if not path.is_file():
        import subprocess

        subprocess.run([sys.executable, str(BUILDER), "--out", str(CORPUS)], check=True)
    return path


def measure_model(src: Path, workdir: Path, runs: int, warmup: int) -> dict[str, Any]:
    models = {"original": src}
    result: dict[str, Any] = {"model": src.name, "runs": runs, "warmup": warmup, "tools": {}}
    for tool in TOOLS:
        out = workdir / tool / src.name
        ran = run_tool(tool, src, out, timeout=600)
        result["tools"][tool] = {"check": ran.check, "error": ran.error}
        if ran.error is None:
            models[tool] = out
    result["nodes"] = {key: measure.node_count(path).total for key, path in models.items()}
    feeds = measure.latency_feeds(src, measure.latency_dims(src, {}))
    result["latency"] = {
        level: measure.interleaved_latency(models, feeds, level, runs=runs, warmup=warmup) for level in measure.LEVELS
    }
    return result


def versus_basic(stats: dict[str, Any]) -> float | None:
    """graphopt's paired ratio over ort_basic's: below 1, graphopt's output is faster."""
    ours, basic = stats.get(GRAPHOPT), stats.get("ort_basic")
    if not isinstance(ours, dict) or not isinstance(basic, dict):
        return None
    return float(ours["paired"]) / float(basic["paired"])


def print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{result['model']}: {result['runs']} interleaved rounds, 1 thread")
    table.add_column("level")
    for key in result["nodes"]:
        table.add_column(f"{key} ({result['nodes'][key]} nodes)", justify="right")
    table.add_column("graphopt / ort_basic", justify="right")
    for level, stats in result["latency"].items():
        cells = []
        for key in result["nodes"]:
            entry = stats.get(key)
            cells.append(
                f"{entry['median_s'] * 1e3:.3f} ms ({entry['paired']:.3f}x)" if isinstance(entry, dict) else str(entry)
            )
        ratio = versus_basic(stats)
        table.add_row(level.removeprefix("ORT_"), *cells, f"{ratio:.3f}" if ratio is not None else "-")
    console.print(table)
    for tool, outcome in result["tools"].items():
        if outcome["error"] or outcome["check"] != "passed":
            console.print(f"{tool}: {outcome['error'] or 'numerics ' + str(outcome['check'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    src = args.model or corpus_model("tf_style_nhwc")
    with tempfile.TemporaryDirectory(prefix="unwind-latency-") as workdir:
        result = measure_model(src, Path(workdir), args.runs, args.warmup)
    print_table(result, Console(stderr=True))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
