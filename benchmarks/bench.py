"""`make bench`: graphopt's default pipeline against the peer optimizers on the model corpus.

    python benchmarks/bench.py                              # every corpus model, every tool
    python benchmarks/bench.py --models bert_small,resnet50 --quick
    python benchmarks/bench.py --corpus DIR --tools graphopt,onnxslim --json-out out.json

For each model each tool runs in its own process (tools.py): node counts (subgraphs
included; onnxruntime contrib-domain nodes counted apart), bytes written (external data
included), seconds inside the tool after its imports, and peak RSS. graphopt's numerics
check compares every output with the original; a wrong output is marked and never counts
as "best peer". Then one process measures onnxruntime latency of the original and every
output, interleaved run by run, at ORT_ENABLE_ALL and ORT_DISABLE_ALL (1 thread, batch 1,
sequence 64). A tool that crashes or times out gets an "error" cell.

The ratios are graphopt / best portable peer (onnxsim, onnxslim, onnxoptimizer, onnxscript,
ort_basic; ort_extended writes onnxruntime-only ops, so it is shown but not compared):
below 1 is better. Results go to --json-out and to the corpus section of BENCHMARKS.md.

Then, unless --models or --no-exports is given, the real PyTorch exports of
../shared/exports/build.py (~/.cache/graphopt-exports; skipped with a message when absent, since
building them needs torch): exports.py --check (node counts against every peer, independent
numerics) and export_fusions.py (fused ops per target, latency; the "Real exports" section).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure
import report
from exports import EXPORTS
from tools import BUILDER, GRAPHOPT, PEERS, PORTABLE_PEERS, TOOLS, run_tool

DEFAULT_CORPUS = Path.home() / ".cache" / "graphopt-corpus"
# Real image sizes for the models whose image dims are dynamic (a 1x1 image measures nothing,
# and the detector needs sides that are multiples of 32); also used by the numerics check.
MODEL_DIMS: dict[str, dict[str, int]] = {
    "ppocr_v4_det": {"p2o.DynamicDimension.0": 1, "p2o.DynamicDimension.1": 320, "p2o.DynamicDimension.2": 320},
    "ppocr_v4_rec": {"p2o.DynamicDimension.0": 1, "?": 48, "p2o.DynamicDimension.1": 320},
    "ppocr_mobile_cls": {"?": 48},
}
# ppocr_v4_det's sigmoid map is ~1e-5 everywhere on random input, so the check's relative L2
# criterion judges float rounding (max abs error 2e-7 after onnxruntime's own basic fusions);
# compare it element-wise with an absolute floor instead. (atol, rtol)
MODEL_TOLERANCE: dict[str, tuple[float, float]] = {"ppocr_v4_det": (1e-5, 1e-3)}
# Within this fraction of the best peer a latency is a tie: run-to-run noise on this machine.
LATENCY_NOISE = 0.02
NOTE_LENGTH = 240


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus folder (built there if empty)")
    ap.add_argument("--builder", type=Path, default=BUILDER, help="the corpus build script")
    ap.add_argument("--real", action="store_true", help="also build the real paddle2onnx models (build.py --real)")
    ap.add_argument("--models", default="", help="comma list of model names (default: every model in the corpus)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of tools (default: {','.join(TOOLS)})")
    ap.add_argument("--passes", default=None, help="graphopt's pass list (default: its default pipeline)")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE", help="a dynamic dim's size")
    ap.add_argument("--quick", action="store_true", help="few latency runs (a smoke test, not a measurement)")
    ap.add_argument("--runs", type=int, default=50, help="timed latency runs per model and level (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one tool may take on one model")
    ap.add_argument("--json-out", type=Path, default=report.ROOT / "bench-results" / "bench.json")
    ap.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="file whose corpus section to rewrite (default: BENCHMARKS.md, after a full run only: "
        "no --quick, --models or --tools)",
    )
    ap.add_argument("--no-markdown", action="store_true", help="write no markdown at all")
    ap.add_argument(
        "--no-exports", action="store_true", help="skip the real PyTorch exports (exports.py and export_fusions.py)"
    )
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/graphopt-bench"), help="where outputs are written")
    ap.add_argument("--keep", action="store_true", help="keep the optimized models in --work-dir")
    args = ap.parse_args(argv)
    full_run = not (args.quick or args.models or args.tools != ",".join(TOOLS))
    if args.markdown is None and full_run:
        args.markdown = report.BENCHMARKS_MD
    args.dims = {k: int(v) for k, v in (item.split("=", 1) for item in args.dim)}
    if args.quick:
        args.runs, args.warmup = 5, 1
    return args


def corpus_models(args: argparse.Namespace) -> list[Path]:
    wanted = [m for m in args.models.split(",") if m]
    missing = not any(args.corpus.glob("*.onnx")) or any(not (args.corpus / f"{m}.onnx").is_file() for m in wanted)
    if missing or args.real:
        cmd = [sys.executable, str(args.builder), "--out", str(args.corpus)] + (["--real"] if args.real else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    if wanted:
        return [args.corpus / f"{m}.onnx" for m in wanted]
    return sorted(p for p in args.corpus.glob("*.onnx") if not p.name.startswith("big_transformer"))


# -- measuring ----------------------------------------------------------------------------


def bench_model(src: Path, tools: list[str], args: argparse.Namespace, console: Console) -> dict[str, Any]:
    name = src.stem
    # The check binds only the dims named on purpose; it picks the others itself, in two bindings.
    check_dims = MODEL_DIMS.get(name, {}) | args.dims
    dims = measure.latency_dims(src, check_dims)
    original_nodes = measure.node_count(src)
    entry: dict[str, Any] = {
        "model": name,
        "original": {
            "nodes": original_nodes.total,
            "contrib": original_nodes.contrib,
            "bytes": measure.output_bytes(src),
        },
        "tools": {},
        "dims": dims,
    }
    for tool in tools:
        console.print(f"  {name}: {tool} ...", end="")
        run = run_tool(
            tool,
            src,
            args.work_dir / name / tool / src.name,
            timeout=args.timeout,
            passes=args.passes,
            dims=check_dims,
            tolerance=MODEL_TOLERANCE.get(name),
        )
        cell = run.as_dict()
        if run.error is None and run.output:
            counts = measure.node_count(Path(run.output))
            cell.update(nodes=counts.total, contrib=counts.contrib, bytes=measure.output_bytes(Path(run.output)))
            console.print(f" {run.seconds:.2f} s, {counts.total} nodes, check {run.check}")
        else:
            console.print(f" [red]error[/red]: {run.error}")
        entry["tools"][tool] = cell
    feeds = measure.latency_feeds(src, dims)
    paths = {"original": src} | {t: Path(c["output"]) for t, c in entry["tools"].items() if c["output"]}
    entry["latency"] = {}
    entry["load_average"] = [os.getloadavg()[0]]
    for level in measure.LEVELS:
        console.print(f"  {name}: latency at {level}, {len(paths)} models x {args.runs} runs ...")
        entry["latency"][level] = measure.interleaved_latency(paths, feeds, level, runs=args.runs, warmup=args.warmup)
        entry["load_average"].append(os.getloadavg()[0])
    if not args.keep:
        shutil.rmtree(args.work_dir / name, ignore_errors=True)
    return entry


# -- summarizing --------------------------------------------------------------------------

# (key, label, how to read it from a model entry and a tool); lower is better for all.
METRICS = ["nodes", "bytes", "seconds", "peak_rss_mb", *(f"latency:{level}" for level in measure.LEVELS)]
LABELS = {
    "nodes": "nodes",
    "bytes": "size",
    "seconds": "time",
    "peak_rss_mb": "peak RSS",
    "latency:ORT_ENABLE_ALL": "latency ALL",
    "latency:ORT_DISABLE_ALL": "latency DISABLE",
}


def value(entry: dict[str, Any], tool: str, metric: str) -> float | None:
    """The tool's figure for ``metric`` on this model, or None (error, not measured)."""
    if metric.startswith("latency:"):
        # Relative to the original, paired round by round (see measure.py); 1.0 for the original.
        got = entry["latency"][metric.split(":", 1)[1]].get(tool)
        return got.get("paired") if isinstance(got, dict) else None
    cell = entry["original"] if tool == "original" else entry["tools"].get(tool)
    if cell is None or cell.get("error"):
        return None
    got = cell.get(metric)
    return float(got) if got is not None else None


def verified(entry: dict[str, Any], tool: str) -> bool:
    cell = entry["tools"].get(tool)
    return bool(cell) and not cell.get("error") and cell.get("check") == "passed"


def best_peer(entry: dict[str, Any], metric: str) -> tuple[str, float] | None:
    figures = [
        (tool, v)
        for tool in PORTABLE_PEERS
        if verified(entry, tool) and (v := value(entry, tool, metric)) is not None and v > 0
    ]
    return min(figures, key=lambda item: item[1]) if figures else None


def ratios(entry: dict[str, Any]) -> dict[str, Any]:
    """graphopt / best verified portable peer for every metric, and time / onnxslim's."""
    out: dict[str, Any] = {}
    for metric in METRICS:
        mine, best = value(entry, GRAPHOPT, metric), best_peer(entry, metric)
        out[metric] = None if mine is None or best is None else {"ratio": mine / best[1], "best_peer": best[0]}
    mine, slim = value(entry, GRAPHOPT, "seconds"), value(entry, "onnxslim", "seconds")
    out["seconds_vs_onnxslim"] = None if mine is None or not slim else mine / slim
    return out


def targets(entry: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's goals for one model; None when a figure is missing."""
    r = entry["ratios"]

    def below(item: Any, limit: float) -> bool | None:
        got = item["ratio"] if isinstance(item, dict) else item
        return None if got is None else got <= limit

    return {
        "time <= 0.5x onnxslim": below(r["seconds_vs_onnxslim"], 0.5),
        "peak RSS <= lowest peer": below(r["peak_rss_mb"], 1.0),
        "latency ALL <= best peer": below(r["latency:ORT_ENABLE_ALL"], 1.0 + LATENCY_NOISE),
        "latency DISABLE <= best peer": below(r["latency:ORT_DISABLE_ALL"], 1.0 + LATENCY_NOISE),
    }


# -- showing ------------------------------------------------------------------------------


def cell_text(entry: dict[str, Any], tool: str, metric: str) -> str:
    if tool != "original":
        cell = entry["tools"].get(tool)
        if cell is None:
            return "-"
        if cell.get("error"):
            return "error"
    v = value(entry, tool, metric)
    if v is None:
        got = entry["latency"][metric.split(":", 1)[1]].get(tool) if metric.startswith("latency:") else None
        return "error" if isinstance(got, str) else "-"
    if metric == "nodes":
        contrib = (entry["original"] if tool == "original" else entry["tools"][tool]).get("contrib", 0)
        text = f"{v:.0f}" + (f" ({contrib} contrib)" if contrib else "")
    elif metric == "bytes":
        text = f"{v / 1e6:.1f}"
    elif metric == "seconds":
        text = f"{v:.2f}"
    elif metric == "peak_rss_mb":
        text = f"{v:.0f}"
    elif tool == "original":
        text = f"{entry['latency'][metric.split(':', 1)[1]]['original']['median_s'] * 1e3:.3g} ms"
    else:
        text = f"{v:.3f}"
    if tool != "original":
        check = entry["tools"][tool].get("check")
        text += "" if check == "passed" else " (wrong)" if check == "failed" else " (unchecked)"
    return text


TABLE_TITLES = {
    "nodes": "Node counts (subgraphs included; contrib = onnxruntime-only nodes)",
    "bytes": "Output size, MB (external data included)",
    "seconds": "Seconds inside the tool, file to file (load + optimize + save, after imports)",
    "peak_rss_mb": "Peak RSS of the tool's process, MB",
    "latency:ORT_ENABLE_ALL": "Latency at ORT_ENABLE_ALL: original's median in ms, outputs relative to it",
    "latency:ORT_DISABLE_ALL": "Latency at ORT_DISABLE_ALL: original's median in ms, outputs relative to it",
}


def metric_rows(entries: list[dict[str, Any]], tools: list[str], metric: str) -> tuple[list[str], list[list[str]]]:
    columns = ["original", *tools] if metric in ("nodes", "bytes") or metric.startswith("latency:") else tools
    rows = [[e["model"], *(cell_text(e, t, metric) for t in columns)] for e in entries]
    return ["model", *columns], rows


def ratio_text(item: Any) -> str:
    if item is None:
        return "-"
    if isinstance(item, dict):
        return f"{item['ratio']:.2f} ({item['best_peer']})"
    return f"{item:.2f}"


def ratio_rows(entries: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["model", *(LABELS[m] for m in METRICS), "time / onnxslim"]
    rows = [
        [e["model"], *(ratio_text(e["ratios"][m]) for m in METRICS), ratio_text(e["ratios"]["seconds_vs_onnxslim"])]
        for e in entries
    ]
    return header, rows


def target_rows(entries: list[dict[str, Any]], no: str = "**no**") -> tuple[list[str], list[list[str]]]:
    names = list(entries[0]["targets"]) if entries else []
    mark = {True: "yes", False: no, None: "-"}
    return ["model", *names], [[e["model"], *(mark[e["targets"][n]] for n in names)] for e in entries]


def print_tables(entries: list[dict[str, Any]], tools: list[str], console: Console) -> None:
    for metric in METRICS:
        header, rows = metric_rows(entries, tools, metric)
        table = Table(*header, title=TABLE_TITLES[metric])
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for title, (header, rows) in (
        ("graphopt / best verified portable peer (< 1 is better)", ratio_rows(entries)),
        ("Targets", target_rows(entries, no="[red]no[/red]")),
    ):
        table = Table(*header, title=title)
        for row in rows:
            table.add_row(*row)
        console.print(table)


def notes(entries: list[dict[str, Any]]) -> list[str]:
    found = []
    for e in entries:
        for tool, cell in e["tools"].items():
            if cell.get("error"):
                found.append(f"{e['model']}: {tool} failed: `{cell['error']}`")
            elif cell.get("check") not in ("passed", None):
                reason = (cell.get("check_reason") or "")[:NOTE_LENGTH]
                found.append(f"{e['model']}: {tool}'s output check: {cell['check']} ({reason})")
            found += [f"{e['model']}: {tool}: {note}" for note in cell.get("notes", [])]
        for level, results in e["latency"].items():
            found += [f"{e['model']}: {t} at {level}: {r}" for t, r in results.items() if isinstance(r, str)]
    return found


def load_text(entries: list[dict[str, Any]]) -> str:
    loads = [load for e in entries for load in e["load_average"]]
    return f"{min(loads):.1f} to {max(loads):.1f}" if loads else "-"


def markdown(result: dict[str, Any]) -> str:
    entries, tools = result["models"], result["tools"]
    parts = [
        "## The corpus against the peers (`make bench`)",
        report.describe_context(result["context"]),
        f"Latency: {result['runs']} interleaved rounds after {result['warmup']} warm-up rounds, "
        "intra_op_num_threads=1, batch 1, sequence 64 (image models: the sizes in bench.py's MODEL_DIMS); an output's "
        "latency is the median over rounds of its time / the original's time in the same round. "
        f"1-minute load average during the latency runs: {load_text(entries)} (the machine is shared; above 1 "
        "another process competed for the second core). Ratios are graphopt / the best portable peer whose output "
        "passed the numerics check (onnxsim, onnxslim, onnxoptimizer, onnxscript, ort_basic); below 1 is better. "
        "ort_extended writes onnxruntime-only contrib ops and is shown for reference only. "
        f"Latencies within {LATENCY_NOISE:.0%} of the best peer count as meeting the target (run-to-run noise).",
        "### graphopt / best peer",
        report.md_table(*ratio_rows(entries)),
        "### Targets",
        report.md_table(*target_rows(entries)),
    ]
    for metric in METRICS:
        parts += [f"### {TABLE_TITLES[metric]}", report.md_table(*metric_rows(entries, tools, metric))]
    found = notes(entries)
    if found:
        parts += ["### Errors and notes", "\n".join(f"- {n}" for n in found)]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)
    tools = [t for t in args.tools.split(",") if t]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        console.print(f"unknown tool(s): {', '.join(sorted(unknown))}; known: {', '.join(TOOLS)}")
        return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for src in corpus_models(args):
        console.print(f"[bold]{src.stem}[/bold]")
        entry = bench_model(src, tools, args, console)
        entry["ratios"] = ratios(entry)
        entry["targets"] = targets(entry)
        entries.append(entry)
    result = {
        "context": report.context(),
        "runs": args.runs,
        "warmup": args.warmup,
        "tools": tools,
        "peers": [t for t in tools if t in PEERS],
        "models": entries,
    }
    print_tables(entries, tools, console)
    console.print(f"load average during the latency runs: {load_text(entries)}")
    for line in notes(entries):
        console.print(f"note: {line}")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    console.print(f"results: {args.json_out}")
    if args.markdown and not args.no_markdown:
        report.write_section("bench-corpus", markdown(result), args.markdown)
        console.print(f"updated: {args.markdown}")
    if not (args.no_exports or args.models):
        return bench_exports(args, console)
    return 0


def bench_exports(args: argparse.Namespace, console: Console) -> int:
    """The real PyTorch exports: node counts against every peer (exports.py, with the independent numerics
    check), then fused ops, targets and latency (export_fusions.py, which owns their BENCHMARKS.md section)."""
    if not (EXPORTS / "index.json").is_file():
        console.print(
            f"skipping the real exports: no index.json in {EXPORTS} "
            "(they need torch to build: see ../shared/exports/build.py)"
        )
        return 0
    here = Path(__file__).resolve().parent
    counts = subprocess.run([sys.executable, str(here / "exports.py"), "--check"], check=False)
    fusions_args = ["--runs", str(args.runs), "--warmup", str(args.warmup)]
    if not args.markdown or args.no_markdown:
        fusions_args.append("--no-markdown")
    fusions = subprocess.run([sys.executable, str(here / "export_fusions.py"), *fusions_args], check=False)
    return max(counts.returncode, fusions.returncode)


if __name__ == "__main__":
    sys.exit(main())
